"""CheckpointService: save a checkpoint every ``interval_secs``."""

from __future__ import annotations

from asupervisor import ManagedSession

from ._checks import positive


class CheckpointService:
    """Saves every ``interval_secs``; the final save on a clean stop is the session's.

    The save runs on the training thread at a step boundary, so it always captures
    the state of one step boundary (in a multi-worker job, after an agreed step).
    """

    name = "checkpoint"

    def __init__(self, interval_secs: float) -> None:
        self.interval_secs = positive("interval_secs", interval_secs)

    async def run(self, sess: ManagedSession) -> None:
        while not await sess.sleep_until_stop(self.interval_secs):
            await sess.save_checkpoint()
