"""One live chief per logdir, and a lock released only when nothing can still write.

``LogdirLock`` is an exclusive ``flock`` on ``<logdir>/.asupervisor.lock``: the
kernel drops it when its process dies, however it dies, so a lock left by a killed
run never blocks the next one. An object store (``gs://``, ``s3://``) has no locks:
there ``LeaseLock`` writes a lease object naming its owner and its expiry, renewed
by a heartbeat; ``make_lock`` picks the one the logdir's file system allows.

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
import json
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from .._errors import Fenced, LogdirLockedError
from .._log import log
from .heartbeat import ENV_ATTEMPT, ENV_RUN
from .store import Store

LEASE_SECS = 30.0  # a lease not renewed for this long is a dead chief's


class LogdirLock:
    NAME = ".asupervisor.lock"

    def __init__(self, logdir: str) -> None:
        self.path = os.path.join(logdir, self.NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``LogdirLockedError``; never leaves a descriptor open
        on failure. A symlink in the lock's place is refused, not followed."""
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise type(exc)(
                exc.errno,
                f"cannot write into logdir {os.path.dirname(self.path)!r}: "
                f"its lock file {self.path} could not be opened ({why})",
            ) from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(
                    errno.EINVAL,
                    f"cannot write into logdir {os.path.dirname(self.path)!r}: its lock file "
                    f"{self.path} is not a regular file",
                )
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


def _run_and_attempt() -> tuple[str | None, int | None]:
    """The run and attempt ``asupervisor run`` gave this process (``None`` outside one)."""
    try:
        attempt: int | None = int(os.environ.get(ENV_ATTEMPT, ""))
    except ValueError:
        attempt = None
    return os.environ.get(ENV_RUN) or None, attempt


class LeaseLock:
    """One chief per object-store logdir: a lease object ``.asupervisor.lease`` holding
    the owner and the wall-clock time it expires, renewed every third of its length by
    a heartbeat thread, and re-read before each save.

    Its limits, as any lease on a store without compare-and-swap: two chiefs starting
    within the same moment can both see no lease, both write one, and the later write
    wins; the loser finds out when it reads the lease back (before its first write)
    or at its next save, and stops with ``LogdirLockedError``. Hosts' clocks must agree
    to well within ``LEASE_SECS``. A killed chief's lease blocks a new chief until it
    expires (at most ``LEASE_SECS``); the error says when. Except under ``asupervisor
    run``: the lease names the run and attempt of its chief, and a chief of a later
    attempt of the same run takes it over at once (the runner starts an attempt only
    once every process of the one before has exited: that chief is dead).

    A lease that is there but cannot be read (the store failing, or TF's cache of its
    length gone stale) is nobody's to take: a new chief reads it again for a heartbeat's
    time and is refused if it still cannot. The holder keeps it while its own last
    renewal is unexpired (no chief takes over an unexpired lease), so a save does not
    fail on it.
    """

    NAME = ".asupervisor.lease"
    SIZE = 256  # every lease is written this long: see _write

    def __init__(self, store: Store, seconds: float = LEASE_SECS) -> None:
        self.store, self.seconds = store, seconds
        self.path = store.path(self.NAME)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.run, self.attempt = _run_and_attempt()
        self._stop = threading.Event()
        self._lost: str | None = None
        self._expires = 0.0  # of this chief's last lease written
        self._heartbeat: threading.Thread | None = None

    def _read(self) -> dict[str, object] | None:
        """The lease, or ``None`` if there is none; ``LeaseUnreadable`` if it is there
        but cannot be read or is not a lease."""
        import tensorflow as tf

        try:
            data = self.store.read_if_there(self.NAME)
            if data is None:
                return None
        except (FileNotFoundError, tf.errors.NotFoundError):
            return None  # removed since it was seen
        except (OSError, tf.errors.OpError) as exc:
            raise LeaseUnreadable(f"{type(exc).__name__}: {exc}") from exc
        try:
            lease = json.loads(data)
            float(lease["expires"])
        except (ValueError, TypeError, KeyError) as exc:
            raise LeaseUnreadable(f"not a lease: {data[:60]!r}") from exc
        return dict(lease)

    def _write(self) -> None:
        expires = time.time() + self.seconds
        # Always the same length: TF's GCS client remembers an object's length for a
        # while (GCS_STAT_CACHE_MAX_AGE) and fails a read that comes back shorter.
        fields = {"owner": self.owner, "expires": expires, "run": self.run, "attempt": self.attempt}
        lease = json.dumps(fields).ljust(self.SIZE)
        self.store.write(self.NAME, lease.encode())
        self._expires = expires

    def _read_patiently(self) -> dict[str, object] | None:
        """The lease, read again while it cannot be read, for a heartbeat's time (a
        stale cache lets go by then); still unreadable, the chief is refused."""
        deadline = time.monotonic() + self.seconds / 3
        while True:
            try:
                return self._read()
            except LeaseUnreadable as exc:
                if time.monotonic() >= deadline:
                    raise LogdirLockedError(
                        f"logdir {self.store.root!r}: its lease {self.path} is there but "
                        f"could not be read ({exc}), so it may be a live chief's and is not "
                        "taken over; if no chief runs on this logdir, remove it"
                    ) from None
            time.sleep(min(0.5, self.seconds / 30))

    def acquire(self) -> None:
        held = self._read_patiently()
        if held is not None and held.get("owner") != self.owner:
            expires = float(held.get("expires", 0))  # type: ignore[arg-type]
            if expires > time.time() and self._succeeds(held):
                log.warning("logdir.lease_taken_over", path=self.path, owner=held.get("owner"),
                            run=self.run, attempt=held.get("attempt"))  # fmt: skip
            elif expires > time.time():
                raise LogdirLockedError(
                    f"logdir {self.store.root!r} is leased by another chief ({held.get('owner')}) "
                    f"for {expires - time.time():.0f} s more; a killed chief's lease expires "
                    "by then. Give each run its own logdir, or make this one a non-chief"
                )
            else:
                log.warning("logdir.lease_expired", path=self.path, owner=held.get("owner"))
        self._write()
        self.check()  # another chief's write right after ours wins: we stop here
        self._heartbeat = threading.Thread(target=self._beat, name="asupervisor-lease", daemon=True)
        self._heartbeat.start()

    def _succeeds(self, held: dict[str, object]) -> bool:
        """Whether ``held`` is the lease of an earlier attempt of this process's
        ``asupervisor run``: its chief has exited (the runner saw every process of that
        attempt end before it started this one)."""
        attempt = held.get("attempt")
        return (
            self.run is not None
            and self.attempt is not None
            and held.get("run") == self.run
            and isinstance(attempt, int)
            and attempt < self.attempt
        )

    def _beat(self) -> None:
        """Renew until stopped, then remove the lease if it is still ours: the one thread
        that writes the lease also removes it, so no renewal can land after the removal."""
        while not self._stop.wait(self.seconds / 3):
            try:
                self.check()
                self._write()
            except LogdirLockedError as exc:
                self._lost = str(exc)
                return
            except Exception as exc:  # the store is unreachable: the next beat tries again
                log.warning("logdir.lease_not_renewed", path=self.path, error=repr(exc))
        try:
            self.check()
            self.store.remove(self.NAME)
        except LogdirLockedError:
            pass  # not ours any more: not ours to remove
        except Exception as exc:  # it expires by itself
            log.warning("logdir.lease_not_removed", path=self.path, error=repr(exc))

    def check(self) -> None:
        """Raise ``LogdirLockedError`` if the lease is no longer ours."""
        try:
            held = self._read()
        except LeaseUnreadable as exc:
            if self._lost is None and self._expires > time.time():
                log.warning("logdir.lease_unreadable", path=self.path, error=str(exc))
                return  # ours until our last renewal expires: nobody takes it before
            held = None
        if self._lost is not None or held is None or held.get("owner") != self.owner:
            raise LogdirLockedError(
                f"the lease {self.path} was removed or taken by another chief "
                f"({held.get('owner') if held else 'none'}) while this chief held it: "
                "another chief may be writing this logdir too; stopping without saving into it"
            )

    def release(self) -> None:
        """Stop the heartbeat and wait for it to remove the lease (bounded: a store that
        hangs leaves the lease to expire). Blocking I/O: not for the event loop."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(self.seconds / 3)
            if self._heartbeat.is_alive():
                log.warning(
                    "logdir.lease_not_removed",
                    path=self.path,
                    error=f"the store did not answer within {self.seconds / 3:.0f} s",
                )


class LeaseUnreadable(Exception):
    """The lease is there but cannot be read now, or is not a lease."""


def make_lock(store: Store) -> LogdirLock | LeaseLock:
    """A flock on a local (or mounted) file system, a lease on an object store."""
    return LogdirLock(store.root) if store.local else LeaseLock(store)


class WriteGuard:
    """Counts the saves under way; releases the lock when closed and none is left."""

    def __init__(self, lock: LogdirLock | LeaseLock | None) -> None:
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
