"""A session's start: open the logdir, wait for a checkpoint, restore or initialize.

Every blocking part (directory and lock I/O, the checkpoint manager reading the
state file, the events file, the restore itself) runs on the session's training
thread, never on the event loop, and every wait gives way to a stop within one
poll: a stop during start-up ends the session before it trains.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from ._checkpoints import Checkpointer, RestoreReport
from ._cluster import Agreement
from ._errors import WaitTimeout
from ._lock import WriteGuard, make_lock
from ._log import log
from ._logdir import is_own, remove_unfinished
from ._scratch import ScratchCheckpointer
from ._store import Store
from ._verify import unrestored

if TYPE_CHECKING:
    from ._runtime import SessionRuntime


async def start(rt: SessionRuntime, wait: bool, max_wait_secs: float) -> None:
    sv = rt.sv
    started = time.perf_counter()
    await rt.thread.run(_open, rt)
    if sv.role is not None:
        rt.agreement = Agreement(sv.role, _lost(rt), lambda: rt.flag.stopped)
        rt.agreement.start()
    # In a multi-worker job a non-chief waits for the chief's choice instead (in
    # _choose): its scratch directory never holds a checkpoint, and the chief's
    # first save needs this worker, so waiting for a file would deadlock.
    if wait and not sv.is_chief and rt.agreement is None and not await _wait(rt, max_wait_secs):
        rt.restore_report = RestoreReport("interrupted", None, rt.step.value)
        return
    report = await _until_stop(rt, _restore_or_init, rt, max_wait_secs)
    if report is None:  # a stop came first: nothing was restored, nothing is saved
        rt.restore_report = RestoreReport("interrupted", None, rt.step.value)
        log.info("session.start_interrupted", reason=rt.flag.reason)
        return
    rt.restore_report = report
    log.info(
        "session.started",
        step=report.step,
        restored_from=report.path,
        source=report.source,
        is_chief=sv.is_chief,
        worker=None if sv.role is None else sv.role.name,
        seconds=round(time.perf_counter() - started, 4),
    )


def _lost(rt: SessionRuntime) -> Callable[[BaseException], None]:
    def lost(error: BaseException) -> None:
        """The job's coordination service failed: a worker, or the chief, is gone."""
        rt.flag.set(error, "requested", failure=True)

    return lost


def _open(rt: SessionRuntime) -> None:
    """Training thread: the logdir, its lock, the checkpointer, the events file."""
    sv = rt.sv
    if sv.is_chief and sv.logdir is not None:
        store = Store(sv.logdir)
        store.make()
        rt.lock = make_lock(store)
        rt.lock.acquire()  # before anything is written: one live chief per logdir
        rt.guard = WriteGuard(rt.lock)
        leftovers = remove_unfinished(store, sv.checkpoint_basename)
        if leftovers:
            log.info("checkpoint.unfinished_removed", paths=leftovers)
    if sv.logdir is not None:
        if sv.role is not None and not sv.is_chief:
            rt.checkpointer = ScratchCheckpointer(
                sv.checkpoint, sv.role.name, sv.checkpoint_basename
            )
        else:
            rt.checkpointer = Checkpointer(
                sv.checkpoint,
                sv.logdir,
                basename=sv.checkpoint_basename,
                max_to_keep=sv.max_to_keep,
                keep_checkpoint_every_n_hours=sv.keep_checkpoint_every_n_hours,
                async_write=sv.async_checkpoint,
                guard=rt.guard,
            )
        # A background write that fails for good stops training, like a sync one.
        rt.checkpointer.on_fatal = lambda error: rt.flag.set(error, "requested", failure=True)
    rt.events.open()
    rt.events.set_default(rt.step.for_summaries())


async def _wait(rt: SessionRuntime, max_wait_secs: float) -> bool:
    """A non-chief polls for the chief's first checkpoint; ``False`` if a stop came first."""
    checkpointer, sv = rt.checkpointer, rt.sv
    assert checkpointer is not None, "wait_for_checkpoint needs a logdir"
    deadline = anyio.current_time() + max_wait_secs
    # Only a checkpoint that reads back whole ends the wait: damaged ones are not one.
    while not await rt.thread.run(checkpointer.good_exists):
        remaining = deadline - anyio.current_time()
        if remaining <= 0:
            raise WaitTimeout(f"no checkpoint appeared in {sv.logdir!r} in {max_wait_secs} s")
        log.info("checkpoint.waiting", logdir=sv.logdir, remaining_secs=round(remaining, 1))
        if await rt.flag.wait(min(sv.recovery_wait_secs, remaining)):
            return False
    return True


async def _until_stop(rt: SessionRuntime, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on the training thread; ``None`` as soon as a stop comes first (the
    job is left to finish on its own: the runtime's fence keeps it from acting)."""
    outcome: list[tuple[bool, Any]] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            try:
                outcome.append((True, await rt.thread.run(fn, *args)))
            except Exception as exc:  # raised below, as itself, not in an ExceptionGroup
                outcome.append((False, exc))
            tg.cancel_scope.cancel()

        async def give_up_on_stop() -> None:
            await rt.flag.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(give_up_on_stop)
    if not outcome:
        return None
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _choose(rt: SessionRuntime, max_wait_secs: float) -> tuple[str | None, list[tuple[str, str]]]:
    """Training thread: restore the newest good checkpoint; in a multi-worker job the
    chief chooses it and every other worker restores the same one."""
    checkpointer, agreement = rt.checkpointer, rt.agreement
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


def _restore_or_init(rt: SessionRuntime, max_wait_secs: float) -> RestoreReport:
    """Training thread: restore the newest checkpoint, or initialize."""
    sv, step = rt.sv, rt.step
    for hook in sv.hooks:
        hook.begin(sv)
    started = time.perf_counter()
    path, skipped = _choose(rt, max_wait_secs)
    rt.check_open()  # a restore given up on by a stop acts no further
    step.reload()
    rt.position.reload()
    # Step schedules count from here, as TF's CheckpointSaverHook and SummarySaverHook do.
    rt.stepper.last_save_step = rt.stepper.last_summary_step = step.value
    if path is not None and rt.checkpointer is not None:
        checkpointer = rt.checkpointer
        if is_own(path, checkpointer.basename):
            checkpointer.last_saved_step = checkpointer.last_good_step = step.value
        else:
            log.warning("checkpoint.migrated", path=path, step=step.value)
        waiting = unrestored(checkpointer.restore_status)
        if waiting is not None:
            # Objects not built yet take their values when they are built: checked
            # again after the first step, which builds them (SessionRuntime.after_step).
            rt.deferred = (path, waiting)
            log.info("checkpoint.deferred", path=path, first_value=waiting)
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
    rt.restore_report = report
    rt.events.mark_start(step.value + 1)  # the restored state's own point stays
    rt.ready = True
    for hook in sv.hooks:
        hook.after_create_session(rt.session)
    if report.source != "checkpoint" and sv.checkpointing:
        rt.save()  # so that init_fn's work is never lost
    return report


def recover(rt: SessionRuntime, exc: BaseException) -> None:
    """Training thread, after a recoverable error: restore the newest good checkpoint,
    so that the failed step's partial writes are gone, and let the step run again."""
    sv, checkpointer, stepper = rt.sv, rt.checkpointer, rt.stepper
    if rt.agreement is not None:
        # A collective failed: a worker is gone. Retrying alone cannot help; the
        # job stops, and its restart resumes from the last checkpoint.
        log.error("cluster.step_failed", error=f"{type(exc).__name__}: {_cause_line(exc)}")
        raise exc
    stepper.recoveries += 1
    if checkpointer is None or stepper.recoveries > sv.max_recoveries:
        raise exc
    checkpointer.wait_for_write()
    path, _ = checkpointer.restore_newest()
    if path is None:
        raise exc
    rt.step.reload()
    rt.position.reload()
    stepper.steps_since_save = 0
    stepper.means.clear()  # the failed steps' results are not the restored state's
    rt.events.mark_start(rt.step.value + 1)
    log.warning(
        "step.recovered",
        error=f"{type(exc).__name__}: {exc}",
        restored_step=rt.step.value,
        path=path,
        attempt=stepper.recoveries,
        max_recoveries=sv.max_recoveries,
    )


def _cause_line(exc: BaseException) -> str:
    """The line of a collective's error that says what happened (TF's message is
    mostly a graph traceback): ``Collective ops is aborted by: Socket closed``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "aborted by" in line or "Connection reset" in line:
            return line[:300]
    return (lines[0] if lines else "")[:300]
