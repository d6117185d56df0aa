"""Durable saves: files first (fsynced), then the commit into the history, then the sweep.

A save runs on the training thread (sync), or is snapshotted there and written by one
background thread (``async_write``); either way it enters the session's ``WriteGuard``
first, so that a thread the session abandoned cannot write into the logdir once it has
closed. Failures are counted: the third in a row, or a failed final save, is an error.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import CheckpointSaveError, Fenced, LogdirLockedError
from .._log import log
from .._logdir.catalog import Catalog
from .._logdir.files import checkpoint_bytes
from .._logdir.lock import WriteGuard
from .._logdir.records import Record
from .._logdir.retention import Retention
from . import async_save as _async_save
from .root import SavedRoot

MAX_CONSECUTIVE_FAILURES = 3


class Writer:
    """Writes one session's checkpoints and commits them."""

    # A background write's CPU priority: the lowest, it gives way to training (and to
    # everything else on the machine: it is only to be done before the next save).
    write_nice = 19

    def __init__(
        self,
        root: SavedRoot,
        catalog: Catalog,
        retention: Retention,
        guard: WriteGuard,
        *,
        async_write: bool = False,
        durable: bool = True,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.root, self.catalog, self.retention, self.guard = root, catalog, retention, guard
        self.store = catalog.store
        self.async_write = async_write
        self.durable = durable  # fsync each save before the history names it
        self.last_saved_step: int | None = None  # the newest step saved (or restored) whole
        self.last_saved_at: float | None = None  # time.monotonic() of that save (None: restored)
        self.failures = 0
        self.write_secs: float | None = None  # how long the last checkpoint's files took
        self._writer: threading.Thread | None = None
        self.writing: str | None = None  # the path of the background write in flight
        self.writing_step: int | None = None
        # Saves whose files are on disk, for after_save hooks on the training thread.
        self.completed: collections.deque[tuple[int, str, int]] = collections.deque()
        self._on_fatal = on_fatal  # how a failure on the writer thread stops training
        self.fatal: CheckpointSaveError | LogdirLockedError | None = None

    def has(self, step: int) -> bool:
        """Whether the state at ``step`` is saved already, or being written."""
        return step in (self.last_saved_step, self.writing_step)

    def restored(self, step: int) -> None:
        """A checkpoint at ``step`` was restored: the last good one (of unknown time)."""
        self.last_saved_step, self.last_saved_at = step, None

    def latest_committed(self) -> str | None:
        """The history's head (a full path), or ``None``."""
        head = self.catalog.history.head_commit()
        return None if head is None else self.store.path(head.name)

    def save(
        self,
        step: int,
        record: Record,
        *,
        force: bool = False,
        final: bool = False,
        tag: int = 0,
    ) -> str | None:
        """Save at ``step``; ``None`` if a checkpoint for it exists, the save failed, or
        its files are written in the background (``completed`` gets ``(step, path,
        tag)`` once they are on disk).

        ``force``: save even if this step was saved already (steps ran since without
        advancing it): the new checkpoint is written *beside* the old one, under a name
        of its own, never over it. A failed save is logged and leaves every earlier
        checkpoint as it was; the third failure in a row raises ``CheckpointSaveError``,
        and so does a failed ``final`` save, which has no next trigger to try again.
        """
        if not force and self.has(step):
            return None
        if self.async_write:
            self._save_async(step, tag, record)
            if final:
                self.wait_for_write()
                if self.fatal is not None or self.last_saved_step != step:
                    raise self.fatal or CheckpointSaveError(
                        f"the final checkpoint at step {step} was not written"
                    )
            return None
        started = time.perf_counter()
        name = None
        try:
            with self.guard.writing():
                name = self.catalog.next_name(step)
                with self.store.writing_back(name, self.write_secs):
                    began = time.perf_counter()
                    self.root.to_save().write(self.store.path(name))
                self.write_secs = time.perf_counter() - began
                self._commit(name, record)
        except (Fenced, LogdirLockedError):
            raise  # not a failed write: this session may not write here any more
        except Exception as exc:
            self._discard(name)
            fatal = self._failed(step, exc, final=final)
            if fatal is not None:
                raise fatal from exc
            return None
        seconds = time.perf_counter() - started
        path = self.store.path(name)
        self._saved(step, path, seconds, seconds)
        return path

    def _commit(self, name: str, record: Record) -> None:
        """Files on disk first (their bytes fsynced), then the history names them and lets
        go what the sweep lets go (one write, fsynced), then the state file, then one
        fsync of the directory makes every rename durable (the files', the history's, the
        state file's), then the files let go are deleted.

        The files' names are not synced apart, before the history: a crash before the
        directory's fsync may leave a history whose head names files not there, a commit
        that never completed (the save had not returned); a restore counts only a
        checkpoint that reads back whole, and falls back to the commit before it, whose
        files are on disk (nothing is deleted before the directory's fsync)."""
        if self.durable:
            self.store.sync(self.store.files_of(name), directory=False)
        # Stamped once its files are written, as TF's manager stamps a save: no file of
        # it is newer than its time, so a history derived again from the state file and
        # the disk (``last_preserved_timestamp``) knows the checkpoints kept every N hours.
        stamped = dataclasses.replace(record, time=max(record.time, time.time()))
        self.retention.commit(self.catalog, name, stamped)

    def _discard(self, name: str | None) -> None:
        """A save that failed before its commit leaves no files a later restore could
        take for a commit a kill cut short (the run may have rolled back since)."""
        if name is None or self.catalog.history.by_name(name) is not None:
            return
        for file in self.store.files_of(name):
            with contextlib.suppress(OSError):
                self.store.remove(file)

    def _failed(self, step: int, exc: Exception, *, final: bool) -> CheckpointSaveError | None:
        """Log a failed save; the error to stop training with on the third in a row,
        or at once for the final save."""
        self.failures += 1
        log.error(
            "checkpoint.failed",
            step=step,
            error=f"{type(exc).__name__}: {exc}",
            consecutive_failures=self.failures,
            final=final,
        )
        if final:
            return CheckpointSaveError(
                f"the final checkpoint at step {step} could not be written, so the "
                f"steps since the last good checkpoint ({self.latest_committed()}) "
                f"are not on disk; error: {type(exc).__name__}: {exc}"
            )
        if self.failures < MAX_CONSECUTIVE_FAILURES:
            return None
        return CheckpointSaveError(
            f"{self.failures} checkpoint saves in a row failed (full disk? no "
            f"permission?); the last good checkpoint is {self.latest_committed()}; "
            f"last error: {type(exc).__name__}: {exc}"
        )

    def _saved(self, step: int, path: str, seconds: float, blocked: float) -> None:
        self.failures = 0
        self.last_saved_step = step
        self.last_saved_at = time.monotonic()
        log.info(
            "checkpoint.saved",
            path=path,
            step=step,
            seconds=round(seconds, 4),
            blocked_seconds=round(blocked, 4),
            bytes=checkpoint_bytes(self.store, path),
        )

    # -- asynchronous writes ---------------------------------------------------------

    def _save_async(self, step: int, tag: int, record: Record) -> None:
        """Training thread: snapshot now, write in the background (one write at a time)."""
        started = time.perf_counter()
        self.wait_for_write()
        if self.fatal is not None:
            return  # saving has failed for good; training is being stopped
        with self.guard.writing():  # closed, or the lock lost: raised here, on the thread
            name = self.catalog.next_name(step)
        snapshot = _async_save.take_snapshot(self.root.to_save())
        held = time.perf_counter() - started
        self.writing, self.writing_step = self.store.path(name), step
        self._writer = threading.Thread(
            target=self._write,
            args=(snapshot, name, step, tag, record, started, held),
            name="asupervisor-checkpoint-writer",
            daemon=True,
        )
        self._writer.start()

    def _write(self, snapshot: Any, name: str, step: int, *rest: Any) -> None:
        """Writer thread: files, fsync, then the commit; failures are reported."""
        set_priority(threading.get_native_id(), self.write_nice)
        try:
            self._write_files(snapshot, name, step, *rest)
        finally:
            self.writing = self.writing_step = None

    def _write_files(
        self,
        snapshot: Any,
        name: str,
        step: int,
        tag: int,
        record: Record,
        started: float,
        held: float,
    ) -> None:
        try:
            with self.guard.writing():
                with self.store.writing_back(name, self.write_secs):
                    began = time.perf_counter()
                    _async_save.write_snapshot(snapshot, self.store.path(name))
                self.write_secs = time.perf_counter() - began
                self._commit(name, record)
        except LogdirLockedError as exc:
            self._fail_for_good(exc)
            return
        except Exception as exc:
            self._discard(name)
            self._background_failed(step, exc)
            return
        del snapshot  # the shared buffers can go: later updates need not copy them
        path = self.store.path(name)
        self._saved(step, path, time.perf_counter() - started, held)
        self.completed.append((step, path, tag))

    def _background_failed(self, step: int, exc: Exception) -> None:
        """Writer thread: a background write failed; counted, and once the failures end
        training (``_failed``), that error is kept for the training thread to raise."""
        fatal = self._failed(step, exc, final=False)
        if fatal is not None:
            fatal.__cause__ = exc
            self._fail_for_good(fatal)

    def _fail_for_good(self, error: CheckpointSaveError | LogdirLockedError) -> None:
        self.fatal = error
        if self._on_fatal is not None:
            self._on_fatal(error)

    def wait_for_write(self, timeout: float | None = None) -> bool:
        """Block until the write in flight, if any, is on disk (or has failed);
        ``False`` if it is still running after ``timeout`` seconds."""
        writer = self._writer
        if writer is not None:
            if writer.is_alive() and writer.native_id is not None:
                # Someone waits for it now, so it no longer yields to training: back to
                # normal priority (allowed where the process may raise priorities; on a
                # loaded machine a write at the lowest priority can starve for minutes).
                set_priority(writer.native_id, 0)
            writer.join(timeout)
            if writer.is_alive():
                return False
            self._writer = None
        return True


def set_priority(thread_id: int, nice: int) -> None:
    """Set one thread's CPU priority (Linux): 19 while a background write gives way to
    training. Eager ``SaveV2`` does its work (copying, checksums) on the calling thread,
    so on a machine whose cores all train, the write takes only what training leaves."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        os.setpriority(os.PRIO_PROCESS, thread_id, nice)
