"""When a session's first point is due (the summary and step-rate services)."""

from __future__ import annotations

import time

import anyio

from asupervisor import ManagedSession

# The first point comes this long after the session's first step ended (once a second
# step ran: never one step's value), or at the interval if that is sooner: a run
# shorter than the interval (the default two minutes) has its curves all the same.
FIRST_POINT_SECS = 5.0
POLL_SECS = 0.5  # how often a session whose steps are slow is looked at meanwhile


def first_step_at(sess: ManagedSession) -> tuple[int, float] | None:
    """``(step, time on the loop's clock)`` when the session's first step ended."""
    first = sess.first_step_done
    if first is None:
        return None
    return first[0], first[1] - time.monotonic() + anyio.current_time()


async def until_first_point(sess: ManagedSession, interval_secs: float) -> bool:
    """Sleep until the session's first point is due; ``True`` as soon as a stop is
    requested."""
    deadline = anyio.current_time() + interval_secs
    while True:
        now, first = anyio.current_time(), first_step_at(sess)
        if now >= deadline:
            return False
        wait = min(deadline - now, POLL_SECS)
        if first is not None:
            early = first[1] + FIRST_POINT_SECS
            if now >= early and sess.global_step > first[0]:
                return False
            wait = min(deadline - now, max(early - now, POLL_SECS if now >= early else 0.0))
        if await sess.sleep_until_stop(wait):
            return True
