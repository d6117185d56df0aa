"""Checkpoint mechanics: restore the newest checkpoint, save one, count failures.

Every function here runs on the training thread, so a save or a restore always
sees the state of one step boundary.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import glob
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from . import _async_save
from ._errors import CheckpointMismatchError, CheckpointSaveError, LogdirLockedError
from ._log import log

if TYPE_CHECKING:
    import tensorflow as tf

MAX_CONSECUTIVE_FAILURES = 3


@dataclass(frozen=True)
class RestoreReport:
    """How a session began."""

    source: Literal["checkpoint", "init_fn", "fresh"]
    path: str | None
    step: int
    skipped: tuple[tuple[str, str], ...] = ()
    """Unreadable checkpoints passed over, as (path, reason)."""


class Checkpointer:
    """Saves and restores one ``tf.train.Checkpoint`` in a logdir."""

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        directory: str,
        *,
        basename: str,
        max_to_keep: int | None,
        keep_checkpoint_every_n_hours: float | None,
        async_write: bool = False,
    ) -> None:
        import tensorflow as tf

        self.checkpoint = checkpoint
        self.directory = directory
        # A new manager reads the `checkpoint` state file as it is now on disk.
        self.manager = tf.train.CheckpointManager(
            checkpoint,
            directory,
            max_to_keep=max_to_keep,
            keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
            checkpoint_name=basename,
        )
        self.basename = basename
        self.last_saved_step: int | None = None
        self.last_saved_at: float | None = None  # time.monotonic() of the last save
        self.failures = 0
        self.async_write = async_write
        self._writer: threading.Thread | None = None
        # Saves whose files are on disk, for after_save hooks on the training thread.
        self.completed: collections.deque[tuple[int, str]] = collections.deque()
        # How a failure on the writer thread stops training (set by the session).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal: CheckpointSaveError | None = None
        self.durable = True  # fsync each save before the state file names it

    def candidates(self) -> list[str]:
        """Every checkpoint in the directory, newest step first.

        The state file's list and the index files on disk are merged: a lost or
        corrupt state file must not hide the checkpoints beside it.
        """
        return list_checkpoints(self.directory, self.basename)

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
        skipped: list[tuple[str, str]] = []
        for path in self.candidates():
            problem = verify_checkpoint(path)
            if problem is None:
                self.restore(path)
                return path, skipped
            log.warning("checkpoint.fallback", skipped=path, reason=problem)
            skipped.append((path, problem))
        return None, skipped

    def restore(self, path: str) -> None:
        """Restore ``path`` into the checkpoint's objects, or raise CheckpointMismatchError."""
        missing, unexpected = top_level_differences(self.checkpoint, path)
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
        try:
            status = self.checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as exc:  # missing objects; shapes that differ
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: {exc}"
            ) from exc

    def _sync_new(self, prefix: str) -> None:
        sync_paths([*glob.glob(glob.escape(prefix) + ".*"), self.directory])

    def save(self, step: int) -> str | None:
        """Save at ``step``; ``None`` if a checkpoint for it exists or the save failed.

        A failed save is logged and leaves every earlier checkpoint as it was; the
        third failure in a row raises ``CheckpointSaveError``.
        """
        if step == self.last_saved_step:
            return None
        if self.async_write:
            self._save_async(step)
            return None
        import tensorflow as tf

        started = time.perf_counter()
        # Runs after the files are written and before TF points the state file at
        # them: the data must be on disk first, or a machine crash could leave a
        # state file naming files that never reached the disk.
        callbacks = [self._sync_new] if self.durable else []
        options = tf.train.CheckpointOptions(experimental_write_callbacks=callbacks)
        try:
            path: str = self.manager.save(checkpoint_number=step, options=options)
            if self.durable:
                sync_paths([os.path.join(self.directory, "checkpoint"), self.directory])
        except Exception as exc:
            fatal = self._failed(step, exc)
            if fatal is not None:
                raise fatal from exc
            return None
        seconds = time.perf_counter() - started
        self._saved(step, path, seconds, seconds)
        return path

    def _failed(self, step: int, exc: Exception) -> CheckpointSaveError | None:
        """Log a failed save; the error to stop training with on the third in a row."""
        self.failures += 1
        self.last_saved_step = None  # the next trigger tries again
        log.error(
            "checkpoint.failed",
            step=step,
            error=f"{type(exc).__name__}: {exc}",
            consecutive_failures=self.failures,
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
        self.last_saved_step = step
        self.last_saved_at = time.monotonic()
        log.info(
            "checkpoint.saved",
            path=path,
            step=step,
            seconds=round(seconds, 4),
            blocked_seconds=round(blocked, 4),
            bytes=checkpoint_bytes(path),
        )

    # -- asynchronous writes ---------------------------------------------------

    def _save_async(self, step: int) -> None:
        """Training thread: snapshot now, write in the background (one write at a time)."""
        started = time.perf_counter()
        self.wait_for_write()
        if self.fatal is not None:
            return  # saving has failed for good; training is being stopped
        snapshot = _async_save.take_snapshot(self.checkpoint)
        held = time.perf_counter() - started
        self.last_saved_step = step
        prefix = f"{self.manager._prefix}-{step}"
        self._writer = threading.Thread(
            target=self._write,
            args=(snapshot, prefix, step, started, held),
            name="asupervisor-checkpoint-writer",
            daemon=True,
        )
        self._writer.start()

    def _write(self, snapshot: Any, prefix: str, step: int, started: float, held: float) -> None:
        """Writer thread: files, fsync, then the state file; failures are reported."""
        lower_priority()
        try:
            _async_save.write_snapshot(snapshot, prefix)
            self._sync_new(prefix)
            _async_save.commit(self.manager, prefix)
            sync_paths([os.path.join(self.directory, "checkpoint"), self.directory])
        except Exception as exc:
            fatal = self._failed(step, exc)
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
        if self._writer is not None:
            self._writer.join(timeout)
            if self._writer.is_alive():
                return False
            self._writer = None
        return True


class ScratchCheckpointer(Checkpointer):
    """A non-chief worker's part in the saves of a multi-worker job.

    The strategy's collectives need every worker in every save, but only the
    chief's files are kept: a non-chief saves into a private temporary directory,
    never into the logdir, and removes it straight after (TF's own pattern).
    It restores the checkpoint the chief chose, from the chief's logdir.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, worker: str, basename: str) -> None:
        # Not created here: TF makes it on each save, and it is removed after each.
        name = f"asupervisor-{worker.replace(':', '')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        scratch = os.path.join(tempfile.gettempdir(), name)
        super().__init__(
            checkpoint,
            scratch,
            basename=basename,
            max_to_keep=1,
            keep_checkpoint_every_n_hours=None,
        )
        self.durable = False  # thrown away at once: no fsync

    def save(self, step: int) -> str | None:
        """Take part in the save at ``step``; nothing is kept, so nothing is returned."""
        try:
            super().save(step)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        return None

    def candidates(self) -> list[str]:
        return []  # a non-chief never picks a checkpoint: the chief does


def verify_checkpoint(prefix: str) -> str | None:
    """``None`` if the checkpoint at ``prefix`` reads back whole, else why it does not.

    Every tensor is read, so a truncated or corrupt data file is caught, not only
    a missing index. Variant tensors (a tf.data iterator's state) have no numpy
    form to read them into; the index still vouches for them.
    """
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(prefix)
        for name, dtype in reader.get_variable_to_dtype_map().items():
            if dtype not in (tf.variant, tf.resource):
                reader.get_tensor(name)
    except Exception as exc:  # TF reports damage with several error types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first_line}"[:300]
    return None


def lower_priority() -> None:
    """Give way to training: the calling thread (only) gets the lowest CPU priority.

    Eager ``SaveV2`` does its work (copying, checksums) on the calling thread, so
    on a machine whose cores all train, the write takes only what training leaves.
    """
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def remove_unfinished(directory: str, basename: str) -> list[str]:
    """Remove the temp directories of saves that never finished (a kill mid-save).

    Only a chief holding the logdir lock calls this, so no save of its own is
    under way; the finished checkpoints are never touched.
    """
    pattern = re.compile(re.escape(basename) + r"-\d+_temp$")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if pattern.match(name) and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
    return removed


def sync_paths(paths: list[str]) -> None:
    """fsync files and directories (a directory's fsync makes renames in it durable)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def list_checkpoints(directory: str, basename: str) -> list[str]:
    """Checkpoint prefixes in ``directory``, newest step first, from the state file and disk."""
    import tensorflow as tf

    pattern = re.compile(re.escape(basename) + r"-(\d+)$")
    names: set[str] = set()
    with contextlib.suppress(Exception):  # a corrupt or missing state file lists nothing
        state = tf.train.get_checkpoint_state(directory)
        if state is not None:
            listed = [state.model_checkpoint_path, *state.all_model_checkpoint_paths]
            names.update(os.path.basename(p) for p in listed if p)
    with contextlib.suppress(FileNotFoundError):
        names.update(n[: -len(".index")] for n in os.listdir(directory) if n.endswith(".index"))
    steps = {n: int(m[1]) for n in names if (m := pattern.match(n))}
    return [os.path.join(directory, n) for n in sorted(steps, key=steps.__getitem__, reverse=True)]


def _holds_state(obj: Any) -> bool:
    """Whether ``obj`` or anything it tracks has a value a checkpoint would save."""
    import tensorflow as tf

    for node in tf.train.TrackableView(obj).descendants():
        if (
            isinstance(node, tf.Variable)
            or hasattr(node, "assign")
            or "Iterator" in type(node).__name__
        ):
            return True
    return False


def shape_differences(checkpoint: Any, path: str) -> list[str]:
    """``"name: checkpoint (3,), model (5,)"`` for every variable whose shape differs.

    Variables are named by their first path from the root, breadth first, as TF
    names them when it saves.
    """
    import tensorflow as tf

    saved = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    view = tf.train.TrackableView(checkpoint)
    seen, queue, found = {id(checkpoint)}, [(checkpoint, "")], []
    while queue:
        obj, prefix = queue.pop(0)
        for name, child in view.children(obj).items():
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_path = f"{prefix}{name}"
            key = f"{child_path}/.ATTRIBUTES/VARIABLE_VALUE"
            shape = getattr(child, "shape", None)
            if key in saved and shape is not None and list(shape) != saved[key]:
                found.append(f"{child_path}: checkpoint {tuple(saved[key])}, model {tuple(shape)}")
            queue.append((child, child_path + "/"))
    return found


def top_level_differences(checkpoint: Any, path: str) -> tuple[list[str], list[str]]:
    """The top-level names only the model has (with state), and only the checkpoint has.

    The names come from the object graph saved in the checkpoint, not from the
    tensors' keys: TF names a value by its first path in the graph, so a model's
    variables may be saved under the optimizer that also tracks them.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        tf.train.load_checkpoint(path).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    )
    saved = {child.local_name for child in graph.nodes[0].children}
    live = tf.train.TrackableView(checkpoint).children(checkpoint)
    saved.discard("save_counter")  # the Checkpoint's own counter, created on first save
    missing = sorted(
        n for n, obj in live.items() if n not in saved and n != "save_counter" and _holds_state(obj)
    )
    unexpected = sorted(n for n in saved if n not in live)
    return missing, unexpected


def checkpoint_bytes(prefix: str) -> int:
    """The size on disk of the files of the checkpoint at ``prefix``."""
    return sum(os.path.getsize(p) for p in glob.glob(glob.escape(prefix) + ".*"))


def track_global_step(checkpoint: Any, variable: Any) -> None:
    """Make ``checkpoint`` save ``variable`` as ``global_step``, unless it already does."""
    existing = getattr(checkpoint, "global_step", None)
    if existing is None:
        checkpoint.global_step = variable
    elif existing is not variable:
        raise ValueError(
            "checkpoint already has a `global_step` that is not the supervisor's global_step; "
            "pass it as global_step= instead"
        )


class LogdirLock:
    """One live chief per logdir: an exclusive ``flock`` on ``<logdir>/.asupervisor.lock``.

    The kernel drops the lock when its process dies, however it dies, so a lock
    left by a killed run never blocks the next one.
    """

    NAME = ".asupervisor.lock"

    def __init__(self, logdir: str) -> None:
        self.path = os.path.join(logdir, self.NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise type(exc)(
                exc.errno,
                f"cannot write into logdir {os.path.dirname(self.path)!r} "
                f"(its lock file could not be created): {exc.strerror}",
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise LogdirLockedError(
                f"logdir {os.path.dirname(self.path)!r} is in use by another chief "
                f"(pid {holder}); give each run its own logdir, or make this one a non-chief"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
