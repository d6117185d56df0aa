"""CheckpointService: save a checkpoint every ``interval_secs``."""

from __future__ import annotations

import time

from asupervisor import ManagedSession

from ._checks import positive


class CheckpointService:
    """Saves at the first step boundary at least ``interval_secs`` after the last save
    (of any kind, or the session's start), by the wall clock: also while no step runs
    (the session idle between two steps). The final save on a clean stop is the
    session's. ``Supervisor(save_model_secs=)`` does not start it: its timed saves follow
    TF's ``CheckpointSaverHook`` exactly (at the end of the first step that ends past the
    deadline), on the training thread; start this one for saves by the clock alone.

    The save runs on the training thread at a step boundary, so it always captures
    the state of one step boundary (in a multi-worker job, after an agreed step). A
    failed save is tried again ``interval_secs`` after the attempt.
    """

    name = "checkpoint"

    def __init__(self, interval_secs: float) -> None:
        self.interval_secs = positive("interval_secs", interval_secs)

    async def run(self, sess: ManagedSession) -> None:
        attempted = time.monotonic()  # the session's start
        while True:
            last = sess.last_save
            since = attempted if last is None or last[1] is None else max(last[1], attempted)
            wait = since + self.interval_secs - time.monotonic()
            if wait > 0:
                if await sess.sleep_until_stop(wait):
                    return
                continue  # a save may have come meanwhile: it counts from there
            attempted = time.monotonic()
            await sess.save_checkpoint()
