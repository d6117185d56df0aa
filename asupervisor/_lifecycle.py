"""The life of one session: start, run the body beside the services, stop.

Stopping, in order: a stop is requested; the in-flight step is awaited (at most
``stop_grace_secs``); on a clean stop the hooks' ``end`` runs and the final
checkpoint is written; services get what is left of the grace period, then are
cancelled; the events file is closed; the first error is re-raised unchanged.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from ._checkpoints import LogdirLock, RestoreReport, remove_unfinished
from ._cluster import Agreement
from ._errors import GracePeriodExpired, StepTimeout, WaitTimeout
from ._log import log
from ._session import GlobalStep, ManagedSession
from ._signals import SignalHandlers
from ._worker import Job, TrainingThread, loop_caller

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from ._supervisor import Supervisor


class Lifecycle:
    """Runs one session of a Supervisor from entry to exit."""

    def __init__(self, sv: Supervisor) -> None:
        self.sv = sv
        self.coord = sv.coord
        self.caller = loop_caller()
        self.worker = TrainingThread(self.caller)
        self.stuck: str | None = None  # the step still running after the grace period
        self.cancelled: BaseException | None = None  # cancellation from outside the session
        self.lock: LogdirLock | None = None
        self.signals: SignalHandlers | None = None
        self.interrupted = False  # a second SIGINT: stop at once
        self.scopes: list[anyio.CancelScope] = []  # what a hard stop cancels
        self.agreement: Agreement | None = None  # in a multi-worker job
        self.sess: ManagedSession | None = None

    @asynccontextmanager
    async def running(
        self, wait_for_checkpoint: bool, max_wait_secs: float, standard_services: bool
    ) -> AsyncIterator[ManagedSession]:
        self.coord.clear_stop()
        self.worker.start()
        if self.sv.handle_signals:
            self.signals = SignalHandlers(self.caller, self._on_signal, self._on_interrupt)
            self.signals.install()
        try:
            sess = await self._start(wait_for_checkpoint, max_wait_secs)
            async with anyio.create_task_group() as tg:
                self.scopes.append(tg.cancel_scope)
                self._start_services(sess, tg, standard_services)
                try:
                    with anyio.CancelScope() as body:
                        self.scopes.append(body)
                        self.coord._bind(self.caller, body.cancel)
                        tg.start_soon(self._watch_grace, sess, body, name="grace-watcher")
                        yield sess
                except BaseException as exc:  # the body's own error, or an outside cancellation
                    self._body_raised(exc)
                with anyio.CancelScope(shield=True) as stopping:
                    self.scopes.append(stopping)
                    if not self.interrupted:
                        await self._stop(sess)
                tg.cancel_scope.cancel()
        finally:
            self._close()
        self._raise_outcome()

    # -- signals --------------------------------------------------------------

    def _on_signal(self, name: str) -> None:
        """On the loop: SIGTERM or a first SIGINT asks for a graceful stop.

        In a multi-worker job this worker cannot stop alone (the others would wait
        for it in the next collective): the stop is proposed to every worker.
        """
        log.warning("signal.received", signal=name, action="graceful stop")
        if self.agreement is not None:
            self.worker.submit(Job(self._propose_stop, ("signal",)))
        else:
            self.coord._request(None, "signal")

    def _propose_stop(self, reason: str) -> None:
        """On the training thread, at a step boundary: every worker stops after the next step."""
        sess, agreement = self.sess, self.agreement
        if self.coord.should_stop() or agreement is None:
            return
        if sess is None:  # not started: no step has run anywhere yet
            self.coord._request(None, reason)
            return
        try:
            agreement.propose("stop", reason, sess._step_var.value)
        except Exception as exc:
            self.coord.request_stop(exc)

    def _on_interrupt(self, name: str) -> None:
        """On the loop: a second SIGINT stops at once; no final save, nothing awaited."""
        log.warning("signal.received", signal=name, action="stop at once")
        self.interrupted = True
        self.coord._request(None, "signal")
        for scope in self.scopes:
            scope.cancel()

    # -- start ----------------------------------------------------------------

    async def _start(self, wait_for_checkpoint: bool, max_wait_secs: float) -> ManagedSession:
        sv = self.sv
        started = time.perf_counter()
        if sv.is_chief and sv.logdir is not None:
            os.makedirs(sv.logdir, exist_ok=True)
            self.lock = LogdirLock(sv.logdir)
            self.lock.acquire()  # before anything is written: one live chief per logdir
            leftovers = remove_unfinished(sv.logdir, sv.checkpoint_basename)
            if leftovers:
                log.info("checkpoint.unfinished_removed", paths=leftovers)
        sv._checkpointer = sv._new_checkpointer()  # reads the state file as it is now
        if sv.role is not None:
            self.agreement = Agreement(sv.role, self._on_cluster_lost)
            self.agreement.start()
        # In a multi-worker job a non-chief waits for the chief's choice instead (in
        # _choose_checkpoint): its scratch directory never holds a checkpoint, and the
        # chief's first save needs this worker, so waiting for a file would deadlock.
        if wait_for_checkpoint and not sv.is_chief and self.agreement is None:
            await self._wait_for_checkpoint(max_wait_secs)
        writer, events_path = sv._make_writer()
        sv._writer = writer
        step = GlobalStep(sv.global_step, sv._owns_global_step)
        checkpointer = sv._checkpointer if sv.checkpointing else None
        if checkpointer is not None:
            # A background write that fails for good stops training, like a sync one.
            def fatal(error: BaseException) -> None:
                self.coord._request(error, "requested", failure=True)

            checkpointer.on_fatal = fatal
        sess = ManagedSession(sv, self.worker, step, checkpointer, writer, sv._make_loop)
        sess._events_path = events_path
        if self.agreement is not None:
            sess._agreement = self.agreement
            sess._propose_stop = self._propose_stop
        self.sess = sess
        sess.restore_report = await self.worker.run(self._restore_or_init, sess, max_wait_secs)
        report = sess.restore_report
        log.info(
            "session.started",
            step=report.step,
            restored_from=report.path,
            source=report.source,
            is_chief=sv.is_chief,
            worker=None if sv.role is None else sv.role.name,
            seconds=round(time.perf_counter() - started, 4),
        )
        return sess

    async def _wait_for_checkpoint(self, max_wait_secs: float) -> None:
        assert self.sv._checkpointer is not None, "wait_for_checkpoint needs a logdir"
        deadline = anyio.current_time() + max_wait_secs
        while self.sv._checkpointer.latest() is None:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                raise WaitTimeout(
                    f"no checkpoint appeared in {self.sv.logdir!r} in {max_wait_secs} s"
                )
            log.info(
                "checkpoint.waiting", logdir=self.sv.logdir, remaining_secs=round(remaining, 1)
            )
            await anyio.sleep(min(self.sv.recovery_wait_secs, remaining))

    def _on_cluster_lost(self, error: BaseException) -> None:
        """The job's coordination service failed: a worker, or the chief, is gone."""
        self.coord._request(error, "requested", failure=True)

    def _choose_checkpoint(self, max_wait_secs: float) -> tuple[str | None, list[tuple[str, str]]]:
        """Training thread: restore the newest good checkpoint; in a multi-worker job the
        chief chooses it and every other worker restores the same one."""
        checkpointer, agreement = self.sv._checkpointer, self.agreement
        if checkpointer is None:
            return None, []
        if agreement is None or agreement.role.is_chief:
            path, skipped = checkpointer.restore_newest()
            if agreement is not None:
                agreement.publish("restore", path or "")
            return path, skipped
        chosen = agreement.read("restore", max_wait_secs) or None
        if chosen is not None:
            checkpointer.restore(chosen)
        return chosen, []

    def _restore_or_init(self, sess: ManagedSession, max_wait_secs: float) -> RestoreReport:
        """On the training thread: restore the newest checkpoint, or initialize."""
        sv, step = self.sv, sess._step_var
        if sess._writer is not None:
            # Steps that call tf.summary.* write into this run's events file.
            sess._writer.set_as_default(step=sv.global_step)
        for hook in sv.hooks:
            hook.begin(sv)
        started = time.perf_counter()
        path, skipped = self._choose_checkpoint(max_wait_secs)
        step.reload()
        if path is not None:
            sv._checkpointer.last_saved_step = step.value  # type: ignore[union-attr]
            log.info(
                "checkpoint.restored",
                path=path,
                step=step.value,
                skipped=len(skipped),
                seconds=round(time.perf_counter() - started, 4),
            )
            report = RestoreReport("checkpoint", path, step.value, tuple(skipped))
        else:
            source = "fresh"
            # Every worker of a multi-worker job holds its own copy of the variables.
            if sv.init_fn is not None and (sv.is_chief or sv.role is not None):
                sv.init_fn()
                source = "init_fn"
            report = RestoreReport(source, None, step.value, tuple(skipped))  # type: ignore[arg-type]
        for hook in sv.hooks:
            hook.after_create_session(sess)
        if report.source != "checkpoint":
            sess._save_checkpoint()  # so that init_fn's work is never lost
        return report

    def _start_services(self, sess: ManagedSession, tg: TaskGroup, standard: bool) -> None:
        sess._task_group = tg
        regs = self.sv._standard_services(sess._writer) if standard else []
        for reg in [*regs, *self.sv._services]:
            sess._start(reg)

    # -- stop -----------------------------------------------------------------

    def _body_raised(self, exc: BaseException) -> None:
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            # Our own cancellation of the body never gets here (its scope absorbs it).
            self.cancelled = exc
            self.coord._request(None, "requested")
        else:
            self.coord.request_stop(exc)

    def _grace_left(self) -> float:
        """Seconds left of the grace period that began when the stop was requested."""
        stopped_at = self.coord.stopped_at
        if stopped_at is None:
            return self.sv.stop_grace_secs
        return max(0.0, stopped_at + self.sv.stop_grace_secs - time.monotonic())

    def _report_stuck(self, sess: ManagedSession) -> None:
        current = self.worker.current
        self.stuck = current.name if current is not None else "a training-thread job"
        log.error(
            "session.step_stuck",
            step=sess.global_step,
            job=self.stuck,
            grace_secs=self.sv.stop_grace_secs,
        )

    async def _watch_grace(self, sess: ManagedSession, body: anyio.CancelScope) -> None:
        """A body still waiting for a step a grace period after the stop gives up on it."""
        await self.coord.wait_for_stop()
        await anyio.sleep(self._grace_left())
        if sess._step_running_since() is not None and not body.cancel_called:
            self._report_stuck(sess)
            body.cancel()

    async def _stop(self, sess: ManagedSession) -> None:
        self.coord._request(None, "requested")
        with anyio.move_on_after(self._grace_left()) as waited:
            await self.worker.drain()  # the in-flight step, and anything queued behind it
        if waited.cancelled_caught:
            if self.stuck is None:
                self._report_stuck(sess)
        elif self.cancelled is None and self.coord.error is None:
            try:
                await self.worker.run(self._finish, sess)
            except Exception as exc:
                self.coord.request_stop(exc)
            if self.agreement is not None and self.coord.error is None:
                self.agreement.stopping = True
                await anyio.to_thread.run_sync(
                    self.agreement.finish_together, max(self._grace_left(), 1.0)
                )
        with anyio.move_on_after(self._grace_left()) as services:
            await sess._wait_services()
        if services.cancelled_caught:
            log.warning(
                "service.cancelled",
                running=sess._running_services,
                grace_secs=self.sv.stop_grace_secs,
            )

    def _finish(self, sess: ManagedSession) -> None:
        """On the training thread, after a clean stop: hooks' end, then the final save."""
        for hook in self.sv.hooks:
            hook.end(sess)
        sess._save_checkpoint()
        if sess._checkpointer is not None:
            sess._checkpointer.wait_for_write()  # the final save is on disk when we return
            sess._after_background_saves()

    def _close(self) -> None:
        self.coord._unbind()
        if self.agreement is not None:
            self.agreement.close()
        if self.signals is not None:
            self.signals.restore()
        sv = self.sv
        if sv._writer is not None:
            if sv._summary_writer_arg == "auto":
                sv._writer.close()  # flushes; a writer the user gave stays theirs
            else:
                sv._writer.flush()
            sv._writer = None
        write_wait = 0.0 if self.interrupted else sv.stop_grace_secs
        if sv._checkpointer is not None and not sv._checkpointer.wait_for_write(timeout=write_wait):
            log.error("checkpoint.write_unfinished", grace_secs=sv.stop_grace_secs)
        if self.lock is not None:
            self.lock.release()
        self.worker.stop()
        if self.stuck is None and not self.interrupted:
            self.worker.join(timeout=self.sv.stop_grace_secs or None)
        log.info(
            "session.stopped",
            step=int(sv.global_step.numpy()),
            reason=self.coord.reason,
            error=None if self.coord.error is None else repr(self.coord.error),
            stuck_step=self.stuck,
        )

    def _raise_outcome(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt("a second SIGINT: stopped at once, without a final checkpoint")
        if self.cancelled is not None:
            raise self.cancelled
        error: Any = self.coord.error
        if self.stuck is not None and not isinstance(error, StepTimeout):
            raise GracePeriodExpired(
                f"step {self.stuck!r} was still running {self.sv.stop_grace_secs} s "
                "(stop_grace_secs) after the stop; no final checkpoint was written"
            ) from error
        if error is not None:
            raise error
