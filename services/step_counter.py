"""StepCounterService: the training rate as ``global_step/sec``."""

from __future__ import annotations

import anyio

from asupervisor._log import log
from asupervisor._session import ManagedSession
from asupervisor._validate import positive


def rate_tag(variable: object, owned: bool) -> str:
    """``global_step/sec``, or named after the user's step variable, as TF does."""
    if owned:
        return "global_step/sec"
    name = str(getattr(variable, "name", "global_step")).split(":")[0]
    return f"{name}/sec"


class StepCounterService:
    """Every ``interval_secs``, writes steps per second; warns when training stalls;
    opens a new events file if the session's was deleted under it.

    No warning before the session's first step: tracing a ``tf.function`` or
    filling a data pipeline's buffers is slow, but it is not a stall.
    """

    name = "step_counter"

    def __init__(self, interval_secs: float) -> None:
        self.interval_secs = positive("interval_secs", interval_secs)

    async def run(self, sess: ManagedSession) -> None:
        sv = sess.supervisor
        tag = rate_tag(sv.global_step, sv._owns_global_step)
        first_step = sess.restore_report.step  # where the session began, not this service
        last_step, last_time = sess.global_step, anyio.current_time()
        while not await sess.sleep_until_stop(self.interval_secs):
            if sess._events_file_lost():
                await sess.call(sess._renew_events_file)
            step, now = sess.global_step, anyio.current_time()
            if step == last_step:
                if step != first_step:
                    log.warning("step.stalled", step=step, seconds=round(now - last_time, 1))
                continue
            rate = (step - last_step) / (now - last_time)
            sess.summary_computed({tag: rate}, step=step)
            last_step, last_time = step, now
