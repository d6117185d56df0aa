"""CheckpointService: save a checkpoint every ``interval_secs``."""

from __future__ import annotations

from asupervisor._session import ManagedSession
from asupervisor._validate import positive


class CheckpointService:
    """Saves every ``interval_secs``; the final save on a clean stop is the session's.

    The save runs as a job on the training thread, so it always captures the
    state of one step boundary.
    """

    name = "checkpoint"

    def __init__(self, interval_secs: float) -> None:
        self.interval_secs = positive("interval_secs", interval_secs)

    async def run(self, sess: ManagedSession) -> None:
        while not await sess.sleep_until_stop(self.interval_secs):
            await sess.call(sess._timed_save)
