"""SummaryService: write ``summary_fn()``'s values every ``interval_secs``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from asupervisor import ManagedSession, logger

from ._checks import positive
from ._first import until_first_point


class SummaryService:
    """Evaluates ``summary_fn`` on the training thread (a step boundary, off the loop)
    and writes its values at the global step; once more after the last step. The
    session's first point comes early: ``FIRST_POINT_SECS`` (5 s) after its first step
    ended, once a second step ran (or at the interval, if sooner). Without a
    ``summary_fn``, it writes the steps' numeric results averaged over the interval
    (``fit``: Keras' logs, already running means)."""

    name = "summary"

    def __init__(
        self, interval_secs: float, summary_fn: Callable[[], Mapping[str, Any]] | None = None
    ) -> None:
        self.interval_secs = positive("interval_secs", interval_secs)
        self.summary_fn = summary_fn

    def _write(self, sess: ManagedSession, last: int) -> int:
        """On the training thread: write, if a step ran since ``last``; the step written."""
        step = sess.global_step
        if step == last:
            return last
        values = sess.mean_scalars() if self.summary_fn is None else self.summary_fn()
        sess.summary_computed(self._checked(values))
        logger.debug("summary.written", step=step, tags=sorted(values))
        return step

    @staticmethod
    def _checked(values: Any) -> Mapping[str, Any]:
        if not isinstance(values, Mapping):
            raise TypeError(f"summary_fn must return a mapping of tag to value, not {values!r}")
        return values

    async def run(self, sess: ManagedSession) -> None:
        # Only when a step ran since the last write: values of a session that has not
        # stepped yet (metrics just reset to 0) would be false points at the restart.
        last = sess.restore_report.step
        stopping = await until_first_point(sess, self.interval_secs)
        last = await sess.call(self._write, sess, last)
        while not stopping:
            stopping = await sess.sleep_until_stop(self.interval_secs)
            # After the stop this is queued behind the in-flight step: the final state.
            last = await sess.call(self._write, sess, last)
