"""One live chief per logdir, and a lock released only when nothing can still write.

``LogdirLock`` is an exclusive ``flock`` on ``<logdir>/.asupervisor.lock``: the
kernel drops it when its process dies, however it dies, so a lock left by a killed
run never blocks the next one.

``WriteGuard`` ties the lock to the session's writers. A save enters the guard
before it writes into the logdir, and the lock is checked to be still the file on
disk (deleted or replaced, it no longer keeps another chief out). When the session
closes, the lock is released at once if no save is under way, or else by the last
save to leave (a write abandoned on a stuck thread still finishes under the lock).
After close, no new save may enter: ``Fenced`` is raised instead.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ._errors import LogdirLockedError
from ._log import log
from ._worker import Fenced


class LogdirLock:
    NAME = ".asupervisor.lock"

    def __init__(self, logdir: str) -> None:
        self.path = os.path.join(logdir, self.NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``LogdirLockedError``; never leaves a descriptor open
        on failure. A symlink in the lock's place is refused, not followed."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise type(exc)(
                exc.errno,
                f"cannot write into logdir {os.path.dirname(self.path)!r}: "
                f"its lock file {self.path} could not be opened ({why})",
            ) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                raise LogdirLockedError(
                    f"logdir {os.path.dirname(self.path)!r} is in use by another chief "
                    f"(pid {holder}); give each run its own logdir, or make this one a non-chief"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except BaseException:
            os.close(fd)  # closing drops the flock: nothing is left held
            raise
        self._fd = fd

    def check(self) -> None:
        """Raise ``LogdirLockedError`` if the lock file on disk is no longer ours (deleted,
        or replaced): another chief could have taken a new lock and be writing too."""
        if self._fd is None:
            return
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path, follow_symlinks=False)
            same = (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev)
        except FileNotFoundError:
            same = False
        if not same:
            raise LogdirLockedError(
                f"the lock file {self.path} was removed or replaced while this chief held "
                "it: another chief may be writing this logdir too; stopping without saving "
                "into it"
            )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WriteGuard:
    """Counts the saves under way; releases the lock when closed and none is left."""

    def __init__(self, lock: LogdirLock | None) -> None:
        self.lock = lock  # None: a guard over no logdir of this process's own
        self._mutex = threading.Lock()
        self._writers = 0
        self.closed = False

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._mutex:
            if self.closed:
                raise Fenced("the session has closed: nothing more is written into its logdir")
            if self.lock is not None:
                self.lock.check()  # still the one writer of this logdir
            self._writers += 1
        try:
            yield
        finally:
            with self._mutex:
                self._writers -= 1
                release = self.closed and self._writers == 0
            if release:
                self._release(late=True)

    def close(self) -> None:
        with self._mutex:
            self.closed = True
            release = self._writers == 0
        if release:
            self._release(late=False)
        else:
            log.warning("logdir.lock_held", reason="a save is still writing; released when it ends")

    def _release(self, late: bool) -> None:
        if self.lock is not None:
            self.lock.release()
            if late:
                log.info("logdir.lock_released", reason="the last write ended")
