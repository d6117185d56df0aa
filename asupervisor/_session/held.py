"""The end of a session whose event loop is held past the stop's grace.

Code that blocks the event loop (``time.sleep`` in a service, a long computation in the
body) holds everything that runs there, the stop path included, and no thread can
interrupt it. Once the loop watch (``loopwatch.py``) has seen the grace spent with the
loop still held, this ends the process from the watch thread, bounded, in the order a
stop would have: the final checkpoint on the training thread if it is idle (it is the
only thread that saves; a job still running there was given the grace already), the
session's ending decided as stuck (124), its end line and last beat written, then the
process ends (``os._exit``: the loop's thread would never return to anything else).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from .. import _exit
from .._kinds import JobKind
from .._log import log
from .._training.thread import Job
from .shutdown import unsaved_steps
from .stoppath import RECORD_SECS

if TYPE_CHECKING:
    from .runtime import SessionRuntime

SAVE_SECS = 5.0  # what the final save gets once the grace is spent


def end_held(rt: SessionRuntime, held_by: str, where: str, stack: str) -> None:
    """On the loop watch's thread: end the process whose loop ``held_by`` holds."""
    stop = rt.stop
    job = f"the event loop, held by {held_by} at {where}"
    with contextlib.suppress(Exception):
        log.error(
            "loop.held",
            held_by=held_by,
            where=where,
            grace_secs=rt.sv.stop_grace_secs,
            stack=stack,
            hint="code on the event loop blocked it past the stop's grace: the process "
            "ends stuck; run such code with anyio.to_thread",
        )
    ending = stop.ending
    if ending is None:  # else the close had decided it: that ending is recorded
        saved = _final_save(rt)
        heard = None if rt.signals is None or not rt.signals.received else rt.signals.received[0]
        ending = stop.held(
            job,
            heard,
            step=rt.step.value,
            unsaved_steps=unsaved_steps(rt),
            last_saved_step=None if rt.checkpointer is None else rt.checkpointer.last_saved_step,
        )
        _exit.ended(ending)
        with contextlib.suppress(Exception):
            log.error(
                "session.stopped",
                step=ending.step,
                reason=str(ending.reason),
                outcome=ending.outcome.value,
                exit_status=ending.exit_status,
                stuck_step=ending.stuck_job,
                unsaved_steps=ending.unsaved_steps,
                final_checkpoint=saved,
            )
    rt.presence.record_now(ending, RECORD_SECS)
    _exit.end_process(ending)


def _final_save(rt: SessionRuntime) -> bool:
    """The final checkpoint, on the training thread, if the session saves, stopped
    cleanly and nothing runs there; at most ``SAVE_SECS``."""
    sv = rt.sv
    if not (rt.ready and sv.checkpointing and rt.checkpointer is not None):
        return False
    if rt.flag.error is not None or not rt.thread.idle():
        return False
    return rt.thread.run_beside(Job(rt.save_final, kind=JobKind.INTERNAL), SAVE_SECS)
