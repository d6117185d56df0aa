"""A session's end: close what it opened, off the event loop and bounded, decide how it
ended (once: its ``Ending``), record that, then raise what it ended with.

The checkpoint writer, the events file, the cluster agreement and the training thread
are closed in worker threads, each waited for at most what is left of the grace period
(a moment once it has passed); the ledger line and the last beat are written while the
session still holds the logdir, and its lock goes last, once nothing of the session can
write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .. import _exit
from .._log import log
from .signals import hand_on
from .stopping import describe_error

if TYPE_CHECKING:
    from .runtime import SessionRuntime


async def close(rt: SessionRuntime) -> None:
    """Close what the session opened, off the event loop and bounded; the lock goes
    last, once nothing of the session can still write."""
    stop = rt.stop
    rt.flag.unbind()
    rt.services.close()  # no service starts in a session that is over
    rt.thread.stop()  # jobs still queued are dropped; a running one is fenced
    # The last events: written (or said lost) before the ending is decided, which seals
    # the stop flag: a failure reported after it could only be logged.
    lost = await _off_loop(rt.events.close, stop.closing())
    if lost is not None:  # the last events could not be written: said, not lost silently
        rt.fail(lost)
    checkpointer = rt.checkpointer
    if checkpointer is not None:
        if not stop.interrupted:
            done = await _off_loop(checkpointer.wait_for_write, stop.closing(), stop.closing())
            if not done and rt.flag.error is None:
                log.error("checkpoint.write_unfinished", grace_secs=rt.sv.stop_grace_secs)
            if done:  # the final save is local first; the mirror copies it in what is left
                await _off_loop(checkpointer.finish_mirror, stop.closing(), stop.closing())
        checkpointer.close()  # no copy to the logdir begins any more (what is left is said)
        rt.checkpoints.saves_done(hooks=False)  # on disk now: not counted as lost
    ending = stop.end(
        step=rt.step.value,
        unsaved_steps=unsaved_steps(rt),
        last_saved_step=None if checkpointer is None else checkpointer.last_saved_step,
    )
    _exit.ended(ending)
    # The last beat and the ledger's end line, while this session still holds the logdir.
    await rt.presence.close(ending, stop.recording())
    # Only now, with the session's end on record, is a signal the program's: a second
    # SIGINT until here was this session's (its "now"), never a KeyboardInterrupt
    # raised by the program's handler into the middle of the close.
    if rt.signals is not None:
        rt.signals.restore()
    if rt.agreement is not None:
        await _off_loop(rt.agreement.close, stop.closing())
    await _off_loop(rt.guard.close, stop.closing())  # an object store's lease: I/O, off the loop
    if stop.stuck is None and not stop.interrupted:
        await _off_loop(rt.thread.join, stop.closing(), stop.closing())
    rt.coord.close_session()
    rt.loopwatch.stop()  # it bounds a loop held during the close too: it goes last
    stop.closed()
    # Stop signals that came while it stopped: for a handler of the application's own.
    hand_on(stop.late_signals)
    with contextlib.suppress(Exception):
        log.info(
            "session.stopped",
            step=ending.step if rt.ready else None,  # before its restore: no step of the run
            reason=str(ending.reason),
            outcome=ending.outcome.value,
            exit_status=ending.exit_status,
            error=describe_error(ending.error),
            stuck_step=ending.stuck_job,
            unsaved_steps=ending.unsaved_steps,
            signal=ending.signal,
        )


def unsaved_steps(rt: SessionRuntime) -> int:
    """Steps run since the last good save, if this process saves (they are lost now)."""
    return rt.stepper.unsaved if rt.checkpointer is not None and rt.sv.checkpointing else 0


def raise_outcome(rt: SessionRuntime) -> None:
    """Raise what the session's ending says it raises (nothing for a clean end), or the
    ``KeyboardInterrupt`` of a second SIGINT that came once it was decided."""
    heard = rt.signals is not None and rt.signals.interrupted
    raised = rt.stop.exit_error(second_interrupt=heard)
    if raised is not None:
        raise raised


async def _off_loop(fn: Callable[..., Any], timeout: float, *args: Any) -> Any:
    """Run blocking ``fn`` in a worker thread, waiting at most ``timeout`` seconds."""
    with anyio.move_on_after(timeout):
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
    return None
