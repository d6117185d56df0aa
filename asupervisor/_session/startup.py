"""A session's start: open the logdir, wait for a checkpoint, restore or initialize.

Every blocking part (directory and lock I/O, reading the state file, the events file,
the restore itself) runs on the session's training thread, never on the event loop,
and every wait gives way to a stop within one poll: a stop during start-up ends the
session before it trains, and the start-up job it gave up on is fenced (it restores
nothing more, runs no hook, saves nothing).

These functions change nothing of the runtime's but through its methods; they
return what they found.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._checkpointing.checkpointer import Checkpointer, RestoreReport
from .._checkpointing.local import copy_in, offer_of
from .._checkpointing.scratch import ScratchCheckpointer
from .._cluster import Agreement
from .._errors import WaitTimeout
from .._kinds import JobKind, RestoreSource
from .._log import log
from .._logdir.files import remove_unfinished
from .._logdir.history import Provenance
from .._logdir.lock import LeaseLock, LogdirLock, WriteGuard, make_lock
from .._logdir.store import Store
from .._logdir.verify import unrestored
from .._training.thread import Job

if TYPE_CHECKING:
    from .runtime import SessionRuntime


@dataclass(frozen=True)
class Opened:
    """What opening the logdir made: the lock, its write guard, the checkpointer."""

    lock: LogdirLock | LeaseLock | None
    guard: WriteGuard
    checkpointer: Checkpointer | None


async def start(rt: SessionRuntime, wait: bool, max_wait_secs: float) -> RestoreReport:
    """Open, join the job, restore or initialize; the report (``interrupted`` when a
    stop came first)."""
    sv = rt.sv
    started = time.perf_counter()
    rt.adopt(await rt.thread.run_job(Job(_open, (rt,), kind=JobKind.INTERNAL)))
    if sv.role is not None:
        rt.join(Agreement(sv.role, _lost(rt), lambda: rt.flag.stopped))
    interrupted = RestoreReport(RestoreSource.INTERRUPTED, None, rt.step.value)
    # In a multi-worker job a non-chief waits for the chief's choice instead (in
    # _choose): its scratch directory never holds a checkpoint, and the chief's
    # first save needs this worker, so waiting for a file would deadlock.
    if wait and not sv.is_chief and rt.agreement is None and not await _wait(rt, max_wait_secs):
        return interrupted
    report: RestoreReport | None = await _until_stop(rt, _restore_or_init, rt, max_wait_secs)
    if report is None:  # a stop came first: nothing was restored, nothing is saved
        log.info("session.start_interrupted", reason=str(rt.flag.reason))
        return interrupted
    log.info(
        "session.started",
        step=report.step,
        restored_from=report.path,
        source=report.source.value,
        is_chief=sv.is_chief,
        worker=None if sv.role is None else sv.role.name,
        seconds=round(time.perf_counter() - started, 4),
    )
    return report


def _lost(rt: SessionRuntime) -> Callable[[BaseException], None]:
    def lost(error: BaseException) -> None:
        """The job's coordination service failed: a worker, or the chief, is gone."""
        rt.fail(error)

    return lost


def _open(rt: SessionRuntime) -> Opened:
    """Training thread: the logdir, its lock, the checkpointer, the events file."""
    sv = rt.sv
    lock, guard = None, WriteGuard(None)
    if sv.is_chief and sv.logdir is not None:
        store = Store(sv.logdir)
        store.make()
        lock = make_lock(store)
        lock.acquire()  # before anything is written: one live chief per logdir
        guard = WriteGuard(lock)
        leftovers = remove_unfinished(store, sv.checkpoint_basename)
        if leftovers:
            log.info("checkpoint.unfinished_removed", paths=leftovers)
    checkpointer: Checkpointer | None = None
    if sv.logdir is not None:
        if sv.role is not None and not sv.is_chief:
            # It saves as the chief does: in the background with a local tier (or
            # async_checkpoint), so that both ask the same of the collectives.
            checkpointer = ScratchCheckpointer(
                rt.root,
                sv.role.name,
                sv.checkpoint_basename,
                async_write=sv.async_checkpoint or sv.local_tier is not None,
            )
        else:
            checkpointer = Checkpointer(
                rt.root,
                sv.logdir,
                basename=sv.checkpoint_basename,
                max_to_keep=sv.max_to_keep,
                keep_checkpoint_every_n_hours=sv.keep_checkpoint_every_n_hours,
                async_write=sv.async_checkpoint,
                guard=guard,
                on_fatal=rt.fail,  # a background write that fails for good stops training
                keep_best=sv.keep_best,
                lookback=None if sv.on_divergence is None else sv.on_divergence.lookback,
                provenance=Provenance.of_session(rt.presence.session_id),
                local=sv.local_tier if sv.is_chief else None,
                together=sv.role is not None,  # every worker takes part in each save
            )
    rt.events.open(rt.thread.on_thread)
    rt.events.set_default(rt.step.for_summaries())
    return Opened(lock, guard, checkpointer)


async def _wait(rt: SessionRuntime, max_wait_secs: float) -> bool:
    """A non-chief polls for the chief's first checkpoint; ``False`` if a stop came first."""
    checkpointer, sv = rt.checkpointer, rt.sv
    assert checkpointer is not None, "wait_for_checkpoint needs a logdir"
    deadline = anyio.current_time() + max_wait_secs
    # Only a checkpoint that reads back whole ends the wait: damaged ones are not one.
    while not await rt.thread.run(checkpointer.restorer.good_exists):
        remaining = deadline - anyio.current_time()
        if remaining <= 0:
            raise WaitTimeout(f"no checkpoint appeared in {sv.logdir!r} in {max_wait_secs} s")
        log.info("checkpoint.waiting", logdir=sv.logdir, remaining_secs=round(remaining, 1))
        if await rt.flag.wait(min(sv.recovery_wait_secs, remaining)):
            return False
    return True


async def _until_stop(rt: SessionRuntime, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on the training thread; ``None`` as soon as a stop comes first (the
    job goes on by itself, fenced: it can change nothing of the session any more)."""
    outcome: list[tuple[bool, Any]] = []
    job = Job(fn, args, kind=JobKind.INTERNAL)
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            try:
                outcome.append((True, await rt.thread.run_job(job, fence_on_cancel=True)))
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
    chief chooses it and every other worker restores the same one.

    With a local tier, the chief's local commit counts only if every worker reads it in
    its own local tier (the same files: on the chief's host, or a directory every host
    shares); otherwise the job restores the logdir's newest."""
    checkpointer, agreement = rt.checkpointer, rt.agreement
    if checkpointer is None:
        return None, []
    if agreement is None:
        return checkpointer.restore_newest()
    if agreement.role.is_chief:
        asked: list[str] = []

        def shared(path: str) -> bool:
            asked.append(path)
            return _every_worker_reads(agreement, path, max_wait_secs)

        path, skipped = checkpointer.restore_newest(shared)
        if not asked:
            agreement.publish(OFFER, "")  # no local commit to ask about
        choice = {"path": path or "", "tier": checkpointer.restored_tier}
        agreement.publish("restore", json.dumps(choice))
        return path, skipped
    offer = agreement.read(OFFER, max_wait_secs)
    own = _own_copy(rt, offer)
    if offer:
        agreement.publish(f"{OFFER}/{agreement.role.rank}", "1" if own is not None else "0")
    choice = json.loads(agreement.read("restore", max_wait_secs))
    chosen, tier = choice["path"] or None, choice["tier"]
    if chosen is not None:
        if tier == "local":  # every worker said it reads it: its own copy
            assert own is not None, "the chief chose a local commit this worker lacks"
            chosen = own
        checkpointer.restore(chosen, tier)
    return chosen, []


OFFER = "local_offer"  # the chief's local commit, asked of every worker (offer_of)


def _every_worker_reads(agreement: Agreement, path: str, max_wait_secs: float) -> bool:
    """Chief: whether every other worker reads the local checkpoint ``path`` restored."""
    agreement.publish(OFFER, offer_of(path))
    answers = [
        agreement.read(f"{OFFER}/{rank}", max_wait_secs)
        for rank in range(1, agreement.role.num_workers)
    ]
    shared = all(answer == "1" for answer in answers)
    if not shared:
        log.info("checkpoint.local_not_shared", path=path, workers_reading=answers.count("1") + 1)
    return shared


def _own_copy(rt: SessionRuntime, offer: str) -> str | None:
    """Non-chief: the chief's local commit ``offer`` in this worker's own local tier, if
    it is there whole, with the same bytes (else ``None``)."""
    tier, logdir = rt.sv.local_tier, rt.sv.logdir
    if not offer or tier is None or logdir is None:
        return None
    return copy_in(offer, tier.tier_dir(logdir))


def _resume_rollback(rt: SessionRuntime, checkpointer: Checkpointer, path: str) -> None:
    """The head restored is a rollback's target whose new branch has no commit yet (a
    kill came between the rollback's record and that commit): the data goes on from the
    position the rollback moved it to, past the bad batch, as the record says."""
    history = checkpointer.catalog.history
    head = history.head_commit()
    moved = history.pending_position()
    if moved is None or head is None or checkpointer.store.path(head.name) != path:
        return
    rt.position.go_to(*moved)
    log.warning("checkpoint.rollback_resumed", path=path, data_position=list(moved))


def _restore_or_init(rt: SessionRuntime, max_wait_secs: float) -> RestoreReport:
    """Training thread: restore the newest checkpoint, or initialize."""
    sv, step = rt.sv, rt.step
    for hook in sv.hooks:
        hook.begin(sv)
    started = time.perf_counter()
    rt.makeup.before_restore()
    path, skipped = _choose(rt, max_wait_secs)
    rt.thread.check_fence()  # a restore given up on acts no further
    step.reload()
    rt.position.reload()
    deferred: tuple[str, str] | None = None
    if path is not None and rt.checkpointer is not None:
        checkpointer = rt.checkpointer
        checkpointer.restored(path)
        if checkpointer.last_restorer.migrated:
            log.warning("checkpoint.migrated", path=path, step=step.value)
        _resume_rollback(rt, checkpointer, path)
        waiting = unrestored(checkpointer.restore_status)
        if waiting is not None:
            # Objects not built yet take their values when they are built: checked
            # again after the first step, which builds them (SessionCheckpoints.check_deferred).
            deferred = (path, waiting)
            log.info("checkpoint.deferred", path=path, first_value=waiting)
        log.info(
            "checkpoint.restored",
            path=path,
            step=step.value,
            skipped=len(skipped),
            seconds=round(time.perf_counter() - started, 4),
            tier=checkpointer.restored_tier,
        )
        report = RestoreReport(
            RestoreSource.CHECKPOINT, path, step.value, tuple(skipped), checkpointer.restored_tier
        )
    else:
        source = RestoreSource.FRESH
        # Every worker of a multi-worker job holds its own copy of the variables.
        if sv.init_fn is not None and (sv.is_chief or sv.role is not None):
            sv.init_fn()
            rt.thread.check_fence()  # given up on while init_fn ran: it acts no further
            source = RestoreSource.INIT_FN
        report = RestoreReport(source, None, step.value, tuple(skipped))
    rt.began(report, deferred)
    return report
