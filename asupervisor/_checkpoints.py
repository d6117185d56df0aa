"""Checkpoint mechanics: restore the newest checkpoint, save one, count failures.

Every function here runs on the training thread, so a save or a restore always
sees the state of one step boundary.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import _async_save
from ._errors import CheckpointMismatchError, CheckpointSaveError, LogdirLockedError
from ._lock import WriteGuard
from ._log import log
from ._logdir import (
    STATE,
    checkpoint_bytes,
    checkpoint_problem,
    files_problem,
    is_own,
    list_checkpoints,
    read_state,
    skip_state_file,
)
from ._position import NAME as POSITION
from ._root import without
from ._store import Store
from ._verify import shape_differences, top_level_differences, verify_checkpoint
from ._worker import Fenced

if TYPE_CHECKING:
    import tensorflow as tf

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

    source: Literal["checkpoint", "init_fn", "fresh", "interrupted"]
    """"interrupted": a stop came before anything was restored; nothing trains or is saved."""
    path: str | None
    step: int
    skipped: tuple[tuple[str, str], ...] = ()
    """Unreadable checkpoints passed over, as (path, reason)."""


class Checkpointer:
    """Saves and restores one ``tf.train.Checkpoint`` in a logdir.

    Every save enters the session's ``WriteGuard`` first: once the session has
    closed, a thread it abandoned cannot write into the logdir any more.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        directory: str,
        *,
        basename: str,
        max_to_keep: int | None,
        keep_checkpoint_every_n_hours: float | None,
        async_write: bool = False,
        guard: WriteGuard | None = None,
    ) -> None:
        import tensorflow as tf

        self.checkpoint = checkpoint
        # Made now, not by the first restore: a restore that fails half way (its files
        # swept meanwhile) would leave the counter waiting for that checkpoint's value,
        # and the next restore, of another checkpoint, would fail on it.
        _ = checkpoint.save_counter
        self.directory = directory
        self.store = store = Store(directory)
        self.damaged_state: tuple[str, str] | None = None  # (state file, why it was skipped)

        def manager(where: str) -> tf.train.CheckpointManager:
            # A new manager reads the `checkpoint` state file as it is now on disk.
            made = tf.train.CheckpointManager(
                checkpoint,
                where,
                max_to_keep=max_to_keep,
                keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
                checkpoint_name=basename,
            )
            # Checkpoints the state file names that the supervisor did not write, or
            # not in this directory (`../victim/model.ckpt-5`): never swept by retention.
            inside = Store(where).name_of
            for listed in list(made._maybe_delete):
                if inside(listed) is None or not is_own(listed, basename):
                    del made._maybe_delete[listed]
            return made

        self._new_manager = manager
        try:
            read_state(store)  # bounded, never blocking: before TF's reader sees it
            self.manager = manager(directory)
        except Exception as exc:  # an unreadable state file: skipped, like a damaged checkpoint
            # Only the chief (the one with a guard over the logdir) moves a file there.
            self.damaged_state = skip_state_file(store, exc, move=guard is not None)
            self.manager = manager(directory if guard is not None else tempfile.mkdtemp())
        self.basename = basename
        self.restore_status: Any = None
        self.guard = guard or WriteGuard(None)
        self.last_saved_step: int | None = None
        self.last_good_step: int | None = None  # the newest step saved (or restored) whole
        self.last_saved_at: float | None = None  # time.monotonic() of the last save
        self.failures = 0
        self.async_write = async_write
        self._writer: threading.Thread | None = None
        # Saves whose files are on disk, for after_save hooks on the training thread.
        self.completed: collections.deque[tuple[int, str]] = collections.deque()
        # How a failure on the writer thread stops training (set by the session).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal: CheckpointSaveError | LogdirLockedError | None = None
        self.durable = True  # fsync each save before the state file names it
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
                chief = self.guard.lock is not None
                if chief and is_own(path, self.basename) and not self._state_names(path):
                    self._rebuild_state(path)  # the chief commits what it restored
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

    def _own_up_to(self, restored: str) -> list[str]:
        """The supervisor's checkpoints on disk up to ``restored``, oldest first."""
        own = [p for p in reversed(self.candidates()) if is_own(p, self.basename)]
        return own[: own.index(restored) + 1] if restored in own else [restored]

    def _state_names(self, restored: str) -> bool:
        """Whether the state file names ``restored`` as the latest and lists every
        checkpoint of ours on disk before it (no orphans that retention would miss)."""
        name = self.store.name_of
        listed = [name(p) for p in self.manager._maybe_delete]
        wanted = [name(p) for p in self._own_up_to(restored)]
        latest = self.manager.latest_checkpoint
        return latest is not None and name(latest) == wanted[-1] and listed == wanted

    def _rebuild_state(self, restored: str) -> None:
        """A state file that names the restored checkpoint as the latest and the older
        ones on disk (orphans of killed runs, or after a damaged state file was put
        aside), so that ``tf.train.latest_checkpoint`` agrees and retention counts them."""
        import tensorflow as tf

        older = self._own_up_to(restored)
        # The manager reads back only the paths that have timestamps: those of the files.
        stamps = [self.store.mtime(os.path.basename(p) + ".index") for p in older]
        tf.compat.v1.train.update_checkpoint_state(
            self.directory,
            restored,
            all_model_checkpoint_paths=older,
            all_model_checkpoint_timestamps=stamps,
            last_preserved_timestamp=min(stamps) - 1,  # none of these is "preserved"
        )
        self.store.sync([STATE])
        self.manager = self._new_manager(self.directory)

    def restore(self, path: str) -> None:
        """Restore ``path`` into the checkpoint's objects, or raise CheckpointMismatchError.

        A checkpoint the supervisor did not write (``tf.train.CheckpointManager``'s
        ``ckpt-1``, ``Checkpoint.save``) may lack the global step: that is a migration,
        and the step stays as it is. ``restore_status`` is kept for ``unrestored()``.
        """
        missing, unexpected = top_level_differences(self.checkpoint, path)
        # What an older or another tool's checkpoint may lack: restored without it.
        optional = {POSITION} if is_own(path, self.basename) else {POSITION, "global_step"}
        absent = [name for name in missing if name in optional]
        missing = [name for name in missing if name not in optional]
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: "
                f"the model has {missing or 'nothing'} that the checkpoint lacks; "
                f"the checkpoint has {unexpected or 'nothing'} that the model lacks"
            )
        shapes = shape_differences(self.checkpoint, path)
        if shapes:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: " + "; ".join(shapes)
            )
        root = self.checkpoint if not absent else without(self.checkpoint, absent)
        try:
            status = root.restore(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as exc:  # missing objects; shapes that differ
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: {exc}"
            ) from exc
        self.restore_status = status

    def _prefix_at(self, step: int) -> str:
        """The path prefix the manager gives the checkpoint at ``step``."""
        return f"{self.manager._prefix}-{step}"

    def _sync_new(self, prefix: str) -> None:
        self.store.sync(self.store.files_of(os.path.basename(prefix)))

    def save(self, step: int, *, force: bool = False, final: bool = False) -> str | None:
        """Save at ``step``; ``None`` if a checkpoint for it exists or the save failed.

        ``force``: save even if this step was saved already (steps ran since without
        advancing it); the new files replace the old ones of the same number.
        A failed save is logged and leaves every earlier checkpoint as it was; the
        third failure in a row raises ``CheckpointSaveError``, and so does a failed
        ``final`` save, which has no next trigger to try again.
        """
        if step == self.last_saved_step and not force:
            return None
        if self.async_write:
            self._save_async(step)
            if final:
                self.wait_for_write()
                if self.fatal is not None or self.last_saved_step != step:
                    raise self.fatal or CheckpointSaveError(
                        f"the final checkpoint at step {step} was not written"
                    )
            return None
        import tensorflow as tf

        started = time.perf_counter()
        # Runs after the files are written and before TF points the state file at
        # them: the data must be on disk first, or a machine crash could leave a
        # state file naming files that never reached the disk.
        callbacks = [self._sync_new] if self.durable else []
        options = tf.train.CheckpointOptions(experimental_write_callbacks=callbacks)
        try:
            name = os.path.basename(self._prefix_at(step))
            with self.guard.writing(), self.store.writing_back(name):
                path: str = self.manager.save(checkpoint_number=step, options=options)
                if self.durable:
                    self.store.sync([STATE])
        except (Fenced, LogdirLockedError):
            raise  # not a failed write: this session may not write here any more
        except Exception as exc:
            fatal = self._failed(step, exc, final=final)
            if fatal is not None:
                raise fatal from exc
            return None
        seconds = time.perf_counter() - started
        self._saved(step, path, seconds, seconds)
        return path

    def _failed(self, step: int, exc: Exception, *, final: bool) -> CheckpointSaveError | None:
        """Log a failed save; the error to stop training with on the third in a row,
        or at once for the final save."""
        self.failures += 1
        self.last_saved_step = None  # the next trigger tries again
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
                f"steps since the last good checkpoint ({self.manager.latest_checkpoint}) "
                f"are not on disk; error: {type(exc).__name__}: {exc}"
            )
        if self.failures < MAX_CONSECUTIVE_FAILURES:
            return None
        return CheckpointSaveError(
            f"{self.failures} checkpoint saves in a row failed (full disk? no "
            f"permission?); the last good checkpoint is {self.manager.latest_checkpoint}; "
            f"last error: {type(exc).__name__}: {exc}"
        )

    def _saved(self, step: int, path: str, seconds: float, blocked: float) -> None:
        self.failures = 0
        self.last_saved_step = self.last_good_step = step
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

    def _save_async(self, step: int) -> None:
        """Training thread: snapshot now, write in the background (one write at a time)."""
        started = time.perf_counter()
        self.wait_for_write()
        if self.fatal is not None:
            return  # saving has failed for good; training is being stopped
        with self.guard.writing():  # closed, or the lock lost: raised here, on the thread
            pass
        snapshot = _async_save.take_snapshot(self.checkpoint)
        held = time.perf_counter() - started
        self.last_saved_step = step
        prefix = self._prefix_at(step)
        self._writer = threading.Thread(
            target=self._write,
            args=(snapshot, prefix, step, started, held),
            name="asupervisor-checkpoint-writer",
            daemon=True,
        )
        self._writer.start()

    def _write(self, snapshot: Any, prefix: str, step: int, started: float, held: float) -> None:
        """Writer thread: files, fsync, then the state file; failures are reported."""
        set_priority(threading.get_native_id(), 19)
        try:
            with self.guard.writing():
                with self.store.writing_back(os.path.basename(prefix)):
                    _async_save.write_snapshot(snapshot, prefix)
                self._sync_new(prefix)
                _async_save.commit(self.manager, prefix)
                self.store.sync([STATE])
        except LogdirLockedError as exc:
            self.fatal = exc
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        except Exception as exc:
            fatal = self._failed(step, exc, final=False)
            if fatal is not None:
                fatal.__cause__ = exc
                self.fatal = fatal
                if self.on_fatal is not None:
                    self.on_fatal(fatal)
            return
        del snapshot  # the shared buffers can go: later updates need not copy them
        self._saved(step, prefix, time.perf_counter() - started, held)
        self.completed.append((step, prefix))

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
