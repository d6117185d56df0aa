"""The errors asupervisor raises.

Every error is a :class:`SupervisorError`; a few are also the standard
exception a caller would naturally catch::

    SupervisorError
     ├── GracePeriodExpired      (also RuntimeError) a step outlived stop_grace_secs
     ├── CheckpointMismatchError a checkpoint's variables do not match the model
     ├── CheckpointSaveError     saves failed three times in a row, or the final save failed
     ├── LogdirLockedError       another live chief holds the logdir
     ├── StoreUnreachableError   (also OSError) the logdir's object store cannot be reached
     ├── WaitTimeout             (also TimeoutError) no checkpoint appeared in time
     ├── NanLossError            a step's loss was NaN
     │    └── DivergedError      the loss kept diverging after max_rollbacks rollbacks
     ├── StepTimeout             the watchdog saw a step run too long
     ├── SessionStopped          (also RuntimeError) run/train after a stop; a clean exit
     └── SessionClosed           (also RuntimeError) work given to a session that has closed

Errors raised by the user's own code (a step, a hook, a service) are never
wrapped: they reach the caller as the same object, traceback intact.
"""

from __future__ import annotations

from ._outcome import Outcome


class SupervisorError(Exception):
    """Base class of every error asupervisor raises itself."""


class GracePeriodExpired(SupervisorError, RuntimeError):
    """A training step was still running when the stop grace period ran out.

    ``__cause__`` is the error that started the stop, if there was one. What the session
    knew is on the error too: ``job`` (the work that outlived the grace), ``grace_secs``,
    ``unsaved_steps`` (run since the last checkpoint: lost) and ``outcome``
    (``Outcome.STUCK``: the process exits 124 with it).
    """

    outcome = Outcome.STUCK

    def __init__(
        self,
        message: str,
        *,
        job: str | None = None,
        grace_secs: float | None = None,
        unsaved_steps: int | None = None,
    ) -> None:
        super().__init__(message)
        self.job = job
        self.grace_secs = grace_secs
        self.unsaved_steps = unsaved_steps


class CheckpointMismatchError(SupervisorError):
    """A checkpoint's variables do not match the objects being restored."""


class CheckpointSaveError(SupervisorError):
    """Checkpoint saves failed several times in a row; ``__cause__`` is the last failure.

    A distinct type because TensorFlow reports some write failures (a file too
    large for the disk's limits) as ``tf.errors.OutOfRangeError``, the same type
    that means "end of data": such a failure must never pass for a clean stop.
    """


class StoreUnreachableError(SupervisorError, OSError):
    """The logdir's object store (``gs://``...) could not be reached, or refused the
    credentials TensorFlow found: no network, a wrong endpoint or proxy, no credentials,
    or credentials without access to the bucket. The message is one line: the logdir and
    TensorFlow's own reason. ``outcome`` is ``Outcome.UNREACHABLE`` (exit status 69)."""

    outcome = Outcome.UNREACHABLE


class LogdirLockedError(SupervisorError):
    """Another live chief process holds the lock on this logdir."""


class WaitTimeout(SupervisorError, TimeoutError):
    """A non-chief waited ``max_wait_secs`` and no checkpoint appeared."""


class NanLossError(SupervisorError):
    """A training step returned a NaN loss."""


class StepTimeout(SupervisorError):
    """A training step ran longer than ``step_timeout_secs``: the session ends stuck
    (``outcome``), and the process exits 124 with it."""

    outcome = Outcome.STUCK


class SessionStopped(SupervisorError, RuntimeError):
    """``run`` or ``train`` was called after the session was asked to stop.

    The message names the stop's reason. It ends a loop that does not check
    ``should_stop()``; leaving the ``async with`` block with it is a clean exit
    (the final checkpoint is written), as ending by ``should_stop()`` would be.
    """


class SessionClosed(SupervisorError, RuntimeError):
    """Work was given to a session that has closed (``sess.call``, ``between_steps`` ...
    after the ``async with`` block), or that the session gave up on.

    Also what a job abandoned by its session meets on the training thread at its next
    step boundary: it runs no hook, saves nothing and asks for no stop.
    """


class DivergedError(NanLossError):
    """The loss diverged again after ``Rollback.max_rollbacks`` rollbacks (or there was no
    healthy checkpoint to roll back to); the message says where and what was tried."""


# What the write guard and the checkpointer raise for "this session may not write any more".
Fenced = SessionClosed
