"""StopPath: how one session stops, bounded by one grace, and how it ended (its ``Ending``).

The stop's state is here and nowhere else: the phase, a second SIGINT, a cancellation
from outside, the work that outlived the grace, the stop signals that came, the services
left behind. The phase changes through ``move`` only, and only forward::

    STARTING ──▶ RUNNING ──▶ DRAINING ──▶ FINISHING ──▶ CLOSING ──▶ CLOSED
        │            │           │                         ▲
        │            │           └── stuck, error, cancel ─┤
        │            └── a second SIGINT ──────────────────┤
        └── start-up failed or interrupted ────────────────┘

**One grace.** ``stop_grace_secs`` is one deadline, set once: when the body has left
(draining begins), or, when work that was in flight at the stop outlives the grace while
the body waits for it, at that moment (the grace is spent). A training step that was past
its own deadline when the stop came (the watchdog's, the runner's) is not given the grace:
it was judged stuck already, and waiting again would make a hang cost deadline + grace.
Draining, the hooks' ``end`` and the final save, the services and the closing all share
it; once it has passed, each remaining part of the close gets a moment (``CLOSE_SECS``) and
the ledger line and last beat ``RECORD_SECS``, so that the session's end is on record
before an outside kill (``asupervisor run --grace``) that allows for the grace.

**One ending.** ``end`` decides how the session ended, once, from the facts (``Ending``),
and seals the stop flag: an error reported after that is raised in its reporter.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable

import anyio

from .._errors import GracePeriodExpired, SessionClosed, SessionStopped, StepTimeout
from .._kinds import JobKind, Phase
from .._log import log
from .._outcome import Ending, Outcome, StopReason, is_cancellation, outcome_of
from .._training.thread import Flight, Job, TrainingThread
from .services import ServiceGroup
from .stopping import StopFlag, end_of_data_types

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

POLL_SECS = 0.05  # how often the grace watcher looks at the job in flight
CLOSE_SECS = 0.1  # what each part of the close gets once the grace has passed
RECORD_SECS = 3.0  # what the ledger line and the last beat get, whatever happened

# Where the stop path may go from each phase; anything else is a bug in the session.
_NEXT = {
    Phase.STARTING: (Phase.RUNNING, Phase.CLOSING),
    Phase.RUNNING: (Phase.DRAINING, Phase.CLOSING),
    Phase.DRAINING: (Phase.FINISHING, Phase.CLOSING),
    Phase.FINISHING: (Phase.CLOSING,),
    Phase.CLOSING: (Phase.CLOSED,),
    Phase.CLOSED: (),
}


class StopPath:
    """The stop of one session: its phases, the one grace, the facts, the ending."""

    def __init__(
        self,
        flag: StopFlag,
        thread: TrainingThread,
        services: ServiceGroup,
        grace_secs: float,
        request_stop: Callable[[BaseException | None, StopReason], object],
        step: Callable[[], int],
        outside_signal: Callable[[], str | None],
        step_deadline: Callable[[], float | None] = lambda: None,
        first_step_done: Callable[[], bool] = lambda: True,
        in_group: bool = False,
    ) -> None:
        self._flag, self._thread, self._services = flag, thread, services
        self._in_group = in_group  # a worker of a multi-worker job: it can lose a peer
        self._grace = grace_secs
        # A training step that had run this long when the stop came was judged stuck
        # already (the watchdog's step_timeout_secs, the runner's --stuck-after): it is
        # not waited for again. Read at the stop (the channel is known by then).
        self._step_deadline = step_deadline
        self._first_step_done = first_step_done
        self.deadline_secs: float | None = None  # the step deadline, read at the stop
        self._request_stop = request_stop  # the session's one entry (agreed in a job)
        self._step = step  # the global step, for the log
        self._outside_signal = outside_signal  # a stop signal the program had (asv.run)
        self.phase = Phase.STARTING
        self.interrupted = False  # a second SIGINT: stop at once
        self.cancelled: BaseException | None = None  # cancellation from outside the session
        self._cancelled_by: tuple[str, Phase] | None = None  # the program's stop signal
        self.stuck: str | None = None  # the work still running after the grace period
        self.stuck_for: float | None = None  # a step past its deadline: how long it had run
        self.signals: list[tuple[str, Phase]] = []  # stop signals that came, and when
        self.late_signals: list[int] = []  # came while stopping: handed on afterwards
        self.deadline: float | None = None  # the end of the one grace, once it has begun
        self.abandoned: tuple[str, ...] = ()  # services left behind
        self.ending: Ending | None = None
        self._scopes: list[anyio.CancelScope] = []  # what a stop at once cancels

    # -- the phase ---------------------------------------------------------------------

    def move(self, to: Phase) -> None:
        """The one way the phase changes: forward, along the machine drawn above."""
        if to not in _NEXT[self.phase]:
            raise RuntimeError(
                f"the session's stop path cannot go from {self.phase.value} to {to.value}"
            )
        self.phase = to

    def cancels(self, scope: anyio.CancelScope) -> None:
        """``scope`` is cancelled by a stop at once (a second SIGINT)."""
        self._scopes.append(scope)

    # -- what comes from outside ---------------------------------------------------------

    def signalled(self, name: str) -> None:
        """On the loop: SIGTERM or a first SIGINT. While the session starts or runs, a
        graceful stop (requested before anything that can fail: a log call into a closed
        pipe); later, the stop it asks for is under way: kept for the ending."""
        self.signals.append((name, self.phase))
        if self.phase in (Phase.STARTING, Phase.RUNNING):
            self._request_stop(None, StopReason.SIGNAL)
            action = "graceful stop"
        else:
            self.late_signals.append(signal.Signals[name].value)
            action = "the stop is under way"
        with contextlib.suppress(Exception):
            log.warning("signal.received", signal=name, action=action)

    def interrupt(self, name: str) -> None:
        """On the loop: a second SIGINT stops at once: no final save, and nothing is waited
        for but the record (the ledger line, the last beat)."""
        self.signals.append((name, self.phase))
        self.interrupted = True
        self._flag.set(None, StopReason.SIGNAL)
        for scope in self._scopes:
            scope.cancel()
        self._services.cancel()
        with contextlib.suppress(Exception):
            log.warning("signal.received", signal=name, action="stop at once")

    def start_failed(self, exc: BaseException) -> None:
        """Start-up raised: an error is the outcome; anything else (a cancellation, a
        KeyboardInterrupt) ends the session at once."""
        if isinstance(exc, Exception):
            self._flag.set(exc, StopReason.EXCEPTION)
        else:
            self._cancelled(exc)

    def body_raised(self, exc: BaseException) -> None:
        """What the body left with: a cancellation from outside, a clean end (the stop's
        ``SessionStopped``, the end of the data, also inside the body's own task
        groups), or an error, kept as the very object raised."""
        cancelled = anyio.get_cancelled_exc_class()
        leaves = _leaves(exc)
        if isinstance(exc, cancelled):
            # Our own cancellation of the body never gets here (its scope absorbs it).
            self._cancelled(exc)
        elif all(isinstance(e, (SessionStopped, cancelled, *end_of_data_types())) for e in leaves):
            ended = any(isinstance(e, end_of_data_types()) for e in leaves)
            self._flag.set(None, StopReason.END_OF_DATA if ended else StopReason.REQUESTED)
        elif all(isinstance(e, Exception) for e in leaves):
            self._flag.set(exc, StopReason.EXCEPTION)
        else:  # KeyboardInterrupt, SystemExit: not ours to swallow
            self._cancelled(exc)

    def _cancelled(self, exc: BaseException) -> None:
        self.cancelled = exc
        by = self._outside_signal()  # asv.run cancels the program for a stop signal
        if by is not None and is_cancellation(exc):
            self._cancelled_by = (by, self.phase)
        self._flag.set(None, StopReason.REQUESTED)

    # -- the one grace -------------------------------------------------------------------

    def left(self) -> float:
        """Seconds left of the grace period (all of it until it has begun)."""
        if self.deadline is None:
            return self._grace
        return max(0.0, self.deadline - time.monotonic())

    def closing(self) -> float:
        """What one part of the close may take: the rest of the grace, at least a moment
        (nothing, after a second SIGINT)."""
        return 0.0 if self.interrupted else max(self.left(), CLOSE_SECS)

    def recording(self) -> float:
        """What the ledger line and the last beat may take: the rest of the grace, at
        least ``RECORD_SECS``, also after a second SIGINT (they are the session's record)."""
        return max(self.left(), RECORD_SECS)

    def _begin_grace(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self._grace

    def _report_stuck(self, name: str) -> None:
        self.stuck = name
        now = time.monotonic()
        self.deadline = now if self.deadline is None else min(self.deadline, now)
        log.error(
            "session.step_stuck",
            step=self._step(),
            job=name,
            grace_secs=self._grace,
            deadline_secs=self.deadline_secs if self.stuck_for is not None else None,
            ran_secs=None if self.stuck_for is None else round(self.stuck_for, 2),
        )

    def _past_deadline(self, flight: Flight, stopped_at: float) -> float | None:
        """How long the training step in flight had run when the stop came, if that was
        past its deadline: it was judged stuck (the stop came for it, or would have). Only
        after the first step: tracing and restores have the longer start-up deadline; and
        a step that crosses its deadline after the stop has the grace, as any work has."""
        deadline = self.deadline_secs
        if deadline is None or not flight.training or not self._first_step_done():
            return None
        ran = stopped_at - flight.step_started_at
        return ran if ran >= deadline else None

    async def watch_grace(self, body: anyio.CancelScope) -> None:
        """While the body runs: work on the training thread that was under way (or queued)
        when the stop came gets ``stop_grace_secs`` from then, or is given up on, and the
        grace is spent; a training step already past its deadline is given up on at once
        (it was judged stuck: the stop came for it, or it would be judged so now). Work
        the body starts after the stop is the body's own business."""
        await self._flag.wait()
        stopped_at = self._flag.stopped_at or time.monotonic()
        self.deadline_secs = self._step_deadline()
        grace = self._grace
        while self.phase is Phase.RUNNING and not body.cancel_called:
            flight = self._thread.in_flight()
            if flight is not None:
                job, now = flight.job, time.monotonic()
                if job.kind is not JobKind.HOLD and job.submitted_at <= stopped_at:
                    past = self._past_deadline(flight, stopped_at)
                    if past is not None or now - max(flight.started_at, stopped_at) >= grace:
                        self.stuck_for = past
                        self._report_stuck(job.name)
                        body.cancel()
                        return
            await anyio.sleep(min(POLL_SECS, max(grace / 4, 0.005)))

    # -- the stop --------------------------------------------------------------------

    async def stop(
        self, *, started: bool, ready: bool, finish: Callable[[], Awaitable[None]]
    ) -> None:
        """The body has left: drain the training thread, then, after a clean stop of a
        session that started, ``finish`` (the hooks' ``end``, the final save)."""
        self._flag.set(None, StopReason.REQUESTED)
        self.move(Phase.DRAINING)
        self._begin_grace()
        # A stop during start-up: nothing has trained, so nothing is waited for or saved.
        idle = started and await self._drain()
        clean = self.cancelled is None and self._flag.error is None
        if idle and clean and ready:
            self.move(Phase.FINISHING)
            await self._finish(finish)

    async def _drain(self) -> bool:
        """Wait, at most what is left of the grace, until the training thread is idle; a
        training step past its deadline is given up on at once."""
        if self.stuck is not None:
            return False
        if self._thread.idle():
            return True
        stopped_at = self._flag.stopped_at or time.monotonic()
        if self.deadline_secs is None:
            self.deadline_secs = self._step_deadline()
        idle = anyio.Event()

        async def drained() -> None:
            with contextlib.suppress(SessionClosed):
                await self._thread.run_job(Job(_nothing, kind=JobKind.INTERNAL))
            idle.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drained)
            while not idle.is_set():
                flight = self._thread.in_flight()
                past = None if flight is None else self._past_deadline(flight, stopped_at)
                if past is not None or self.left() <= 0:
                    self.stuck_for = past
                    self._report_stuck(flight.job.name if flight else "a training-thread job")
                    tg.cancel_scope.cancel()
                    return False
                with anyio.move_on_after(min(POLL_SECS, self.left())):
                    await idle.wait()
        return True

    async def _finish(self, finish: Callable[[], Awaitable[None]]) -> None:
        """``finish`` within what is left of the grace (a grace of 0: not bounded; the
        work in flight was not waited for, the final save is)."""
        with anyio.move_on_after(self.left() if self._grace > 0 else None) as timer:
            await finish()
        if timer.cancelled_caught:
            self._report_stuck("the hooks' end and the final checkpoint")

    async def close_services(self) -> None:
        """CLOSING begins: services get what is left of the grace, then are cancelled;
        one that goes on after its cancellation is left behind (it can do nothing to
        this session any more)."""
        self.move(Phase.CLOSING)
        self._begin_grace()
        services = self._services
        if not self.interrupted and not await services.wait(self.left()):
            log.warning("service.cancelled", running=services.running, grace_secs=self._grace)
        services.cancel()
        if not await services.wait(CLOSE_SECS):
            self.abandoned = tuple(services.running)
            log.error("service.abandoned", running=list(self.abandoned))

    # -- the ending ------------------------------------------------------------------

    def held(
        self,
        job: str,
        signal_name: str | None,
        *,
        step: int,
        unsaved_steps: int,
        last_saved_step: int | None,
    ) -> Ending:
        """From the loop watch's thread, the loop held past the grace: ``job`` (what holds
        it) is the work that outlived the grace, and the ending is decided now (stuck);
        the phase stays where the held loop left it. ``signal_name``: the stop signal the
        session's handler heard that the held loop never took (the stop it asked for)."""
        if signal_name is not None and not self.signals:
            self.signals.append((signal_name, self.phase))
            self._flag.set(None, StopReason.SIGNAL)
        self.stuck = job
        now = time.monotonic()
        self.deadline = now if self.deadline is None else min(self.deadline, now)
        return self.end(step=step, unsaved_steps=unsaved_steps, last_saved_step=last_saved_step)

    def end(self, *, step: int, unsaved_steps: int, last_saved_step: int | None) -> Ending:
        """Decide, once, how the session ended, from what happened; the stop flag is
        sealed, so an error reported from now on is raised in its reporter. Decided once:
        a later call (the close of a loop that a held-loop ending raced) gets the same."""
        if self.ending is not None:
            return self.ending
        error, reason = self._flag.seal()
        signal_name, signal_phase = self.signals[0] if self.signals else (None, None)
        if self._cancelled_by is not None and signal_name is None:
            signal_name, signal_phase = self._cancelled_by
        outcome = self._outcome(error, reason, signal_name)
        lost = (
            f"{unsaved_steps} step(s) since the last checkpoint (step {last_saved_step}) "
            "were not saved"
        )
        raised: BaseException | None = error
        if self.interrupted:
            raised = KeyboardInterrupt(f"a second SIGINT: stopped at once; {lost}")
        elif self.cancelled is not None:
            raised = self.cancelled
        elif self.stuck is not None and not isinstance(error, StepTimeout):
            if self.stuck_for is not None:
                why = (
                    f"{self.stuck!r} had run {self.stuck_for:.1f} s when the stop came, past "
                    f"its deadline of {self.deadline_secs:g} s (asupervisor run's --stuck-after "
                    "or step_timeout_secs): it was not given the grace"
                )
            else:
                why = (
                    f"{self.stuck!r} was still running {self._grace} s (stop_grace_secs) "
                    "after the stop"
                )
            expired = GracePeriodExpired(
                f"{why}; no final checkpoint was written: {lost}",
                job=self.stuck,
                grace_secs=self._grace,
                unsaved_steps=unsaved_steps,
            )
            expired.__cause__ = error
            raised = expired
        elif error is not None and unsaved_steps and hasattr(error, "add_note"):
            error.add_note(f"asupervisor: {lost}")
        self.ending = Ending(
            outcome=outcome,
            reason=reason,
            error=error,
            raised=raised,
            step=step,
            unsaved_steps=unsaved_steps,
            last_saved_step=last_saved_step,
            stuck_job=self.stuck,
            signal=signal_name,
            signal_phase=signal_phase,
            abandoned=self.abandoned,
        )
        return self.ending

    def _outcome(
        self, error: BaseException | None, reason: StopReason | str | None, signal_name: str | None
    ) -> Outcome:
        """The one decision of a session's outcome. A stop at once or from outside first
        (a cancellation that the program's stop signal caused is a preemption), then
        work that outlived the grace, then the first error. A clean stop is a preemption
        if a stop signal came before the session ended, also while it was already
        stopping: the process was asked to go, and says so (42: start it again; a run
        that was done ends at once), as TF's preemption handler does; else done."""
        if self.interrupted:
            return Outcome.INTERRUPTED
        if self.cancelled is not None:
            return Outcome.PREEMPTED if self._cancelled_by is not None else Outcome.INTERRUPTED
        if self.stuck is not None:
            return Outcome.STUCK
        if error is not None:
            return outcome_of(error, in_group=self._in_group)
        if reason is StopReason.SIGNAL or signal_name is not None:
            return Outcome.PREEMPTED
        return Outcome.DONE

    def closed(self) -> None:
        self.move(Phase.CLOSED)

    def exit_error(self, *, second_interrupt: bool) -> BaseException | None:
        """What the session raises as it exits: what its ending says; and, when a second
        SIGINT came after the ending was decided (``second_interrupt``: its listener heard
        one) and the ending raises nothing, a ``KeyboardInterrupt``: the user's "now"
        holds whatever the phase, and the program does not go on after the block."""
        ending = self.ending
        raised = None if ending is None else ending.raised
        if raised is None and second_interrupt and ending is not None:
            return KeyboardInterrupt(
                f"a second SIGINT as the session ended ({ending.outcome.value}, its end "
                "recorded): the program stops at once"
            )
        return raised


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups; an ordinary one is its own leaf."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _nothing() -> None:
    return None
