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
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from .. import _exit
from .._checkpointing.checkpointer import Checkpointer, RestoreReport
from .._checkpointing.root import SavedRoot
from .._errors import CheckpointMismatchError, DivergedError, SessionClosed, SessionStopped
from .._kinds import JobKind, Phase, RestoreSource
from .._log import log
from .._logdir.lock import LeaseLock, LogdirLock, WriteGuard
from .._logdir.records import Record, finite_numbers
from .._logdir.verify import unrestored
from .._outcome import Outcome, StopReason, reason_of
from .._training.divergence import LossWatch, loss_of
from .._training.kept_state import KeptState, key_of
from .._training.position import Position
from .._training.steps import GlobalStep, Stepper
from .._training.summaries import EventsFile, scalars
from .._training.thread import Job, TrainingThread, loop_caller
from . import shutdown as _shutdown
from . import startup as _startup
from .loopwatch import LoopWatch
from .presence import Presence
from .services import Registration, ServiceGroup
from .signals import SignalListener
from .stoppath import StopPath
from .stopping import describe_error, end_of_data_error, end_of_data_types

if TYPE_CHECKING:
    from .._cluster import Agreement
    from .._supervisor import Supervisor
    from .coordinator import Coordinator
    from .managed import ManagedSession


class SessionRuntime:
    """Runs one session of a Supervisor from entry to exit."""

    def __init__(self, sv: Supervisor, coord: Coordinator) -> None:
        from .managed import ManagedSession

        self.sv = sv  # configuration only: read, never written
        self.coord = coord
        self.flag = coord._open_session(self.report_stop)
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
        self.deferred: tuple[str, str] | None = None  # (checkpoint, a value not taken yet)
        self.session: ManagedSession = ManagedSession(self)
        self.services = ServiceGroup(self.session, self.fail)
        self.step = GlobalStep(sv.global_step, sv.owns_global_step)
        self.position = Position()
        self.kept = KeptState()
        self.kept.track("hooks", sv.hooks, [key_of(i, h) for i, h in enumerate(sv.hooks)])
        self.root = SavedRoot(sv.checkpoint, sv.global_step, self.position, self.kept)
        save_steps = sv.save_model_steps if sv.checkpointing else None
        summary_steps = sv.save_summaries_steps if sv.writes_summaries else None
        averaging = sv.writes_summaries and sv.summary_fn is None
        self.stepper = Stepper(self, self.step, sv.hooks, save_steps, summary_steps, averaging)
        self.restore_report = RestoreReport(RestoreSource.FRESH, None, 0)
        self.stop = StopPath(
            self.flag,
            self.thread,
            self.services,
            sv.stop_grace_secs,
            self.request_stop,
            lambda: self.step.value,
            _exit.outside_signal,
        )
        self.loopwatch = LoopWatch(self.caller)
        policy = sv.on_divergence
        self.losses: LossWatch | None = None if policy is None else LossWatch(policy)
        self._no_writer_warned = False
        self.rollback_history: list[str] = []
        self.presence = Presence(self)  # the heartbeat and the ledger

    # -- what start-up and shutdown hand over ------------------------------------------

    def adopt(self, opened: _startup.Opened) -> None:
        self.lock, self.guard, self.checkpointer = opened.lock, opened.guard, opened.checkpointer

    def join(self, agreement: Agreement) -> None:
        self.agreement = agreement
        agreement.start()

    def began(self, report: RestoreReport, deferred: tuple[str, str] | None) -> None:
        """Training thread: restored (or initialized); the state is the run's own now."""
        self.restore_report, self.deferred = report, deferred
        self.kept.reload()
        hooks = self.sv.hooks
        self.kept.give_back("hooks", hooks, [key_of(i, h) for i, h in enumerate(hooks)])
        self.stepper.begin(self.step.value)
        self.events.mark_start(self.step.value + 1)  # the restored state's own point stays
        self.ready = True
        for hook in self.sv.hooks:
            hook.after_create_session(self.session)
        if report.source is not RestoreSource.CHECKPOINT and self.sv.checkpointing:
            self.save()  # so that init_fn's work is never lost

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

    def check_not_stopped(self, what: str) -> None:
        if self.flag.stopped:
            raise SessionStopped(
                f"{what}() was called after the session was asked to stop "
                f"(reason: {self.flag.reason}); check sess.should_stop() in the loop"
            )

    def job_failed(self, exc: BaseException) -> BaseException:
        """Training thread: what a user's job (a step, its hooks, a call, fit) raised,
        classified here, once, by where it came from: the user's code ran out of data
        (``StopIteration``, TF's ``OutOfRangeError``), unless the session's own events
        file fails (a full disk reports ``OutOfRangeError`` too). Any other error goes to
        the waiter as it is, the same object: the body decides. Returns what the waiter
        gets: a ``StopIteration`` cannot cross into a coroutine (PEP 479), so it arrives
        as TF's end-of-data error."""
        if isinstance(exc, SessionClosed) or not isinstance(exc, end_of_data_types()):
            return exc
        if not self.events.writable():
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

    def recover(self, exc: BaseException) -> None:
        """Training thread, after a recoverable error: restore the newest good checkpoint,
        so that the failed step's partial writes are gone (and the data goes back with
        it, inside ``train(epochs=)`` and ``fit``), and let the step run again."""
        checkpointer, stepper = self.checkpointer, self.stepper
        if self.agreement is not None:
            # A collective failed: a worker is gone. Retrying alone cannot help; the
            # job stops, and its restart resumes from the last checkpoint.
            log.error("cluster.step_failed", error=f"{type(exc).__name__}: {_cause_line(exc)}")
            raise exc
        if checkpointer is None or stepper.recoveries >= self.sv.max_recoveries:
            raise exc
        checkpointer.wait_for_write()
        path, _ = checkpointer.restore_newest()
        if path is None:
            raise exc
        checkpointer.restored(path)
        self.step.reload()
        self.position.reload()
        self.kept.reload()
        stepper.recovered()
        self.events.mark_start(self.step.value + 1)
        log.warning(
            "step.recovered",
            error=f"{type(exc).__name__}: {exc}",
            restored_step=self.step.value,
            path=path,
            attempt=stepper.recoveries,
            max_recoveries=self.sv.max_recoveries,
        )

    def save(self, *, final: bool = False, metrics: Mapping[str, Any] | None = None) -> str | None:
        """Training thread: save at the current step; hooks' after_save may ask to stop.
        Returns the path written (``None``: nothing to save, or a background write).

        With ``async_checkpoint`` the files are written in the background and the
        hooks run at the first step boundary after they are on disk.
        """
        checkpointer = self.checkpointer
        if checkpointer is None or not self.ready:
            return None
        self.thread.check_fence()
        self.step.flush()
        stepper, step = self.stepper, self.step.value
        record = self._record(step, metrics)
        if self.losses is not None and not record.healthy:
            log.warning("checkpoint.skipped", step=step, reason="the loss is not finite")
            return None  # with rollbacks on, state that diverged is never committed
        self.position.sync()
        self.kept.sync()
        runs = stepper.steps_run
        forced = stepper.unsaved > 0 and step == checkpointer.last_saved_step
        path = checkpointer.save(step, force=forced, final=final, tag=runs, record=record)
        if path is not None:
            stepper.state_saved(runs)
            self.call_after_save(step, path)
        return path

    def _record(self, step: int, metrics: Mapping[str, Any] | None) -> Record:
        """What a commit records beside the checkpoint: the last step's numbers (and the
        ones given), and whether its loss was finite."""
        last = scalars(self.stepper.last_result)
        loss = last.get("loss")
        healthy = loss is None or math.isfinite(loss)
        return Record(step, time.time(), finite_numbers({**last, **(metrics or {})}), healthy)

    def check_divergence(self, result: Any) -> bool:
        """Training thread, after a step: ``True`` when its loss diverged and the run was
        rolled back (see ``_divergence``); raises ``DivergedError`` after too many."""
        watch = self.losses
        if watch is None:
            return False
        loss = loss_of(result)
        reason = None if loss is None else watch.diverges(loss)
        if reason is None:
            return False
        self._roll_back(reason, loss)
        return True

    def _roll_back(self, reason: str, loss: float | None) -> None:
        policy, watch, checkpointer = self.sv.on_divergence, self.losses, self.checkpointer
        assert policy is not None and watch is not None
        diverged, where = self.step.value, (self.position.epoch, self.position.batch)
        log.warning("step.diverged", step=diverged, loss=loss, reason=reason)
        what = f"the loss diverged ({reason}: {loss}) at step {diverged}"
        if watch.rollbacks >= policy.max_rollbacks:
            raise DivergedError(
                f"{what}, after {watch.rollbacks} rollbacks (max_rollbacks="
                f"{policy.max_rollbacks}): stopped; {self.rollback_history or 'none'}"
            )
        path = None
        if checkpointer is not None:
            checkpointer.wait_for_write()
            self.saves_done(hooks=False)
            path = checkpointer.healthy_at_or_before(diverged - policy.lookback)
        if checkpointer is None or path is None:
            raise DivergedError(f"{what}, and no healthy checkpoint is there to roll back to")
        checkpointer.restore(path)
        checkpointer.restored(path)
        self.step.reload()
        self.position.reload()
        self.kept.reload()
        if self.position.counts():  # past the batch that diverged, and `skip` more
            self.position.go_to(where[0], where[1] + policy.skip)
        self.stepper.recovered()
        watch.rolled_back()
        restored = self.step.value
        self.rollback_history.append(f"step {diverged} -> {os.path.basename(path)}")
        self.events.mark_start(restored + 1)
        self.events.write({"rollback/diverged_at_step": float(diverged)}, restored + 1)
        log.warning(
            "checkpoint.rolled_back",
            path=path,
            step=restored,
            diverged_at=diverged,
            data_position=[self.position.epoch, self.position.batch],
            rollbacks=watch.rollbacks,
        )

    def explicit_save(self, metrics: Mapping[str, Any] | None = None) -> str | None:
        """Training thread: ``sess.save_checkpoint()``: a checkpoint of this step boundary,
        written now (or the one already holding it); its path. In a multi-worker job every
        worker saves after the next step: ``None``."""
        checkpointer = self.checkpointer
        if checkpointer is None or not (self.sv.is_chief or self.sv.role is not None):
            log.info("checkpoint.not_saved", reason="this process writes no checkpoints")
            return None
        if self.agreement is not None:
            self.timed_save()
            return None
        path = self.save(metrics=metrics) or checkpointer.writing  # a background write: its path
        if path is None and checkpointer.last_saved_step == self.step.value:
            path = checkpointer.latest_committed()  # nothing changed since it was written
        return path

    def timed_save(self) -> None:
        """Training thread: a save request. In a multi-worker job only the chief's timer
        runs, and every worker saves after the next step."""
        from .._cluster import DecisionKind

        if self.agreement is None:
            self.save()
        elif not self.flag.stopped:
            self.agreement.propose(DecisionKind.SAVE, "timer", self.step.value)

    def call_after_save(self, step: int, path: str) -> None:
        for hook in self.sv.hooks:
            if hook.after_save(self.session, step, path):
                self.request_stop(None, StopReason.REQUESTED)

    def step_summaries(self) -> None:
        """Training thread, every ``save_summaries_steps``: ``summary_fn``'s values and the
        steps per second since the last time (from the first step: tracing is not speed)."""
        fn = self.sv.summary_fn
        values = dict(fn()) if fn is not None else self.step_means()
        step = self.step.value
        rate = self.stepper.take_rate(step, time.monotonic())
        if rate is not None:
            values[self.sv.rate_tag] = rate
        if values:
            self.events.write(values, step)

    def epoch_summaries(self, logs: dict[str, Any]) -> None:
        """Training thread, at the end of a ``fit`` epoch: its logs (validation included)
        as ``epoch/<name>`` at the step the epoch ended on."""
        if self.events.writer is not None:
            values = {f"epoch/{k}": v for k, v in scalars(logs).items()}
            if values:
                self.events.write(values, self.step.value)

    def write_summary(self, values: dict[str, Any], step: int | None) -> None:
        """``sess.summary_computed``: into the events file, or a warning (once) that this
        session writes none."""
        if self.events.writer is None:
            if not self._no_writer_warned:
                self._no_writer_warned = True
                log.warning("summary.disabled", tags=sorted(values))
            return
        self.events.write(values, self.step.value if step is None else step)

    def step_means(self) -> dict[str, float]:
        """Training thread: the steps' numeric results averaged since the last call
        (``fit``: Keras' logs as they are, already the epoch's running means)."""
        return self.stepper.means.take() or scalars(self.stepper.last_result)

    def check_deferred(self) -> None:
        """Training thread, after the first step: every restored value has been taken, or
        the restore was not what it said (an unbuilt model made new variables)."""
        if self.deferred is None or self.checkpointer is None:
            return
        (path, _), self.deferred = self.deferred, None
        left = unrestored(self.checkpointer.take_restore_status())
        if left is not None:
            raise CheckpointMismatchError(
                f"checkpoint {path} was not fully restored: after the first step no object "
                f"has taken {left} (and perhaps more). An object that is not built when the "
                "session starts is restored deferred, and a Keras 3 model built later makes "
                "new variables instead. Build the model before the session starts (call it "
                "on one batch, or model.build(input_shape)); an optimizer may stay unbuilt."
            )

    def after_step(self) -> None:
        """Training thread, after each step: finished background saves, agreed decisions."""
        from .._cluster import DecisionKind

        checkpointer = self.checkpointer
        if checkpointer is not None and checkpointer.completed:
            self.saves_done(hooks=True)
        agreement = self.agreement
        if agreement is not None and agreement.pending:
            for decision in agreement.due(self.step.value):
                log.info(
                    "cluster.agreed",
                    step=decision.step,
                    kind=decision.kind.value,
                    reason=decision.reason,
                    proposed_by=decision.proposer,
                )
                if decision.kind is DecisionKind.SAVE:
                    self.save()
                else:  # the library's own reason is its member again after the JSON trip
                    self.flag.set(None, reason_of(decision.reason))

    def saves_done(self, *, hooks: bool) -> None:
        """Background saves whose files are on disk: their steps no longer count as
        unsaved; at a step boundary, the hooks' ``after_save`` runs for each."""
        checkpointer = self.checkpointer
        while checkpointer is not None and checkpointer.completed:
            step, path, runs = checkpointer.completed.popleft()
            self.stepper.state_saved(runs)
            if hooks:
                self.call_after_save(step, path)

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
            self.presence.started(self.restore_report)
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
            self.save(final=True)
        if self.checkpointer is not None:
            self.checkpointer.wait_for_write()  # the final save is on disk when we return
            self.after_step()


def _cause_line(exc: BaseException) -> str:
    """The line of a collective's error that says what happened (TF's message is
    mostly a graph traceback): ``Collective ops is aborted by: Socket closed``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "aborted by" in line or "Connection reset" in line:
            return line[:300]
    return (lines[0] if lines else "")[:300]
