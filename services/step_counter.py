"""StepCounterService: the training rate as ``global_step/sec``."""

from __future__ import annotations

import anyio

from asupervisor import ManagedSession, logger

from ._checks import positive


class StepCounterService:
    """Every ``interval_secs``, writes steps per second under ``tag``; warns when
    training stalls.

    The first point is written only after the session's first step, and measures
    from it: start-up and a ``tf.function``'s tracing are not training speed, and
    before the first step there is nothing to call a stall.
    """

    name = "step_counter"

    def __init__(self, interval_secs: float, *, tag: str = "global_step/sec") -> None:
        self.interval_secs = positive("interval_secs", interval_secs)
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, not {tag!r}")
        self.tag = tag

    async def run(self, sess: ManagedSession) -> None:
        first_step = sess.restore_report.step  # where the session began, not this service
        last_step, last_time = sess.global_step, anyio.current_time()
        while not await sess.sleep_until_stop(self.interval_secs):
            step, now = sess.global_step, anyio.current_time()
            if step == last_step:
                if step != first_step:
                    logger.warning("step.stalled", step=step, seconds=round(now - last_time, 1))
                continue
            if last_step == first_step:
                # The first interval with steps: measure from here on.
                last_step, last_time = step, now
                continue
            rate = (step - last_step) / (now - last_time)
            # Written on the training thread: file I/O stays off the event loop.
            await sess.call(sess.summary_computed, {self.tag: rate}, step)
            last_step, last_time = step, now
