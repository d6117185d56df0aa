"""SessionRuntime: the one owner of everything that lives for one session.

The training thread, the stop flag, the cancel scopes, the events file, the
checkpointer, the logdir lock, the cluster agreement, the data position, the
checkpoint's root and the hooks' calls belong to one runtime; nothing of a session
outlives it or acts on a later one, and no other module sets its fields: start-up
and shutdown (``_startup``, ``_shutdown``) hand what they found to its methods.
The stop path (its phases, the one grace, the ending) is a ``StopPath`` of its own
(``stoppath.py``, drawn in ``docs/ARCHITECTURE.md``); ``request_stop`` is its one entry.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from .. import _exit
from .._checkpointing.checkpointer import Checkpointer, RestoreReport
from .._checkpointing.root import SavedRoot
from .._errors import (
    SessionClosed,
    SessionStopped,
)
from .._kinds import JobKind, Phase, RestoreSource
from .._log import log
from .._logdir import heartbeat as _heartbeat
from .._logdir.files import RUNS
from .._logdir.lock import LeaseLock, LogdirLock, WriteGuard
from .._outcome import Outcome, StopReason, reason_of
from .._training.kept_state import KeptState, key_of
from .._training.makeup import KEY as MAKEUP_KEY
from .._training.makeup import KIND as MAKEUP_KIND
from .._training.makeup import Makeup
from .._training.position import Position
from .._training.run_story import write_story
from .._training.session_summaries import SessionSummaries
from .._training.steps import GlobalStep, Stepper
from .._training.summaries import EventsFile
from .._training.thread import Job, TrainingThread, loop_caller
from . import shutdown as _shutdown
from . import startup as _startup
from .checkpoints import SessionCheckpoints
from .loopwatch import LoopWatch
from .presence import CHANNEL_BEAT_SECS, Presence
from .services import Registration, ServiceGroup
from .signals import SignalListener
from .stoppath import StopPath
from .stopping import describe_error, end_of_data_error, end_of_data_types

if TYPE_CHECKING:
    from .._cluster import Agreement
    from .._supervisor import Supervisor
    from .coordinator import SessionCoordinator
    from .managed import ManagedSession


def step_deadline(sv: Supervisor, watchdog: bool, watched: bool) -> float | None:
    """How long one training step may run before it is judged stuck: the watchdog's
    ``step_timeout_secs`` (if it runs: with the standard services) or, in a process
    ``asupervisor run`` watches over its channel, the runner's limit (``--stuck-after``, at
    least three beats): the sooner. A process the child starts inherits the variable, not
    the channel: no one judges it."""
    found = []
    if sv.step_timeout_secs is not None and watchdog:
        found.append(sv.step_timeout_secs)
    runner = _heartbeat.stuck_after_from_env() if watched else None
    if runner is not None:  # the runner's judge: at least three beats of the channel's
        found.append(max(runner, 3 * (sv.heartbeat_secs or CHANNEL_BEAT_SECS)))
    return min(found, default=None)


class SessionRuntime:
    """Runs one session of a Supervisor from entry to exit."""

    def __init__(
        self, sv: Supervisor, coord: SessionCoordinator, *, timed_saves: bool = True
    ) -> None:
        from .managed import ManagedSession

        self.sv = sv  # configuration only: read, never written
        self.coord = coord
        self.flag = coord.open_session(self.report_stop)
        self.caller = loop_caller()
        self.thread = TrainingThread(self.caller)
        self.lock: LogdirLock | LeaseLock | None = None
        self.guard = WriteGuard(None)
        self.checkpointer: Checkpointer | None = None
        given = sv.given_summary_writer
        own = sv.logdir if sv.writes_summaries and given is None else None
        self.events = EventsFile(own, given)
        self.agreement: Agreement | None = None
        self.signals: SignalListener | None = None
        self.ready = False  # restored (or initialized): the state is the run's own
        self.session: ManagedSession = ManagedSession(self)
        self.services = ServiceGroup(self.session, self.fail)
        self.step = GlobalStep(sv.global_step, sv.owns_global_step)
        self.position = Position()
        self.kept = KeptState()
        self.kept.track("hooks", sv.hooks, [key_of(i, h) for i, h in enumerate(sv.hooks)])
        self.root = SavedRoot(sv.checkpoint, sv.global_step, self.position, self.kept)
        # Walked again only when the variables a save writes changed (the root checks
        # them at every save).
        self.makeup = Makeup(sv.checkpoint, self.position.reader.pipeline, self.root.variables_key)
        self.kept.track_one(MAKEUP_KIND, MAKEUP_KEY, self.makeup)
        save_steps = sv.save_steps if sv.checkpointing else None
        summary_steps = sv.save_summaries_steps if sv.writes_summaries else None
        averaging = sv.writes_summaries and sv.summary_fn is None
        self.summaries = SessionSummaries(
            self.events, self.step, sv.summary_fn, sv.rate_tag, averaging
        )
        # In a multi-worker job only the chief's clock decides (timed_save); see _cluster.
        timed = timed_saves and sv.checkpointing and sv.is_chief and sv.save_secs > 0
        save_secs = sv.save_secs if timed else None
        self.stepper = Stepper(
            self, self.step, sv.hooks, self.summaries, save_steps, summary_steps, save_secs
        )
        self.restore_report = RestoreReport(RestoreSource.FRESH, None, 0)
        self.stop = StopPath(
            self.flag,
            self.thread,
            self.services,
            sv.stop_grace_secs,
            self.request_stop,
            lambda: self.step.value,
            _exit.outside_signal,
            lambda: step_deadline(sv, timed_saves, self.presence.channel is not None),
            lambda: self.stepper.first_done is not None,
            in_group=sv.role is not None,
        )
        self.loopwatch = LoopWatch(
            self.caller,
            grace_secs=sv.stop_grace_secs,
            stop_asked_at=self.stop_asked_at,
            held=self._loop_held,
        )
        self.presence = Presence(self)  # the heartbeat and the ledger
        self.checkpoints = SessionCheckpoints(
            sv,
            self.thread,
            self.step,
            self.stepper,
            self.position,
            self.kept,
            self.events,
            self.session,
            self.flag,
            self.request_stop,
        )

    # -- what start-up and shutdown hand over ------------------------------------------

    def adopt(self, opened: _startup.Opened) -> None:
        self.lock, self.guard, self.checkpointer = opened.lock, opened.guard, opened.checkpointer
        self.checkpoints.opened(opened.checkpointer)

    def join(self, agreement: Agreement) -> None:
        self.agreement = agreement
        self.checkpoints.joined(agreement)
        agreement.start()

    def began(self, report: RestoreReport, deferred: tuple[str, str] | None) -> None:
        """Training thread: restored (or initialized); the state is the run's own now."""
        self.restore_report = report
        self.kept.reload()
        self.checkpoints.began(deferred)
        hooks = self.sv.hooks
        self.kept.give_back("hooks", hooks, [key_of(i, h) for i, h in enumerate(hooks)])
        if report.source is RestoreSource.CHECKPOINT:  # what changed since that commit
            self.kept.give_back(MAKEUP_KIND, [self.makeup], [MAKEUP_KEY])
        self.stepper.begin(self.step.value)
        # Every loader draws the run the history kept: the points that dead sessions
        # wrote past the restored step (or, in Keras' runs, from its epoch on) go.
        epochs = {run: self.position.epoch - 1 for run in RUNS}
        drawn_to = self.events.drop_past(self.step.value, epochs, self.thread.check_fence)
        self.events.mark_start(self.step.value + 1)  # the restored state's own point stays
        sv = self.sv
        if sv.logdir is not None and (sv.save_summaries_secs > 0 or sv.save_summaries_steps):
            # The faults, on the steps' axis, where summaries are written at all.
            session_id, source = self.presence.session_id, report.source.value
            write_story(self.events, sv.logdir, session_id, self.step.value, source, drawn_to)
        self.ready = True
        for hook in self.sv.hooks:
            hook.after_create_session(self.session)
        if report.source is not RestoreSource.CHECKPOINT and self.sv.checkpointing:
            self.checkpoints.save()  # so that init_fn's work is never lost

    # -- the one way to stop --------------------------------------------------------

    def request_stop(
        self, error: BaseException | None = None, reason: StopReason | str = StopReason.REQUESTED
    ) -> bool:
        """Every stop goes through here, from any thread (``error``: already classified;
        ``None`` is a clean stop). In a multi-worker job a clean stop is proposed to every
        worker (all stop after the same step), except a step limit, which every worker
        reaches at the same step by itself. ``False`` once the session's ending is
        decided: it takes nothing more."""
        if error is None and self.agreement is not None and reason is not StopReason.STEP_LIMIT:
            if self.thread.on_thread():
                self.propose_stop(str(reason))
            else:
                self.thread.submit(Job(self.propose_stop, (str(reason),), kind=JobKind.INTERNAL))
            return True
        return self.flag.set(error, reason)

    def report_stop(
        self, exc: BaseException | None, reason: StopReason | str = StopReason.REQUESTED
    ) -> None:
        """A stop asked for through the public API (``sess.request_stop``, ``sv.coord``):
        an error that says the data ran out is a clean stop. An error that comes after
        the session's ending was decided is raised here: nothing else would raise it."""
        if exc is not None and isinstance(exc, end_of_data_types()):
            exc, reason = None, StopReason.END_OF_DATA
        if not self.request_stop(exc, reason) and exc is not None:
            raise exc

    def fail(self, error: BaseException) -> None:
        """An error whatever its type (a failed service, a lost worker, a failed write);
        logged when it comes after the session's ending was decided."""
        if not self.flag.set(error, StopReason.EXCEPTION):
            with contextlib.suppress(Exception):
                log.warning(
                    "stop.error_dropped",
                    error=describe_error(error),
                    first=describe_error(self.flag.error),
                )

    def propose_stop(self, reason: str) -> None:
        """On the training thread, at a step boundary: every worker stops after the next step."""
        from .._cluster import DecisionKind

        if self.flag.stopped or self.agreement is None:
            return
        if not self.ready:  # not started: no step has run anywhere yet
            self.flag.set(None, reason_of(reason))
            return
        try:
            self.agreement.propose(DecisionKind.STOP, reason, self.step.value)
        except Exception as exc:
            self.fail(exc)

    def stop_asked_at(self) -> float | None:
        """When a stop was first asked for (monotonic): the stop flag's, or a stop signal's
        that the held loop has not taken yet; ``None`` if none was."""
        found = [self.flag.stopped_at]
        if self.signals is not None:
            found.append(self.signals.first_at)
        return min((at for at in found if at is not None), default=None)

    def _loop_held(self, held_by: str, where: str, stack: str) -> None:
        """The loop watch's thread: the loop is held past the stop's grace."""
        from .held import end_held

        end_held(self, held_by, where, stack)

    def check_not_stopped(self, what: str) -> None:
        if self.flag.stopped:
            raise SessionStopped(
                f"{what}() was called after the session was asked to stop "
                f"(reason: {self.flag.reason}); check sess.should_stop() in the loop"
            )

    def job_failed(self, exc: BaseException) -> BaseException:
        """Training thread: what a user's job (a step, its hooks, a call, fit) raised,
        classified here, once, by where it came from: the user's code ran out of data
        (``StopIteration``, TF's ``OutOfRangeError``), unless events could not be
        written (a full disk reports ``OutOfRangeError`` too: ``EventsFile.failed``).
        Any other error goes to the waiter as it is, the same object: the body decides.
        Returns what the waiter gets: a ``StopIteration`` cannot cross into a coroutine
        (PEP 479), so it arrives as TF's end-of-data error."""
        if isinstance(exc, SessionClosed) or not isinstance(exc, end_of_data_types()):
            return exc
        if self.events.failed(exc):
            self.fail(exc)  # a write failed: not the end of the data
            return exc
        self.request_stop(None, StopReason.END_OF_DATA)
        return end_of_data_error(exc)

    def user_job(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Training thread: the user's function, its errors classified (``job_failed``)."""
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            replacement = self.job_failed(exc)
            if replacement is exc:
                raise
            raise replacement from exc

    # -- what steps ask of the session -------------------------------------------------

    def recoverable(self, exc: BaseException) -> bool:
        return isinstance(exc, self.sv.recoverable_errors)

    def after_step(self) -> None:
        """Training thread, after each step: finished background saves, agreed decisions."""
        checkpointer = self.checkpointer
        if checkpointer is not None and checkpointer.writer.completed:
            self.checkpoints.saves_done(hooks=True)
        agreement = self.agreement
        if agreement is not None and agreement.pending:
            from .._cluster import DecisionKind  # here: an import statement costs every step

            for decision in agreement.due(self.step.value):
                log.info(
                    "cluster.agreed",
                    step=decision.step,
                    kind=decision.kind.value,
                    reason=decision.reason,
                    proposed_by=decision.proposer,
                )
                if decision.kind is DecisionKind.SAVE:
                    self.checkpoints.save()
                else:  # the library's own reason is its member again after the JSON trip
                    self.flag.set(None, reason_of(decision.reason))

    # -- how it ended ----------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.stop.phase

    @property
    def outcome(self) -> Outcome | None:
        """How the session ended (``None`` until it has closed)."""
        ending = self.stop.ending
        return ending.outcome if ending is not None and self.phase is Phase.CLOSED else None

    # -- the session's life -----------------------------------------------------------

    @asynccontextmanager
    async def running(
        self, wait: bool, max_wait_secs: float, services: list[Registration]
    ) -> AsyncIterator[Any]:
        stop = self.stop
        self.thread.start()
        self.loopwatch.start()
        self.presence.start()
        if self.sv.handle_signals:
            self.signals = SignalListener(
                self.caller, stop.signalled, stop.interrupt, self.sv.stop_signals
            )
            if not self.signals.install():
                log.info("signals.not_handled", reason="the session is not in the main thread")
        try:
            self.restore_report = await _startup.start(self, wait, max_wait_secs)
            self.presence.started(self.restore_report, self.makeup.changed)
            async with anyio.create_task_group() as tg:
                stop.cancels(tg.cancel_scope)
                self.services.open()
                for reg in services:
                    self.start_service(reg)
                stop.move(Phase.RUNNING)
                try:
                    with anyio.CancelScope() as body:
                        stop.cancels(body)
                        self.flag.bind(self.caller, body.cancel)
                        tg.start_soon(stop.watch_grace, body, name="grace-watcher")
                        yield self.session
                except BaseException as exc:  # the body's own error, or an outside cancellation
                    stop.body_raised(exc)
                with anyio.CancelScope(shield=True) as stopping:
                    stop.cancels(stopping)
                    if not stop.interrupted:
                        started = self.restore_report.source is not RestoreSource.INTERRUPTED
                        await stop.stop(started=started, ready=self.ready, finish=self._finish)
                tg.cancel_scope.cancel()
        except BaseException as exc:
            if stop.phase is not Phase.STARTING:
                raise
            stop.start_failed(exc)  # start-up failed or was cancelled: that is the outcome
        finally:
            with anyio.CancelScope(shield=True):
                await stop.close_services()
                await _shutdown.close(self)
        _shutdown.raise_outcome(self)

    def start_service(self, reg: Registration) -> None:
        """A service starts (with its state given back, if it keeps one)."""
        key = f"service:{reg.name}"
        self.kept.give_back("services", [reg.service], [key])
        self.kept.track_one("services", key, reg.service)
        self.services.start(reg)

    async def _finish(self) -> None:
        """After a clean stop: the hooks' end and the final save on the training thread
        (the stop path bounds it by the grace); in a multi-worker job every worker
        finishes together."""
        try:
            await self.thread.run_job(Job(self._finish_on_thread, kind=JobKind.INTERNAL))
        except Exception as exc:
            self.fail(exc)
        agreement = self.agreement
        if agreement is not None and self.flag.error is None:
            agreement.finishing()
            await anyio.to_thread.run_sync(agreement.finish_together, max(self.stop.left(), 1.0))

    def _finish_on_thread(self) -> None:
        for hook in self.sv.hooks:
            hook.end(self.session)
        if self.sv.checkpointing:
            self.checkpoints.save(final=True)
        if self.checkpointer is not None:
            self.checkpointer.wait_for_write()  # the final save is on disk when we return
            self.after_step()

    def save_final(self) -> None:
        """Training thread, beside an event loop held past the grace (``held.py``): the
        final checkpoint, on disk when it returns; no hook runs (their ``end`` belongs
        to a stop that the loop could run)."""
        self.checkpoints.save(final=True)
        if self.checkpointer is not None:
            self.checkpointer.wait_for_write()
            self.checkpoints.saves_done(hooks=False)
