"""A session's end: close what it opened, off the event loop and bounded, then raise
what it ended with.

The events file, the cluster agreement, the checkpoint writer and the training
thread are closed in worker threads, each waited for at most what is left of the
grace period; the logdir lock goes last, once nothing of the session can write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .. import _exit
from .._errors import GracePeriodExpired, StepTimeout
from .._kinds import Phase
from .._log import log
from .signals import redeliver
from .stopping import describe_error

if TYPE_CHECKING:
    from .runtime import SessionRuntime


async def close(rt: SessionRuntime) -> None:
    """Close what the session opened, off the event loop and bounded; the lock goes
    last, once nothing of the session can still write."""
    rt.enter(Phase.CLOSING)
    rt.flag.unbind()
    rt.services.close()  # no service starts in a session that is over
    if rt.signals is not None:
        rt.signals.restore()
    rt.loopwatch.stop()
    rt.thread.stop()  # jobs still queued are dropped; a running one is fenced
    wait = 0.0 if rt.interrupted else max(rt.grace_left(), 0.1)
    lost = await _off_loop(rt.events.close, wait)
    if lost is not None:  # the last events could not be written: said, not lost silently
        rt.fail(lost)
    if rt.agreement is not None:
        await _off_loop(rt.agreement.close, wait)
    checkpointer = rt.checkpointer
    if checkpointer is not None:
        done = await _off_loop(checkpointer.wait_for_write, wait, wait)
        if not done and rt.flag.error is None:
            log.error("checkpoint.write_unfinished", grace_secs=rt.sv.stop_grace_secs)
        rt.checkpoints.saves_done(hooks=False)  # on disk now: not counted as lost
    # The last beat and the ledger's end line, while this session still holds the logdir.
    await rt.presence.close(
        rt.ending(),
        wait,
        step=rt.step.value,
        reason=str(rt.flag.reason),
        error=describe_error(rt.flag.error),
        unsaved_steps=unsaved_steps(rt),
    )
    await _off_loop(rt.guard.close, wait)  # an object store's lease: I/O, off the loop
    if rt.stuck is None and not rt.interrupted:
        await _off_loop(rt.thread.join, wait, wait)
    rt.coord.close_session()
    rt.enter(Phase.CLOSED)
    if rt.outcome is not None:
        _exit.ended(rt.outcome, rt.flag.error)
    with contextlib.suppress(Exception):
        outcome = rt.outcome
        log.info(
            "session.stopped",
            step=rt.step.value,
            reason=str(rt.flag.reason),
            outcome=None if outcome is None else outcome.value,
            error=describe_error(rt.flag.error),
            stuck_step=rt.stuck,
            unsaved_steps=unsaved_steps(rt),
        )


def unsaved_steps(rt: SessionRuntime) -> int:
    """Steps run since the last good save, if this process saves (they are lost now)."""
    return rt.stepper.unsaved if rt.checkpointer is not None and rt.sv.checkpointing else 0


def raise_outcome(rt: SessionRuntime) -> None:
    redeliver(rt.late_signals)
    unsaved = unsaved_steps(rt)
    checkpointer = rt.checkpointer
    last = None if checkpointer is None else checkpointer.last_saved_step
    lost = f"{unsaved} step(s) since the last checkpoint (step {last}) were not saved"
    if rt.interrupted:
        raise KeyboardInterrupt(f"a second SIGINT: stopped at once; {lost}")
    if rt.cancelled is not None:
        raise rt.cancelled
    error: Any = rt.flag.error
    if rt.stuck is not None and not isinstance(error, StepTimeout):
        raise GracePeriodExpired(
            f"{rt.stuck!r} was still running {rt.sv.stop_grace_secs} s "
            f"(stop_grace_secs) after the stop; no final checkpoint was written: {lost}"
        ) from error
    if error is not None:
        if unsaved and hasattr(error, "add_note"):
            error.add_note(f"asupervisor: {lost}")
        raise error


async def _off_loop(fn: Callable[..., Any], timeout: float, *args: Any) -> Any:
    """Run blocking ``fn`` in a worker thread, waiting at most ``timeout`` seconds."""
    with anyio.move_on_after(timeout):
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
    return None
