"""SummaryService: write ``summary_fn()``'s values every ``interval_secs``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from asupervisor import ManagedSession, logger

from ._checks import positive


class SummaryService:
    """Evaluates ``summary_fn`` on the training thread (a step boundary, off the loop)
    and writes its values at the global step; once more after the last step."""

    name = "summary"

    def __init__(self, interval_secs: float, summary_fn: Callable[[], Mapping[str, Any]]) -> None:
        self.interval_secs = positive("interval_secs", interval_secs)
        self.summary_fn = summary_fn

    def _write(self, sess: ManagedSession) -> None:
        values = self.summary_fn()
        if not isinstance(values, Mapping):
            raise TypeError(f"summary_fn must return a mapping of tag to value, not {values!r}")
        sess.summary_computed(values)
        logger.debug("summary.written", step=sess.global_step, tags=sorted(values))

    async def run(self, sess: ManagedSession) -> None:
        while not await sess.sleep_until_stop(self.interval_secs):
            await sess.call(self._write, sess)
        # Queued behind the in-flight step, so it records the final state.
        await sess.call(self._write, sess)
