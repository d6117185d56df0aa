"""The background mirror: copies the local tier's commits to the logdir, behind training.

One thread of its own (never the training thread, never the event loop) copies the
newest local commit offered to it: its data files first, its ``.index`` last, then
commits it into the logdir's history (with the logdir's retention: ``max_to_keep``,
``KeepBest``, the evaluator's backlog, the pinned last good), so a copy cut short is
never taken for a checkpoint:

- on an object store each file is one object, whole once written; data files with no
  ``.index`` beside them are what a kill mid-copy leaves, and the chief's next start
  removes them (``files.remove_unfinished``);
- on a path, the files are copied into ``<name>_temp/`` (TF's own temporary directory,
  which the next start also removes) and renamed into place, fsynced before the commit.

While it copies, newer commits replace the one waiting (only the newest is worth
copying); a copy that fails (the store unreachable) is tried again, the newest first,
with a growing pause, and training never waits for it. What it has not copied yet is
``steps_at_risk``: the steps a host that never comes back would lose.

At the session's end (``hurry``) the final copy has only what is left of the stop's
grace (GKE Spot gives 15 s): a retry pause is cut to ``HURRIED_RETRY_SECS`` (one grown to
``RETRY_MAX_SECS`` would spend all of it waiting, with the store perhaps back), and a
copy under way that a newer commit has replaced is abandoned before its next file, its
``.index`` last (what it copied is what a kill mid-copy leaves: data files with no
``.index``, never taken for a checkpoint, removed at the next start).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from .._errors import Fenced, LogdirLockedError
from .._log import log
from .._logdir.catalog import Catalog
from .._logdir.history import Commit
from .._logdir.lock import WriteGuard
from .._logdir.records import Record
from .._logdir.retention import Retention
from .._logdir.store import Store

RETRY_FIRST_SECS = 0.5
RETRY_MAX_SECS = 30.0
HURRIED_RETRY_SECS = 0.5  # the longest pause once the session ends (``hurry``)


def record_of(commit: Commit) -> Record:
    """What a commit recorded, to commit its copy with."""
    return Record(commit.step or 0, commit.time, dict(commit.metrics), commit.healthy)


class _Superseded(Exception):
    """A hurried copy that a newer commit replaced: abandoned, the newer one is copied."""


class Mirror:
    """Copies local commits into the logdir on a thread of its own."""

    def __init__(
        self,
        local: Store,
        catalog: Catalog,
        retention: Retention,
        guard: WriteGuard,
        *,
        every: int = 1,
    ) -> None:
        self.local, self.catalog, self.retention, self.guard = local, catalog, retention, guard
        self.store = catalog.store
        self.every = every
        self._cond = threading.Condition()
        self._pending: tuple[str, Record] | None = None  # the newest offered, not begun
        self._copying: str | None = None
        self._offered = 0
        self._closed = False
        self._hurried = False  # the session ends: retries pause at most HURRIED_RETRY_SECS
        self._thread: threading.Thread | None = None
        self.failures = 0
        head = catalog.history.head_commit()
        self.mirrored_step: int | None = None if head is None else head.step
        self.local_step: int | None = self.mirrored_step

    # -- what the session reads ------------------------------------------------------

    def steps_at_risk(self) -> int:
        """Steps committed locally that the logdir does not hold yet."""
        local, mirrored = self.local_step, self.mirrored_step
        if local is None:
            return 0
        return max(0, local - (mirrored or 0))

    def pinned(self) -> set[str]:
        """The local commits the mirror still needs (local retention keeps them)."""
        with self._cond:
            names = {self._copying} if self._copying else set()
            if self._pending is not None:
                names.add(self._pending[0])
            return names

    def idle(self) -> bool:
        with self._cond:
            return self._pending is None and self._copying is None

    # -- what the session does -------------------------------------------------------

    def committed(self, name: str, record: Record) -> None:
        """A local commit: offered to the mirror if it is an ``every``-th one."""
        with self._cond:
            self._offered += 1
            self.local_step = record.step
            if self._offered % self.every == 0:
                self._offer(name, record)

    def caught_up(self, step: int | None) -> None:
        """The logdir holds the local commit restored (at ``step``): nothing is at risk."""
        with self._cond:
            self.mirrored_step = self.local_step = step

    def offer(self, name: str, record: Record) -> None:
        """Copy this local commit (the final one, or what a restore found unmirrored)."""
        with self._cond:
            if self.local_step is None or record.step >= self.local_step:
                self.local_step = record.step
            self._offer(name, record)

    def _offer(self, name: str, record: Record) -> None:
        if self._closed or name == self._copying:
            return
        self._pending = (name, record)  # a newer one replaces one not begun yet
        self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="asupervisor-checkpoint-mirror", daemon=True
            )
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every commit offered is in the logdir (``False``: not after ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._copying is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._closed:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def hurry(self) -> None:
        """The session ends: a retry pause under way, and any later one, lasts at most
        ``HURRIED_RETRY_SECS`` (the final copy has only what is left of the grace)."""
        with self._cond:
            self._hurried = True
            self._cond.notify_all()

    def drop_pending(self) -> None:
        """A rollback abandoned what is waiting: it is not copied."""
        with self._cond:
            self._pending = None
            self._cond.notify_all()

    def close(self) -> None:
        """No more copies begin; one under way ends by itself (fenced once the session
        has closed). What was not copied is said."""
        with self._cond:
            self._closed = True
            left = self._pending or (None if self._copying is None else (self._copying, None))
            self._cond.notify_all()
        if left is not None:
            log.warning(
                "checkpoint.mirror_unfinished",
                checkpoint=left[0],
                steps_at_risk=self.steps_at_risk(),
                local=self.local.root,
            )

    # -- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        pause = RETRY_FIRST_SECS
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed or self._pending is None:
                    return
                (name, record), self._pending = self._pending, None
                self._copying = name
            try:
                started = time.perf_counter()
                copied = self._copy(name, record)
            except _Superseded:
                log.debug("checkpoint.mirror_superseded", checkpoint=name, step=record.step)
                with self._cond:
                    self._copying = None
                    self._cond.notify_all()
                continue
            except (Fenced, LogdirLockedError):
                with self._cond:
                    self._copying = None
                    self._closed = True
                    self._cond.notify_all()
                return
            except Exception as exc:
                self.failures += 1
                log.warning(
                    "checkpoint.mirror_failed",
                    checkpoint=name,
                    error=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                    consecutive_failures=self.failures,
                    retry_in_secs=round(pause, 2),
                    steps_at_risk=self.steps_at_risk(),
                )
                with self._cond:
                    self._copying = None
                    if self._pending is None and self.local.exists(name + ".index"):
                        self._pending = (name, record)  # tried again, unless newer came
                    self._cond.notify_all()
                    self._pause(pause)
                pause = min(pause * 2, RETRY_MAX_SECS)
                continue
            pause = RETRY_FIRST_SECS
            self.failures = 0
            with self._cond:
                self._copying = None
                if self.mirrored_step is None or record.step >= self.mirrored_step:
                    self.mirrored_step = record.step
                self._cond.notify_all()
            if not copied:
                continue
            path = self.store.path(name)
            at_risk = self.steps_at_risk()
            log.info(
                "checkpoint.mirrored",
                path=path,
                step=record.step,
                seconds=round(time.perf_counter() - started, 4),
                steps_at_risk=at_risk,
            )

    def _pause(self, secs: float) -> None:
        """Before a retry (the condition held): ``secs``, or ``HURRIED_RETRY_SECS`` from
        its start once the session ends (``hurry``); none once closed."""
        begun = time.monotonic()
        while not self._closed:
            cap = HURRIED_RETRY_SECS if self._hurried else secs
            left = begun + min(secs, cap) - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _copy(self, name: str, record: Record) -> bool:
        """The files (data first, the index last), then the commit into the logdir;
        ``False`` if the logdir has it already."""
        commit = self.catalog.history.by_name(name)
        if commit is not None and commit.on_disk:
            return False
        files = sorted(self.local.files_of(name), key=lambda n: n.endswith(".index"))
        if not any(f.endswith(".index") for f in files):
            raise FileNotFoundError(f"{self.local.path(name)}.index is gone")
        with self.guard.writing():
            self.store.make()
            if self.store.local:
                self._copy_to_path(name, files)
            else:
                import tensorflow as tf

                copied: list[str] = []
                try:
                    for file in files:
                        self._unless_superseded()
                        tf.io.gfile.copy(
                            self.local.path(file), self.store.path(file), overwrite=True
                        )
                        copied.append(file)
                except _Superseded:
                    # Data files with no index are never taken for a checkpoint, and the
                    # next start would remove them; a stop that ends cleanly leaves none.
                    for file in copied:
                        with contextlib.suppress(Exception):
                            self.store.remove(file)
                    raise
            self.retention.commit(self.catalog, name, record)
        return True

    def _unless_superseded(self) -> None:
        """Raises ``_Superseded`` if the session ends and a newer commit waits: the time
        left goes to the newer one (the final save), not to one it replaced."""
        with self._cond:
            if self._hurried and self._pending is not None:
                raise _Superseded

    def _copy_to_path(self, name: str, files: list[str]) -> None:
        """Into ``<name>_temp/`` (removed at the next start if a kill cuts it short),
        fsynced, then renamed into place, the index last."""
        import shutil

        temp = self.store.path(name + "_temp")
        os.makedirs(temp, exist_ok=True)
        try:
            for file in files:
                self._unless_superseded()
                with (
                    open(self.local.path(file), "rb") as src,
                    open(os.path.join(temp, file), "wb") as dst,
                ):
                    shutil.copyfileobj(src, dst, 1 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
            for file in files:
                os.replace(os.path.join(temp, file), self.store.path(file))
            self.store.sync(files)
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(temp)
