"""SessionCheckpoints: one session's checkpoint decisions, on the training thread.

When to save and what a commit records (its health: the last step's loss and every
value the state saves were finite), an explicit or timed save, the hooks' ``after_save``,
recovering from a recoverable error, rolling back after a divergence, and the check that
a restore was taken whole. It is handed its collaborators (the session's settings, the
training thread, the step, the stepper, the position, the kept state, the events file,
the public session for hooks, the stop entry); the checkpointer once the logdir is open.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointMismatchError, DivergedError
from .._log import log
from .._logdir.exports import export_if_best
from .._logdir.files import checkpoint_problem
from .._logdir.history import Commit
from .._logdir.records import Record, finite_numbers
from .._logdir.verify import unrestored
from .._outcome import StopReason
from .._training.divergence import LossWatch, loss_of
from .._training.summaries import scalars

if TYPE_CHECKING:
    from .._checkpointing.checkpointer import Checkpointer
    from .._cluster import Agreement
    from .._supervisor import Supervisor
    from .._training.kept_state import KeptState
    from .._training.position import Position
    from .._training.steps import GlobalStep, Stepper
    from .._training.summaries import EventsFile
    from .._training.thread import TrainingThread
    from .managed import ManagedSession
    from .stopping import StopFlag

WATCH = ("divergence", "loss_watch")  # the kept state's kind and key of the loss window
MIRROR_SETTLE_SECS = 60.0  # a rollback waits this long at most for the mirror


class SessionCheckpoints:
    """The checkpoint decisions of one session (see the module's docstring)."""

    def __init__(
        self,
        sv: Supervisor,
        thread: TrainingThread,
        step: GlobalStep,
        stepper: Stepper,
        position: Position,
        kept: KeptState,
        events: EventsFile,
        session: ManagedSession,
        flag: StopFlag,
        request_stop: Callable[[BaseException | None, StopReason], object],
    ) -> None:
        self.sv = sv  # configuration only: read, never written
        self.thread, self.step, self.stepper = thread, step, stepper
        self.position, self.kept, self.events = position, kept, events
        self.session, self.flag, self._request_stop = session, flag, request_stop
        self.checkpointer: Checkpointer | None = None
        self.agreement: Agreement | None = None
        self.deferred: tuple[str, str] | None = None  # (checkpoint, a value not taken yet)
        self._began = False
        policy = sv.on_divergence
        self.losses: LossWatch | None = None if policy is None else LossWatch(policy)
        if self.losses is not None:
            kept.track(WATCH[0], [self.losses], [WATCH[1]])

    # -- what the session hands over --------------------------------------------------

    def opened(self, checkpointer: Checkpointer | None) -> None:
        self.checkpointer = checkpointer

    def joined(self, agreement: Agreement) -> None:
        self.agreement = agreement

    def began(self, deferred: tuple[str, str] | None) -> None:
        """Training thread: restored (or initialized); the loss window as it was saved."""
        self.deferred = deferred
        self._give_back_window()
        self._began = True

    def _give_back_window(self) -> None:
        if self.losses is not None:
            self.losses.restore({})  # a checkpoint without one: a fresh window
            self.kept.give_back(WATCH[0], [self.losses], [WATCH[1]])

    # -- saving ------------------------------------------------------------------------

    def save(
        self,
        *,
        final: bool = False,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> str | None:
        """Training thread: save at the current step; hooks' after_save may ask to stop.
        Returns the path written (``None``: nothing to save, or a background write).

        With ``async_checkpoint`` the files are written in the background and the
        hooks run at the first step boundary after they are on disk.
        """
        checkpointer = self.checkpointer
        if checkpointer is None or not self._began:
            return None
        self.thread.check_fence()
        self.thread.mark_step(training=False)  # a save, also inside a step: no training
        self.step.flush()
        stepper, step, writer = self.stepper, self.step.value, checkpointer.writer
        if final:
            # A background write of this step is the final save only once it is on
            # disk: one that fails (a full disk) must be written again, or raise.
            writer.wait_for_write()
            self.saves_done(hooks=True)
        # Steps ran since the last save without moving the step: the newer state is
        # written beside the checkpoint of that number.
        force = force or (stepper.unsaved > 0 and step == writer.last_saved_step)
        if not force and writer.has(step):
            return None
        record, why = self._record(step, metrics)
        if self.losses is not None and not record.healthy:
            log.warning("checkpoint.skipped", step=step, reason=why)
            return None  # with rollbacks on, state that diverged is never committed
        self.position.sync()
        self.kept.sync()
        runs = stepper.steps_run
        path = writer.save(step, record, force=force, final=final, tag=runs)
        if path is not None:
            stepper.state_saved(runs)
            self._export_if_best(step, path)
            self.call_after_save(step, path)
        return path

    def _export_if_best(self, step: int, path: str) -> None:
        """A commit written now (synchronously: the model is in its state) that is the best
        so far is exported, if ``KeepBest(export=...)`` asks; by the chief only."""
        keep_best, checkpointer = self.sv.keep_best, self.checkpointer
        if keep_best is None or keep_best.export is None or checkpointer is None:
            return
        name = checkpointer.store.name_of(path)
        if name is None or not self.sv.is_chief:
            return
        exported = export_if_best(
            keep_best, checkpointer.writer.retention, checkpointer.catalog.history, name, step
        )
        if exported is not None:
            log.info("checkpoint.exported", step=step, path=exported)

    def _record(self, step: int, metrics: Mapping[str, Any] | None) -> tuple[Record, str]:
        """What a commit records: the last step's numbers (and the ones given), and
        whether it is healthy: its loss and every floating-point value it saves are
        finite (else why not)."""
        assert self.checkpointer is not None
        last = self.stepper.last_result
        loss = loss_of(last)
        values = finite_numbers({**scalars(last), **(metrics or {})})
        if loss is not None and not math.isfinite(loss):
            return Record(step, time.time(), values, False), "the loss is not finite"
        if not self.checkpointer.root.finite():
            return Record(step, time.time(), values, False), "the saved state is not finite"
        return Record(step, time.time(), values, True), ""

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
        writer = checkpointer.writer
        path = self.save(metrics=metrics) or writer.writing  # a background write: its path
        if path is None and writer.last_saved_step == self.step.value:
            path = writer.latest_committed()  # nothing changed since it was written
        return path

    def timed_save(self) -> None:
        """Training thread: a save request. In a multi-worker job only the chief's timer
        runs, and every worker saves after the next step."""
        from .._cluster import DecisionKind

        if self.agreement is None:
            self.save()
        elif not self.flag.stopped and not self._local_write_running():
            self.agreement.propose(DecisionKind.SAVE, "timer", self.step.value)

    def _local_write_running(self) -> bool:
        """A local write of the chief's is in flight: a timed save now is skipped, as on
        one worker (the next interval saves), by not proposing it; every worker would
        take part in it, and the chief's write would hold them all."""
        checkpointer = self.checkpointer
        tiers = None if checkpointer is None else checkpointer.tiers
        if tiers is not None and tiers.writer.busy:
            log.debug(
                "checkpoint.local_skipped", step=self.step.value, writing=tiers.writer.writing
            )
            return True
        return False

    def call_after_save(self, step: int, path: str) -> None:
        for hook in self.sv.hooks:
            if hook.after_save(self.session, step, path):
                self._request_stop(None, StopReason.REQUESTED)

    def saves_done(self, *, hooks: bool) -> None:
        """Background saves whose files are on disk: their steps no longer count as
        unsaved; at a step boundary, the hooks' ``after_save`` runs for each."""
        checkpointer = self.checkpointer
        while checkpointer is not None and checkpointer.writer.completed:
            step, path, runs = checkpointer.writer.completed.popleft()
            self.stepper.state_saved(runs)
            if hooks:
                self.call_after_save(step, path)

    # -- going back ----------------------------------------------------------------------

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
        self._restored(checkpointer, path)
        stepper.recovered()
        log.warning(
            "step.recovered",
            error=f"{type(exc).__name__}: {exc}",
            restored_step=self.step.value,
            path=path,
            attempt=stepper.recoveries,
            max_recoveries=self.sv.max_recoveries,
        )

    def _restored(self, checkpointer: Checkpointer, path: str) -> None:
        """After a restore on the way: the step, the position, the kept state, the loss
        window are the checkpoint's; the events file's next point comes after it."""
        checkpointer.restored(path)
        self.step.reload()
        self.position.reload()
        self.kept.reload()
        self._give_back_window()
        self.events.mark_start(self.step.value + 1)

    def check_divergence(self, result: Any) -> bool:
        """Training thread, after a step: ``True`` when its loss diverged and the run was
        rolled back (see ``_training/divergence.py``); raises ``DivergedError`` after too
        many rollbacks of the run."""
        watch = self.losses
        if watch is None:
            return False
        loss = loss_of(result)
        reason = None if loss is None else watch.diverges(loss)
        if reason is None:
            return False
        self._roll_back(reason, loss)
        return True

    def steady(self, losses: Sequence[float] | None) -> bool:
        """Training thread, after a call of many steps: ``True`` when no step of it can
        have diverged (no watch, no loss, or every loss finite and no spike rule: they
        joined the window), so the steps need no look one by one (``check_divergence``)."""
        watch = self.losses
        return watch is None or losses is None or watch.accepts_all(losses)

    def _roll_back(self, reason: str, loss: float | None) -> None:
        policy, checkpointer = self.sv.on_divergence, self.checkpointer
        assert policy is not None
        diverged, where = self.step.value, (self.position.epoch, self.position.batch)
        log.warning("step.diverged", step=diverged, loss=loss, reason=reason)
        what = f"the loss diverged ({reason}: {loss}) at step {diverged}"
        if checkpointer is None:
            raise DivergedError(f"{what}, and no checkpoint is there to roll back to")
        checkpointer.wait_for_write()
        self.saves_done(hooks=False)
        # With a local tier the logdir's history decides where to go back to: it must
        # hold what was committed locally first (bounded; what is not copied by then is
        # not a target, and is abandoned with the rest).
        checkpointer.settle_mirror(MIRROR_SETTLE_SECS)
        catalog = checkpointer.catalog
        done = catalog.history.divergences()
        if len(done) >= policy.max_rollbacks:
            back = [f"step {r.at_step} -> {_name(catalog.history.commit(r.to))}" for r in done]
            raise DivergedError(
                f"{what}, after {len(done)} rollbacks (max_rollbacks={policy.max_rollbacks}): "
                f"stopped. The logdir's history counts the rollbacks of the run across "
                f"restarts ({back}); raise max_rollbacks to go on"
            )
        target = self._restore_target(checkpointer, diverged - policy.lookback)
        if target is None:
            raise DivergedError(f"{what}, and no healthy checkpoint is there to roll back to")
        path = checkpointer.path_of(target.name)
        self._restored(checkpointer, path)
        restored = self.step.value
        dropped, moved = 0, None
        if self.position.counts():  # past the batch that diverged, and `skip` more
            moved = (where[0], where[1] + policy.skip)
            self.position.go_to(*moved)
            dropped = max(0, diverged - restored) + policy.skip
        self.stepper.recovered()
        checkpointer.rolled_back(target.name)  # the local tier's history goes back too
        catalog.roll_back(  # with the moved position: a restart before the branch commit
            target.seq,
            kind="divergence",
            reason=reason,
            at_step=diverged,
            loss=loss,
            batches_dropped=dropped,
            position=moved,
        )
        rollbacks = float(len(catalog.history.divergences()))  # the run's, this one counted
        self.events.write(
            {"rollback/diverged_at_step": float(diverged), "run/rollbacks": rollbacks},
            restored + 1,
        )
        log.warning(
            "checkpoint.rolled_back",
            path=path,
            step=restored,
            diverged_at=diverged,
            data_position=[self.position.epoch, self.position.batch],
            batches_dropped=dropped,
            rollbacks=len(catalog.history.divergences()),
        )
        if self.sv.checkpointing:
            # The new branch's first commit: the data moved past the bad batch is on
            # disk, so a restart now does not meet it again.
            self.save(force=True)

    def _restore_target(self, checkpointer: Checkpointer, at_or_before: int) -> Commit | None:
        """Restore the newest commit on the head's line at or before ``at_or_before``
        that is not known to be unhealthy and reads back whole and finite; one that turns
        out not finite is recorded so (never chosen again)."""
        catalog, tried = checkpointer.catalog, set[int]()
        while True:
            target = catalog.history.rollback_target(at_or_before, 0, excluding=tried)
            if target is None:
                return None
            tried.add(target.seq)
            path = checkpointer.path_of(target.name)
            problem = checkpoint_problem(checkpointer.store_of(path), path)
            if problem is not None:
                log.warning("checkpoint.fallback", skipped=path, reason=problem)
                continue
            checkpointer.restore(path)
            if checkpointer.root.finite():
                if target.healthy is None:
                    catalog.judged(target.seq, True)
                return target
            catalog.judged(target.seq, False)
            log.warning("checkpoint.fallback", skipped=path, reason="its state is not finite")

    def check_deferred(self) -> None:
        """Training thread, after the first step: every restored value has been taken, or
        the restore was not what it said (an unbuilt model made new variables)."""
        if self.deferred is None or self.checkpointer is None:
            return
        (path, _), self.deferred = self.deferred, None
        left = unrestored(self.checkpointer.last_restorer.take_restore_status())
        if left is not None:
            raise CheckpointMismatchError(
                f"checkpoint {path} was not fully restored: after the first step no object "
                f"has taken {left} (and perhaps more). An object that is not built when the "
                "session starts is restored deferred, and a Keras 3 model built later makes "
                "new variables instead. Build the model before the session starts (call it "
                "on one batch, or model.build(input_shape)); an optimizer may stay unbuilt."
            )


def _name(commit: Commit | None) -> str:
    return "?" if commit is None else os.path.basename(commit.name)


def _cause_line(exc: BaseException) -> str:
    """The line of a collective's error that says what happened (TF's message is
    mostly a graph traceback): ``Collective ops is aborted by: Socket closed``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "aborted by" in line or "Connection reset" in line:
            return line[:300]
    return (lines[0] if lines else "")[:300]
