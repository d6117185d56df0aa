"""SessionRuntime: the one owner of everything that lives for one session.

The training thread, the stop flag, the cancel scopes, the events file, the
checkpointer, the logdir lock, the cluster agreement and the hooks' calls
belong to one runtime; nothing of a session outlives it or acts on a later one.
The stop path is the state machine in ``_stopping`` (drawn in
``docs/ARCHITECTURE.md``); ``request_stop`` is its one entry.

Start-up (open the logdir, restore) is in ``_startup``; this module runs the
body beside the services and takes the session down.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from . import _shutdown, _startup
from ._checkpoints import Checkpointer, RestoreReport
from ._errors import CheckpointMismatchError, SessionStopped
from ._lock import LeaseLock, LogdirLock, WriteGuard
from ._log import log
from ._services import Registration, ServiceGroup
from ._signals import SignalListener
from ._steps import GlobalStep, Stepper
from ._stopping import Phase, StopFlag, end_of_data_error, is_end_of_data
from ._summaries import EventsFile, scalars
from ._verify import unrestored
from ._worker import Fenced, Job, TrainingThread, loop_caller

if TYPE_CHECKING:
    from ._cluster import Agreement
    from ._coordinator import Coordinator
    from ._session import ManagedSession
    from ._supervisor import Supervisor

POLL_SECS = 0.05  # how often the grace watcher looks at the job in flight


class SessionRuntime:
    """Runs one session of a Supervisor from entry to exit."""

    def __init__(self, sv: Supervisor, coord: Coordinator, flag: StopFlag) -> None:
        from ._session import ManagedSession

        self.sv = sv  # configuration only: read, never written
        self.coord, self.flag = coord, flag
        self.phase = Phase.STARTING
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
        self.late_signals: list[int] = []  # came while stopping: handed on afterwards
        self.interrupted = False  # a second SIGINT: stop at once
        self.cancelled: BaseException | None = None  # cancellation from outside the session
        self.stuck: str | None = None  # the work still running after the grace period
        self.ready = False  # restored (or initialized): the state is the run's own
        self.deferred: tuple[str, str] | None = None  # (checkpoint, a value not taken yet)
        self.scopes: list[anyio.CancelScope] = []  # what a hard stop cancels
        self.services = ServiceGroup()
        self.step = GlobalStep(sv.global_step, sv.owns_global_step)
        self.position = sv.position
        save_steps = sv.save_model_steps if sv.checkpointing else None
        summary_steps = sv.save_summaries_steps if sv.writes_summaries else None
        averaging = sv.writes_summaries and sv.summary_fn is None
        self.stepper = Stepper(self, self.step, sv.hooks, save_steps, summary_steps, averaging)
        self.rate_mark: tuple[int, float] | None = None  # (step, time) rates count from
        self.rate_origin: tuple[int, float] | None = None  # when the first step ended
        self.restore_report = RestoreReport("fresh", None, 0)
        self.drain_started: float | None = None
        self.session: ManagedSession = ManagedSession(self)

    # -- the one way to stop --------------------------------------------------------

    def request_stop(
        self,
        exc: BaseException | None = None,
        reason: str = "requested",
        *,
        failure: bool = False,
    ) -> None:
        """Every stop goes through here, from any thread. In a multi-worker job a clean
        stop is proposed to every worker (all stop after the same step), except a step
        limit, which every worker reaches at the same step by itself."""
        if exc is None and self.agreement is not None and reason != "step_limit":
            if self.thread.on_thread():
                self.propose_stop(reason)
            else:
                self.thread.submit(Job(self.propose_stop, (reason,), kind="internal"))
            return
        self.flag.set(exc, reason, failure=failure)

    def propose_stop(self, reason: str) -> None:
        """On the training thread, at a step boundary: every worker stops after the next step."""
        if self.flag.stopped or self.agreement is None:
            return
        if not self.ready:  # not started: no step has run anywhere yet
            self.flag.set(None, reason)
            return
        try:
            self.agreement.propose("stop", reason, self.step.value)
        except Exception as exc:
            self.flag.set(exc, "requested")

    def check_open(self) -> None:
        """On the training thread: raise ``Fenced`` once the session has closed."""
        if self.thread.closed:
            raise Fenced("the session has closed")

    def check_not_stopped(self, what: str) -> None:
        if self.flag.stopped:
            raise SessionStopped(
                f"{what}() was called after the session was asked to stop "
                f"(reason: {self.flag.reason}); check sess.should_stop() in the loop"
            )

    def step_failed(self, exc: BaseException) -> BaseException:
        """Training thread: classify what a step (or its hooks) raised, once, here.

        End of data stops the session cleanly. Any other error goes to the waiter
        as it is, the same object: the body decides (uncaught, it stops the session).
        Returns what the waiter gets: a ``StopIteration`` cannot cross into a
        coroutine (PEP 479), so it arrives as TF's end-of-data error."""
        if isinstance(exc, Exception) and not isinstance(exc, Fenced) and is_end_of_data(exc):
            self.request_stop(None, "end_of_data")
            return end_of_data_error(exc)
        return exc

    # -- what steps ask of the session -------------------------------------------------

    def recoverable(self, exc: BaseException) -> bool:
        return isinstance(exc, self.sv.recoverable_errors)

    def recover(self, exc: BaseException) -> None:
        _startup.recover(self, exc)

    def save(self, *, final: bool = False) -> str | None:
        """Training thread: save at the current step; hooks' after_save may ask to stop.

        With ``async_checkpoint`` the files are written in the background and the
        hooks run at the first step boundary after they are on disk.
        """
        checkpointer = self.checkpointer
        if checkpointer is None or not self.ready or not self.sv.checkpointing:
            return None
        self.check_open()
        self.step.flush()
        stepper, step = self.stepper, self.step.value
        self.position.sync()
        forced = stepper.steps_since_save > 0 and step == checkpointer.last_saved_step
        path = checkpointer.save(step, force=forced, final=final)
        stepper.steps_since_save = 0 if checkpointer.last_saved_step == step else 1
        if path is not None:
            self.call_after_save(step, path)
        return path

    def timed_save(self) -> None:
        """Training thread: a save request. In a multi-worker job only the chief's timer
        runs, and every worker saves after the next step."""
        if self.agreement is None:
            self.save()
        elif not self.flag.stopped:
            self.agreement.propose("save", "timer", self.step.value)

    def call_after_save(self, step: int, path: str) -> None:
        for hook in self.sv.hooks:
            if hook.after_save(self.session, step, path):
                self.request_stop(None, "requested")

    def step_summaries(self) -> None:
        """Training thread, every ``save_summaries_steps``: ``summary_fn``'s values and the
        steps per second since the last time (from the first step: tracing is not speed)."""
        fn = self.sv.summary_fn
        values = dict(fn()) if fn is not None else self.step_means()
        step, now = self.step.value, time.monotonic()
        mark = self.rate_mark
        if mark is not None and step > mark[0] and now > mark[1]:
            values[self.sv.rate_tag] = (step - mark[0]) / (now - mark[1])
        self.rate_mark = (step, now)
        if values:
            self.events.write(values, step, self.sv.global_step)

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
        left = unrestored(self.checkpointer.restore_status)
        self.checkpointer.restore_status = None
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
        checkpointer = self.checkpointer
        if checkpointer is not None and checkpointer.completed:
            while checkpointer.completed:
                self.call_after_save(*checkpointer.completed.popleft())
        agreement = self.agreement
        if agreement is not None and agreement.pending:
            for decision in agreement.due(self.step.value):
                log.info(
                    "cluster.agreed",
                    step=decision.step,
                    kind=decision.kind,
                    reason=decision.reason,
                    proposed_by=decision.proposer,
                )
                if decision.kind == "save":
                    self.save()
                elif decision.kind == "stop":
                    self.flag.set(None, decision.reason)

    # -- the session's life -----------------------------------------------------------

    @asynccontextmanager
    async def running(
        self, wait: bool, max_wait_secs: float, services: list[Registration]
    ) -> AsyncIterator[Any]:
        self.thread.start()
        if self.sv.handle_signals:
            self.signals = SignalListener(self.caller, self._on_signal, self._on_interrupt)
            if not self.signals.install():
                log.info("signals.not_handled", reason="the session is not in the main thread")
        try:
            await _startup.start(self, wait, max_wait_secs)
            async with anyio.create_task_group() as tg:
                self.scopes.append(tg.cancel_scope)
                self.services.attach(tg, self.session, self._service_failed)
                for reg in services:
                    self.services.start(reg)
                self.phase = Phase.RUNNING
                try:
                    with anyio.CancelScope() as body:
                        self.scopes.append(body)
                        self.flag.bind(self.caller, body.cancel)
                        tg.start_soon(self._watch_grace, body, name="grace-watcher")
                        yield self.session
                except BaseException as exc:  # the body's own error, or an outside cancellation
                    self._body_raised(exc)
                with anyio.CancelScope(shield=True) as stopping:
                    self.scopes.append(stopping)
                    if not self.interrupted:
                        await self._stop()
                tg.cancel_scope.cancel()
        except BaseException as exc:
            if self.phase is not Phase.STARTING:
                raise
            if isinstance(exc, Exception):  # start-up failed: that is the outcome
                self.flag.set(exc, "requested", failure=True)
            else:
                self.cancelled = exc
        finally:
            with anyio.CancelScope(shield=True):
                await _shutdown.close(self)
        _shutdown.raise_outcome(self)

    def _service_failed(self, exc: BaseException) -> None:
        self.flag.set(exc, "requested", failure=True)

    # -- signals --------------------------------------------------------------------

    def _on_signal(self, name: str) -> None:
        """On the loop: SIGTERM or a first SIGINT asks for a graceful stop. The stop is
        requested before anything that can fail (a log call into a closed pipe)."""
        if self.flag.stopped and self.phase is not Phase.RUNNING:
            import signal

            self.late_signals.append(signal.Signals[name].value)
            return
        self.request_stop(None, "signal")
        with contextlib.suppress(Exception):
            log.warning("signal.received", signal=name, action="graceful stop")

    def _on_interrupt(self, name: str) -> None:
        """On the loop: a second SIGINT stops at once; no final save, nothing awaited."""
        self.interrupted = True
        self.flag.set(None, "signal")
        for scope in self.scopes:
            scope.cancel()
        with contextlib.suppress(Exception):
            log.warning("signal.received", signal=name, action="stop at once")

    # -- stop -----------------------------------------------------------------------

    def _body_raised(self, exc: BaseException) -> None:
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            # Our own cancellation of the body never gets here (its scope absorbs it).
            self.cancelled = exc
            self.flag.set(None, "requested")
        elif isinstance(exc, SessionStopped):
            self.flag.set(None, "requested")  # a loop ended by the stop: clean
        elif isinstance(exc, Exception):
            self.flag.set(exc, "requested")
        else:  # KeyboardInterrupt, SystemExit: not ours to swallow
            self.cancelled = exc
            self.flag.set(None, "requested")

    def grace_left(self) -> float:
        """Seconds left of the grace period, which began when draining began."""
        started = self.drain_started
        grace = self.sv.stop_grace_secs
        return grace if started is None else max(0.0, started + grace - time.monotonic())

    def _report_stuck(self, name: str) -> None:
        self.stuck = name
        log.error(
            "session.step_stuck",
            step=self.step.value,
            job=name,
            grace_secs=self.sv.stop_grace_secs,
        )

    async def _watch_grace(self, body: anyio.CancelScope) -> None:
        """While the body runs: work on the training thread that was under way (or queued)
        when the stop came gets ``stop_grace_secs`` from then, or is given up on. Work the
        body starts after the stop is the body's own business."""
        await self.flag.wait()
        stopped_at = self.flag.stopped_at or time.monotonic()
        grace = self.sv.stop_grace_secs
        while self.phase is Phase.RUNNING and not body.cancel_called:
            flight = self.thread.in_flight()
            if flight is not None:
                job, started = flight
                if job.kind != "hold" and job.submitted_at <= stopped_at:
                    if time.monotonic() - max(started, stopped_at) >= grace:
                        self._report_stuck(job.name)
                        body.cancel()
                        return
            await anyio.sleep(min(POLL_SECS, max(grace / 4, 0.005)))

    async def _drain(self) -> bool:
        """Wait, at most the grace period, until the training thread is idle."""
        if self.stuck is not None:
            return False
        if self.thread.idle():
            return True
        with anyio.move_on_after(self.grace_left()):
            await self.thread.run_job(Job(_nothing, kind="internal"))
            return True
        flight = self.thread.in_flight()
        self._report_stuck(flight[0].name if flight else "a training-thread job")
        return False

    async def _stop(self) -> None:
        self.flag.set(None, "requested")
        self.phase, self.drain_started = Phase.DRAINING, time.monotonic()
        # A stop during start-up: nothing has trained, so nothing is waited for or saved.
        started = self.restore_report.source != "interrupted"
        idle = started and await self._drain()
        clean = self.cancelled is None and self.flag.error is None
        if idle and clean and self.ready:
            self.phase = Phase.FINISHING
            await self._finish()
        self.phase = Phase.CLOSING
        with anyio.move_on_after(self.grace_left()) as services:
            await self.services.wait()
        if services.cancelled_caught:
            log.warning(
                "service.cancelled",
                running=self.services.running,
                grace_secs=self.sv.stop_grace_secs,
            )

    async def _finish(self) -> None:
        """After a clean stop: hooks' end and the final save, bounded by the grace period
        (0: not bounded; the in-flight work was not waited for, the final save is)."""
        grace = self.sv.stop_grace_secs
        with anyio.move_on_after(grace if grace > 0 else None) as timer:
            try:
                await self.thread.run_job(Job(self._finish_on_thread, kind="internal"))
            except Exception as exc:
                self.flag.set(exc, "requested", failure=True)
            if self.agreement is not None and self.flag.error is None:
                self.agreement.stopping = True
                await anyio.to_thread.run_sync(
                    self.agreement.finish_together, max(self.grace_left(), 1.0)
                )
        if timer.cancelled_caught:
            self._report_stuck("the hooks' end and the final checkpoint")

    def _finish_on_thread(self) -> None:
        for hook in self.sv.hooks:
            hook.end(self.session)
        self.save(final=True)
        if self.checkpointer is not None:
            self.checkpointer.wait_for_write()  # the final save is on disk when we return
            self.after_step()


def _nothing() -> None:
    return None
