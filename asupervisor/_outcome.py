"""Why a session stopped, and how it ended: each defined once, here.

``StopReason`` is why the stop was asked for (the first stop fixes it); ``Outcome`` is
what the session's end means for whoever runs the process: done, preempted, failed
(worth a retry or not), stuck, or stopped at once. Each outcome has the process exit
status a run should end with, so that an orchestrator can tell them apart: the table
``_EXIT_STATUS`` below is the only one. ``Ending`` is how one session ended, decided once
from what happened (``_session/stoppath.py``) and read by everything that reports it:
the ledger, the last heartbeat, ``sess.outcome``, and the process's exit status.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from ._kinds import Phase

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup


class StopReason(str, enum.Enum):
    """Why a session was asked to stop. A ``str``: ``sess.stop_reason == "signal"`` holds.

    A reason a user gives (``sess.request_stop(reason="eval_done")``) is kept as the
    user's own string; these are the library's own.
    """

    REQUESTED = "requested"
    """Asked for without a reason: the body left, ``request_stop()``, a hook, a service."""
    EXCEPTION = "exception"
    """An error anywhere: a step, a hook, a service, a save."""
    SIGNAL = "signal"
    """SIGTERM or SIGINT (or another graceful-stop signal): preempted."""
    END_OF_DATA = "end_of_data"
    """The data ran out: ``StopIteration`` or ``tf.errors.OutOfRangeError`` from user code."""
    STEP_LIMIT = "step_limit"
    """``StopAtStepHook`` reached its step."""
    NAN = "nan"
    """``NanLossHook(fail_on_nan=False)`` saw a NaN loss."""
    TIMEOUT = "timeout"
    """The watchdog saw one step run longer than ``step_timeout_secs``."""

    def __str__(self) -> str:
        return self.value


def reason_of(reason: StopReason | str) -> StopReason | str:
    """The library's own reason as its member; any other string as it is."""
    try:
        return StopReason(reason)
    except ValueError:
        return reason


class Outcome(enum.Enum):
    """How a session ended, and the exit status a process that ends with it should have.

    ``asupervisor.exit_status(outcome)`` and the examples use these statuses; the
    README's "Exit statuses" table says why each is what it is.
    """

    DONE = "done"
    """A clean stop for any reason but a signal: a step limit, the end of the data, the
    body left, a user's stop. The final checkpoint is on disk."""
    PREEMPTED = "preempted"
    """A clean stop asked for by a signal before the run was done. The final checkpoint
    is on disk; run the same command again to go on."""
    FAILED = "failed"
    """An error a new attempt may not meet again (an I/O error, an error of unknown
    kind). Steps since the last checkpoint were not saved."""
    FAILED_PERMANENTLY = "failed_permanently"
    """An error a new attempt meets again: bad configuration or input, a checkpoint that
    does not fit the model, a NaN loss. Retrying cannot help."""
    STUCK = "stuck"
    """Work on the training thread outlived the grace period, or the watchdog's limit."""
    UNREACHABLE = "unreachable"
    """The logdir's object store could not be reached, or refused the credentials found
    (``StoreUnreachableError``). Nothing ran; a new attempt may find it back."""
    LOST_PEER = "lost_peer"
    """A worker of a multi-worker job lost a peer: a collective, or the job's coordination
    service, failed because another worker (or its host) is gone. This worker did nothing
    wrong; the job must be started again as a whole. Steps since the last checkpoint were
    not saved (a final save needs every worker)."""
    INTERRUPTED = "interrupted"
    """Stopped at once (a second SIGINT, or a cancellation from outside the session):
    no final checkpoint."""

    @property
    def exit_status(self) -> int:
        return _EXIT_STATUS[self]


_EXIT_STATUS = {
    Outcome.DONE: 0,
    # TF's PreemptionCheckpointHandler exits 42 after its save: an orchestrator that
    # restarts on it (a Kubernetes podFailurePolicy) treats both libraries alike, and it
    # is not 143, which a process killed by SIGTERM without saving also shows.
    Outcome.PREEMPTED: 42,
    Outcome.FAILED: 1,  # what an uncaught Python exception exits with
    Outcome.FAILED_PERMANENTLY: 78,  # EX_CONFIG (sysexits.h): configuration error
    Outcome.STUCK: 124,  # what timeout(1) exits with when it ends a command
    Outcome.UNREACHABLE: 69,  # EX_UNAVAILABLE (sysexits.h): a service is unavailable
    # EX_TEMPFAIL (sysexits.h): a temporary failure, to be retried. Its own number, not
    # 1: an engine (or the runner of a SLURM step) tells the worker that lost its peer from
    # the one that failed first, which is the cause. Not a status a shell, a signal (128+N),
    # Python (1, 2) or timeout(1) gives, nor one TFJob retries (it is mapped to one).
    Outcome.LOST_PEER: 75,
    Outcome.INTERRUPTED: 130,  # 128 + SIGINT, as a shell reports Ctrl-C
}


@dataclass(frozen=True)
class Ending:
    """How one session ended: the facts, and what they were decided to mean.

    Made once, when the session closes, before its ledger line and last beat are
    written; never changed after. ``raised`` is the very object the session raises at
    its end (``None``: a clean end), so that the process can tell its own ending from
    any other error by identity.
    """

    outcome: Outcome
    reason: StopReason | str | None  # why the stop was asked for (the first stop's reason)
    error: BaseException | None  # the first error, as it was raised
    raised: BaseException | None  # what the session raises at its end
    step: int
    unsaved_steps: int  # run since the last good checkpoint, and not saved now
    last_saved_step: int | None
    stuck_job: str | None  # the work on the training thread that outlived the grace
    signal: str | None  # the first stop signal that reached the session ("SIGTERM")
    # Where the session was when that signal came: STARTING is before its work,
    # RUNNING during it, DRAINING, FINISHING and CLOSING after it (the stop was under way).
    signal_phase: Phase | None
    abandoned: tuple[str, ...]  # services that went on after their cancellation: left behind

    @property
    def exit_status(self) -> int:
        return exit_status_of(self.outcome, self.raised)


def exit_status_of(outcome: Outcome, raised: BaseException | None = None) -> int:
    """The status a process ends with: its outcome's (the table above), unless what ends
    it is a ``SystemExit``, whose own code Python exits with."""
    if isinstance(raised, SystemExit):
        code = raised.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return _EXIT_STATUS[outcome]


def outcome_of(error: BaseException, in_group: bool = False) -> Outcome:
    """What an error that ends a run means: the outcome it carries (``GracePeriodExpired``,
    ``StepTimeout``: stuck), an interrupt or a cancellation (interrupted), in a worker of
    a multi-worker job (``in_group``) a collective's error that says a peer is gone (lost
    a peer), an error a retry meets again (failed permanently), or any other failure."""
    carried = getattr(error, "outcome", None)
    if isinstance(carried, Outcome):
        return carried
    if isinstance(error, KeyboardInterrupt) or is_cancellation(error):
        return Outcome.INTERRUPTED
    if in_group and is_peer_loss(error):
        return Outcome.LOST_PEER
    return Outcome.FAILED_PERMANENTLY if is_permanent(error) else Outcome.FAILED


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error``, raised in a worker of a multi-worker job, says that a peer is
    gone: TensorFlow's ``UnavailableError`` (a collective, or the coordination service,
    could not reach a worker), ``AbortedError`` (a collective aborted by a peer's failure)
    or ``CancelledError`` (the collectives cancelled after one), also inside an exception
    group whose every error is one. Read without importing TensorFlow: an error of its
    can only come from a process that has."""
    if isinstance(error, BaseExceptionGroup):
        return bool(error.exceptions) and all(is_peer_loss(e) for e in error.exceptions)
    tf_errors = getattr(sys.modules.get("tensorflow"), "errors", None)
    if tf_errors is None:
        return False
    kinds = (tf_errors.UnavailableError, tf_errors.AbortedError, tf_errors.CancelledError)
    return isinstance(error, kinds)


def is_cancellation(error: BaseException) -> bool:
    """The event loop's cancellation (asyncio's ``CancelledError``, trio's ``Cancelled``),
    without a running loop to ask."""
    import asyncio

    trio = sys.modules.get("trio")
    return isinstance(error, asyncio.CancelledError) or (
        trio is not None and isinstance(error, trio.Cancelled)
    )


def is_permanent(error: BaseException) -> bool:
    """Whether a new attempt would meet ``error`` again: a wrong model or logdir, bad
    input or configuration, a diverged run. Anything else may be passing."""
    from ._errors import CheckpointMismatchError, LogdirLockedError, NanLossError

    permanent: tuple[type[BaseException], ...] = (
        CheckpointMismatchError,
        LogdirLockedError,  # another live run holds the logdir: a retry meets it again
        NanLossError,
        TypeError,
        ValueError,
        AttributeError,
        NameError,
        ImportError,
        SyntaxError,
        NotImplementedError,
        AssertionError,
    )
    if isinstance(error, BaseExceptionGroup):
        return all(is_permanent(e) for e in error.exceptions)
    return isinstance(error, permanent)


# Worse first: what a job's outcome is when its processes ended differently.
_SEVERITY = (
    Outcome.FAILED_PERMANENTLY,
    Outcome.UNREACHABLE,
    Outcome.STUCK,
    Outcome.FAILED,
    # After a failure: a worker that lost its peer is the consequence of another's
    # failure, never its cause, when both are seen.
    Outcome.LOST_PEER,
    Outcome.INTERRUPTED,
    Outcome.PREEMPTED,
    Outcome.DONE,
)


def worst(outcomes: Iterable[Outcome]) -> Outcome:
    """The worst of several processes' outcomes (a job's): a failure no retry fixes, then
    a store out of reach, stuck, failed, lost a peer, interrupted, preempted, done.
    ``ValueError`` for none."""
    return min(outcomes, key=_SEVERITY.index)
