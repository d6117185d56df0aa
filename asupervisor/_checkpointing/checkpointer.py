"""Checkpoint mechanics: restore the newest checkpoint, save one, count failures.

Every function here runs on the training thread, so a save or a restore always
sees the state of one step boundary.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointMismatchError, CheckpointSaveError, Fenced, LogdirLockedError
from .._kinds import RestoreSource
from .._log import log
from .._logdir.files import (
    checkpoint_bytes,
    checkpoint_problem,
    files_problem,
    is_own,
    list_checkpoints,
    listed_without_files,
    own_order,
    skip_state_file,
)
from .._logdir.lock import WriteGuard
from .._logdir.records import Record
from .._logdir.retention import KeepBest, Retention
from .._logdir.store import Store
from .._logdir.verify import shape_differences, top_level_differences, verify_checkpoint
from .._training.kept_state import NAME as KEPT_STATE
from .._training.kept_state import SEEDS
from .._training.position import FIT_STATE
from .._training.position import NAME as POSITION
from .._training.reader import NAME as ITERATOR
from . import async_save as _async_save
from .root import GLOBAL_STEP, SavedRoot

if TYPE_CHECKING:
    pass

MAX_CONSECUTIVE_FAILURES = 3
VANISHED_RETRIES = 100  # passes over the logdir while the chief's sweep removes what we chose


def _vanished_text(problem: str) -> bool:
    """A verification that failed on missing files (swept meanwhile, perhaps)."""
    return problem.startswith("NotFoundError") or "not find any matching files" in problem


def _vanished(exc: BaseException) -> bool:
    """A read failed because the files are gone (TF's NotFoundError), not damaged."""
    import tensorflow as tf

    return isinstance(exc, (tf.errors.NotFoundError, FileNotFoundError))


@dataclass(frozen=True)
class RestoreReport:
    """How a session began."""

    source: RestoreSource
    path: str | None
    step: int
    skipped: tuple[tuple[str, str], ...] = ()
    """Unreadable checkpoints passed over, as (path, reason)."""


class Checkpointer:
    """Saves and restores one session's root in a logdir.

    Every save enters the session's ``WriteGuard`` first: once the session has
    closed, a thread it abandoned cannot write into the logdir any more.
    """

    def __init__(
        self,
        root: SavedRoot,
        directory: str,
        *,
        basename: str,
        max_to_keep: int | None,
        keep_checkpoint_every_n_hours: float | None,
        async_write: bool = False,
        guard: WriteGuard | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        durable: bool = True,
        keep_best: KeepBest | None = None,
    ) -> None:
        self.root = root
        self.directory = directory
        self.store = store = Store(directory)
        self.basename = basename
        self.guard = guard or WriteGuard(None)
        self.retention = Retention(
            store, basename, max_to_keep, keep_checkpoint_every_n_hours, keep_best
        )
        self.damaged_state: tuple[str, str] | None = None  # (state file, why it was skipped)
        try:
            self.retention.load()  # bounded, never blocking: a FIFO is damage, not a hang
        except Exception as exc:  # an unreadable state file: skipped, like a damaged checkpoint
            # Only the chief (the one with a guard over the logdir) moves a file there.
            self.damaged_state = skip_state_file(store, exc, move=guard is not None)
        self.restore_status: Any = None
        self.last_saved_step: int | None = None  # the newest step saved (or restored) whole
        self.last_saved_at: float | None = None  # time.monotonic() of that save (None: restored)
        self.failures = 0
        self.async_write = async_write
        self.durable = durable  # fsync each save before the state file names it
        self._writer: threading.Thread | None = None
        self.writing: str | None = None  # the path of the background write in flight
        self.writing_step: int | None = None
        # Saves whose files are on disk, for after_save hooks on the training thread.
        self.completed: collections.deque[tuple[int, str, int]] = collections.deque()
        self._on_fatal = on_fatal  # how a failure on the writer thread stops training
        self.fatal: CheckpointSaveError | LogdirLockedError | None = None
        self._verified: dict[tuple[str, float | None], bool] = {}  # for good_exists()

    def candidates(self) -> list[str]:
        """Every checkpoint in the directory, newest step first.

        The state file's list and the index files on disk are merged: a lost or
        corrupt state file must not hide the checkpoints beside it.
        """
        # The chief (lock holder) is the only writer: every complete file is its own.
        # Anyone else reads beside a live writer, and trusts only what is committed.
        committed_only = self.guard.lock is None
        return list_checkpoints(self.store, self.basename, committed_only)

    def latest(self) -> str | None:
        found = self.candidates()
        return found[0] if found else None

    def restore_newest(self) -> tuple[str | None, list[tuple[str, str]]]:
        """Restore the newest checkpoint that reads back whole; skip the damaged ones.

        Returns the path restored (``None`` if there was none) and the skipped
        checkpoints with their reasons. A readable checkpoint that does not match
        the model raises ``CheckpointMismatchError``: that is a wrong model or a
        wrong logdir, not damage, and no older checkpoint would fix it.
        """
        skipped: list[tuple[str, str]] = [self.damaged_state] if self.damaged_state else []
        skipped += [(p, "its .index file is gone") for p in listed_without_files(self.store)]
        failed: set[str] = set()  # failed once while the logdir changed: damage if again
        for _ in range(VANISHED_RETRIES):
            path, vanished = self._restore_first_good(skipped, failed)
            if not vanished:
                return path, skipped
        # The logdir never held still: one last pass in which every failure is damage.
        path, _ = self._restore_first_good(skipped, set(self.candidates()))
        return path, skipped

    def _restore_first_good(
        self, skipped: list[tuple[str, str]], failed: set[str]
    ) -> tuple[str | None, bool]:
        """One pass over the candidates; ``(None, True)`` when one failed because the
        logdir changed under it (the chief's retention swept it mid-read): the caller
        lists again, newer ones first. Failing a second time, it is damage."""
        for path in self.candidates():
            problem = checkpoint_problem(self.store, path)
            try:
                if problem is None:
                    self.restore(path)
            except Exception as exc:
                # Files swept away in the middle of a restore fail it in several ways (a
                # NotFoundError, or objects left unbound): gone is gone, not damage. A
                # mismatch stands only if the checkpoint is still there, whole.
                if not _vanished(exc) and not self._gone(path) and verify_checkpoint(path) is None:
                    raise
                problem = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            if problem is not None and path not in failed:
                if _vanished_text(problem) or self._gone(path):
                    failed.add(path)
                    log.info("checkpoint.vanished", path=path, reason=problem)
                    return None, True  # listed again: newer ones first
            if problem is None:
                if self.guard.lock is not None and is_own(path, self.basename):
                    self._commit_restored(path)
                return path, False
            if path not in (p for p, _ in skipped):  # once, however many passes
                log.warning("checkpoint.fallback", skipped=path, reason=problem)
                skipped.append((path, problem))
        return None, False

    def _gone(self, path: str) -> bool:
        """Whether ``path`` is no longer a candidate, or its files are gone."""
        return path not in self.candidates() or files_problem(self.store, path) is not None

    def good_exists(self) -> bool:
        """Whether a checkpoint that reads back whole is here (what a waiting non-chief
        waits for: damaged ones do not count). Each is verified once."""
        for path in self.candidates():
            key = (path, self._stamp(path))
            if key not in self._verified:
                self._verified[key] = checkpoint_problem(self.store, path) is None
            if self._verified[key]:
                return True
        return False

    def _stamp(self, path: str) -> float | None:
        try:
            return self.store.mtime(os.path.basename(path) + ".index")
        except OSError:
            return None

    def _commit_restored(self, restored: str) -> None:
        """The chief commits what it restored when the state file does not name it as the
        latest (a kill came between its files and the state file, or the state file was
        damaged): it and the checkpoints before it that the state file does not list (a
        kill in the middle of a sweep leaves those) are listed, so that
        ``tf.train.latest_checkpoint`` agrees and retention counts them. Unlisted ones
        that ``keep_checkpoint_every_n_hours`` may have kept stay unlisted."""
        retention, store = self.retention, self.store
        name = store.name_of(restored)
        if name is None or name == retention.latest:
            return
        listed = retention.names()
        own = [
            n
            for p in reversed(self.candidates())
            if (n := store.name_of(p)) is not None and is_own(n, self.basename)
        ]
        upto = own[: own.index(name) + 1] if name in own else [name]
        fresh = [n for n in upto if n not in listed and not self._maybe_preserved(n)]
        if name not in fresh:  # listed already, not as the latest: only the latest moves
            fresh.append(name)
        retention.adopt(fresh)

    def _maybe_preserved(self, name: str) -> bool:
        """Whether ``keep_checkpoint_every_n_hours`` may have kept ``name``: written no
        later than the last one it kept (a file system without times: when it is on)."""
        retention = self.retention
        written = self.store.mtime(name + ".index")
        if written <= 0:
            return retention.keep_every_n_hours is not None
        return written <= retention.last_preserved

    def healthy_at_or_before(self, step: int) -> str | None:
        """The newest committed checkpoint at or before ``step`` whose commit recorded a
        finite loss and whose files read back whole (a rollback's target), or ``None``."""
        retention = self.retention
        for name in reversed(retention.names()):
            order = own_order(name, self.basename)
            record = retention.records.get(name)
            if order is None or order[0] > step or (record is not None and not record.healthy):
                continue
            path = self.store.path(name)
            if checkpoint_problem(self.store, path) is None:
                return path
        return None

    def latest_committed(self) -> str | None:
        """The checkpoint the state file names as the latest (a full path), or ``None``."""
        latest = self.retention.latest
        return None if latest is None else self.store.path(latest)

    def restore(self, path: str) -> None:
        """Restore ``path`` into the root's objects, or raise CheckpointMismatchError.

        A checkpoint the supervisor did not write (``tf.train.CheckpointManager``'s
        ``ckpt-1``, ``Checkpoint.save``) may lack the global step: that is a migration,
        and the step stays as it is. ``restore_status`` is kept for ``unrestored()``.
        """
        children = self.root.children()
        missing, unexpected = top_level_differences(children, path)
        # What an older or another tool's checkpoint may lack: restored without it.
        optional = {POSITION, FIT_STATE, ITERATOR, KEPT_STATE, SEEDS}
        if not is_own(path, self.basename):
            optional.add(GLOBAL_STEP)
        absent = [name for name in missing if name in optional]
        missing = [name for name in missing if name not in optional]
        # Only extra names: the user's checkpoint may be given them later (TF restores an
        # attribute assigned after the restore then); if none takes them by the end of the
        # first step, the session says so (SessionRuntime.check_deferred).
        if missing:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: "
                f"the model has {missing or 'nothing'} that the checkpoint lacks; "
                f"the checkpoint has {unexpected or 'nothing'} that the model lacks"
            )
        shapes = shape_differences(children, path)
        if shapes:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: " + "; ".join(shapes)
            )
        root = self.root.checkpoint if not absent else self.root.without(absent)
        try:
            status = root.read(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as exc:  # missing objects; shapes that differ
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: {exc}"
            ) from exc
        self.restore_status = status

    def restored(self, path: str) -> None:
        """The session restored ``path``: it is the last good checkpoint (of unknown time)."""
        order = own_order(path, self.basename)
        if order is not None:
            self.last_saved_step, self.last_saved_at = order[0], None

    def take_restore_status(self) -> Any:
        """What the restore left to take, once: for the check after the first step."""
        status, self.restore_status = self.restore_status, None
        return status

    def _sync_new(self, name: str) -> None:
        self.store.sync(self.store.files_of(name))

    def save(
        self,
        step: int,
        *,
        force: bool = False,
        final: bool = False,
        tag: int = 0,
        record: Record | None = None,
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
        if not force and step in (self.last_saved_step, self.writing_step):
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
        try:
            with self.guard.writing():
                name = self.retention.next_name(step)
                with self.store.writing_back(name):
                    self.root.checkpoint.write(self.store.path(name))
                self._commit(name, record)
        except (Fenced, LogdirLockedError):
            raise  # not a failed write: this session may not write here any more
        except Exception as exc:
            fatal = self._failed(step, exc, final=final)
            if fatal is not None:
                raise fatal from exc
            return None
        seconds = time.perf_counter() - started
        path = self.store.path(name)
        self._saved(step, path, seconds, seconds)
        return path

    def _commit(self, name: str, record: Record | None) -> None:
        """Files on disk first (fsynced), then the state file names them, then retention."""
        if self.durable:
            self._sync_new(name)
        self.retention.commit(name, record)

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

    # -- asynchronous writes ---------------------------------------------------

    def _save_async(self, step: int, tag: int, record: Record | None) -> None:
        """Training thread: snapshot now, write in the background (one write at a time)."""
        started = time.perf_counter()
        self.wait_for_write()
        if self.fatal is not None:
            return  # saving has failed for good; training is being stopped
        with self.guard.writing():  # closed, or the lock lost: raised here, on the thread
            name = self.retention.next_name(step)
        snapshot = _async_save.take_snapshot(self.root.checkpoint)
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
        """Writer thread: files, fsync, then the state file; failures are reported."""
        set_priority(threading.get_native_id(), 19)
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
        record: Record | None,
        started: float,
        held: float,
    ) -> None:
        try:
            with self.guard.writing():
                with self.store.writing_back(name):
                    _async_save.write_snapshot(snapshot, self.store.path(name))
                self._commit(name, record)
        except LogdirLockedError as exc:
            self._fail_for_good(exc)
            return
        except Exception as exc:
            fatal = self._failed(step, exc, final=False)
            if fatal is not None:
                fatal.__cause__ = exc
                self._fail_for_good(fatal)
            return
        del snapshot  # the shared buffers can go: later updates need not copy them
        path = self.store.path(name)
        self._saved(step, path, time.perf_counter() - started, held)
        self.completed.append((step, path, tag))

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
