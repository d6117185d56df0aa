"""StepCounterService: the training rate as ``global_step/sec``."""

from __future__ import annotations

import time

import anyio

from asupervisor import ManagedSession, logger

from ._checks import positive


class StepCounterService:
    """Every ``interval_secs``, writes steps per second under ``tag``; warns when
    training stalls.

    The first point is written only after the session's first step, and measures
    from it: start-up and a ``tf.function``'s tracing are not training speed, and
    before the first step there is nothing to call a stall. At the stop, the steps since
    the last point get one more (a short run has a rate too).
    """

    name = "step_counter"

    def __init__(self, interval_secs: float, *, tag: str = "global_step/sec") -> None:
        self.interval_secs = positive("interval_secs", interval_secs)
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, not {tag!r}")
        self.tag = tag

    async def run(self, sess: ManagedSession) -> None:
        first_step = sess.restore_report.step  # where the session began, not this service
        last: tuple[int, float] | None = None  # (step, time) of the last point
        quiet_since = anyio.current_time()
        stopping = False
        while not stopping:
            stopping = await sess.sleep_until_stop(self.interval_secs)
            if last is None:
                origin = sess.first_step_done
                if origin is None:
                    continue  # no step yet: tracing and filling buffers are not a stall
                last = (origin[0], origin[1] - time.monotonic() + anyio.current_time())
            step, now = sess.global_step, anyio.current_time()
            if step == last[0]:
                if step != first_step and not stopping:
                    logger.warning("step.stalled", step=step, seconds=round(now - quiet_since, 1))
                continue
            rate = (step - last[0]) / (now - last[1])
            # Written on the training thread: file I/O stays off the event loop.
            await sess.call(sess.summary_computed, {self.tag: rate}, step)
            last, quiet_since = (step, now), now
