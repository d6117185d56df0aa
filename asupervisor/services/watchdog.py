"""WatchdogService: a step that runs too long is reported, with every thread's stack."""

from __future__ import annotations

import sys
import threading
import time
import traceback

from asupervisor import ManagedSession, StepTimeout, logger

from ._checks import positive


def thread_stacks() -> dict[str, str]:
    """Every thread's current stack, by thread name: what a hung step is doing."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        f"{names.get(ident, 'unknown')} ({ident})": "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    }


class WatchdogService:
    """Stops training with ``StepTimeout`` (reason ``timeout``) when one job on the
    training thread (a step with its hooks, a save, a call) runs longer than
    ``timeout_secs``, after logging every thread's stack."""

    name = "watchdog"

    def __init__(self, timeout_secs: float) -> None:
        self.timeout_secs = positive("timeout_secs", timeout_secs)
        # Check often enough that a timeout is seen within a quarter of it (at most 1 s late).
        self.check_every = min(self.timeout_secs / 4, 1.0)

    async def run(self, sess: ManagedSession) -> None:
        while not await sess.sleep_until_stop(self.check_every):
            running = sess.job_in_flight()
            if running is None:
                continue
            name, since = running
            elapsed = time.monotonic() - since
            if elapsed > self.timeout_secs:
                logger.error(
                    "step.timeout",
                    step=sess.global_step,
                    job=name,
                    seconds=round(elapsed, 2),
                    timeout_secs=self.timeout_secs,
                    stacks=thread_stacks(),
                )
                error = StepTimeout(
                    f"step {name!r} has run {elapsed:.1f} s, longer than "
                    f"step_timeout_secs={self.timeout_secs}"
                )
                sess.request_stop(error, reason="timeout")
                return
