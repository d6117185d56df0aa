"""StepCounterService: the training rate as ``global_step/sec``; a stalled step said."""

from __future__ import annotations

import time

import anyio
import anyio.abc

from asupervisor import ManagedSession, logger

from ._checks import positive
from ._first import first_step_at, until_first_point

STALL_FACTOR = 10  # a step this many times the session's mean step time is stalled


class StepCounterService:
    """Every ``interval_secs``, writes steps per second under ``tag``; warns when a
    training step is stalled.

    The first point is written only after the session's first step, and measures
    from it (or from a save that came after it: a restarted run saves early, and a save
    is not training speed either): start-up and a ``tf.function``'s tracing are not
    training speed. It comes early, as the summary service's does
    (``FIRST_POINT_SECS``, 5 s, after the first step). At the
    stop, the steps since the last point get one more (a short run has a rate too).

    A step is *stalled* when the training step running now (``sess.step_in_flight()``)
    has run longer than both ``interval_secs`` and ``STALL_FACTOR`` (10) times the
    session's mean step time since its first step (10 times ``interval_secs`` while no
    mean is known yet): ``step.stalled`` is logged once for it, with how long it has
    run. A run whose steps are all slow is not stalled; nor is start-up, the first step
    (tracing), a save, a call, ``fit``'s validation or an epoch's end, or a body that
    runs no step for a while.
    """

    name = "step_counter"

    def __init__(self, interval_secs: float, *, tag: str = "global_step/sec") -> None:
        self.interval_secs = positive("interval_secs", interval_secs)
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty string, not {tag!r}")
        self.tag = tag

    async def _write(self, sess: ManagedSession, rate: float, step: int) -> None:
        await sess.call(sess.summary_computed, {self.tag: rate}, step)
        logger.debug("step_rate.written", step=step, rate=rate)

    def threshold(self, mean_step_secs: float | None) -> float:
        """How long a training step runs before it is stalled."""
        if mean_step_secs is None:
            return STALL_FACTOR * self.interval_secs
        return max(self.interval_secs, STALL_FACTOR * mean_step_secs)

    async def run(self, sess: ManagedSession) -> None:
        # A point is written on the training thread (file I/O stays off the event loop),
        # after the step in flight: in a task of its own, so that a stalled step does not
        # hold the watch for stalls.
        async with anyio.create_task_group() as writes:
            await self._count(sess, writes)

    async def _count(self, sess: ManagedSession, writes: anyio.abc.TaskGroup) -> None:
        origin: tuple[int, float] | None = None  # (step, time) after the first step
        last: tuple[int, float] | None = None  # (step, time) of the last point
        warned: float | None = None  # the start of the step last said to be stalled
        stopping = await until_first_point(sess, self.interval_secs)
        first_pass = True  # the first point is due now (early: see _first)
        while first_pass or not stopping:
            if not first_pass:
                stopping = await sess.sleep_until_stop(self.interval_secs)
            first_pass = False
            if origin is None:
                first = first_step_at(sess)
                if first is None:
                    continue  # no step yet: tracing and filling buffers are not a stall
                origin = last = after_save(sess, first)
            assert last is not None
            step, now = sess.global_step, anyio.current_time()
            if step != last[0]:
                rate = (step - last[0]) / (now - last[1])
                writes.start_soon(self._write, sess, rate, step)
                last = (step, now)
                continue
            since = sess.step_in_flight()
            if stopping or since is None or since == warned:
                continue
            ran = time.monotonic() - since
            moved = last[0] - origin[0]
            mean = (last[1] - origin[1]) / moved if moved > 0 else None
            if ran >= self.threshold(mean):
                warned = since
                logger.warning(
                    "step.stalled",
                    step=step,
                    seconds=round(ran, 1),
                    mean_step_secs=None if mean is None else round(mean, 4),
                )


def after_save(sess: ManagedSession, first: tuple[int, float]) -> tuple[int, float]:
    """Where the first rate counts from: the end of the first step, or of a save that
    came after it with steps since (the one a restarted run takes early on is not
    training speed). On the loop's clock."""
    saved = sess.last_save
    if saved is None or saved[1] is None:
        return first
    at = saved[1] - time.monotonic() + anyio.current_time()
    if at > first[1] and first[0] <= saved[0] < sess.global_step:
        return saved[0], at
    return first
