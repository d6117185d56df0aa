"""Checkpoint mechanics: restore the newest checkpoint, save one, count failures.

Every function here runs on the training thread, so a save or a restore always
sees the state of one step boundary.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._errors import CheckpointMismatchError
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
        self.last_saved_step: int | None = None
        self.last_saved_at: float | None = None  # time.monotonic() of the last save
        self.failures = 0

    def latest(self) -> str | None:
        import tensorflow as tf

        return tf.train.latest_checkpoint(self.directory)  # type: ignore[no-any-return]

    def restore(self, path: str) -> None:
        started = time.perf_counter()
        status = self.checkpoint.restore(path)
        try:
            status.assert_existing_objects_matched()
        except AssertionError as exc:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match the objects being restored: {exc}"
            ) from exc
        log.info("checkpoint.restored", path=path, seconds=round(time.perf_counter() - started, 4))

    def save(self, step: int) -> str | None:
        """Save at ``step``; ``None`` if a checkpoint for it exists or the save failed.

        A failed save is logged and leaves every earlier checkpoint as it was; the
        third failure in a row is raised.
        """
        if step == self.last_saved_step:
            return None
        started = time.perf_counter()
        try:
            path: str = self.manager.save(checkpoint_number=step)
        except Exception as exc:
            self.failures += 1
            log.error(
                "checkpoint.failed",
                step=step,
                error=f"{type(exc).__name__}: {exc}",
                consecutive_failures=self.failures,
            )
            if self.failures >= MAX_CONSECUTIVE_FAILURES:
                raise
            return None
        seconds = round(time.perf_counter() - started, 4)
        self.failures = 0
        self.last_saved_step = step
        self.last_saved_at = time.monotonic()
        log.info(
            "checkpoint.saved",
            path=path,
            step=step,
            seconds=seconds,
            blocked_seconds=seconds,
            bytes=checkpoint_bytes(path),
        )
        return path


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
