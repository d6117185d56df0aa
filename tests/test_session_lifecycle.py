"""The session's lifecycle: the training thread, services beside it, graceful stop."""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from tests.conftest import Pair, named

pytestmark = pytest.mark.asyncio


def quick(logdir: str | None, **kwargs: Any) -> asv.Supervisor:
    """A supervisor with sub-second intervals; no checkpoints unless asked."""
    kwargs.setdefault("save_model_secs", 0)
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("stop_grace_secs", 2)
    kwargs.setdefault("handle_signals", False)
    return asv.Supervisor(logdir, **kwargs)


async def test_every_step_runs_on_one_thread_that_is_not_the_loops(pair: Pair) -> None:
    sv = quick(None, checkpoint={"pair": pair})
    seen: set[int] = set()

    def step() -> None:
        seen.add(threading.get_ident())
        pair.step()

    async with sv.session() as sess:
        for _ in range(20):
            await sess.run(step)
        await sess.call(lambda: seen.add(threading.get_ident()))
    assert len(seen) == 1
    assert threading.get_ident() not in seen
    assert float(pair.a.numpy()) == 20.0


async def test_a_service_ticks_during_a_half_second_step() -> None:
    sv = quick(None)
    ticks: list[float] = []
    step_window: list[float] = []

    @sv.service
    async def ticker(sess: asv.ManagedSession) -> None:
        while not await sess.sleep_until_stop(0.02):
            ticks.append(time.monotonic())

    def slow_step() -> None:
        step_window.append(time.monotonic())
        time.sleep(0.5)
        step_window.append(time.monotonic())

    async with sv.session() as sess:
        await sess.run(slow_step)
    start, end = step_window
    during = [t for t in ticks if start < t < end]
    assert len(during) >= 10, f"the loop was blocked: {len(during)} ticks during the step"


async def test_a_step_error_reaches_the_caller_unchanged_and_stops_everything() -> None:
    sv = quick(None)
    boom = ValueError("bad batch")
    service_saw_stop = anyio.Event()

    @sv.service
    async def watcher(sess: asv.ManagedSession) -> None:
        await sess.sleep_until_stop(60)
        service_saw_stop.set()

    def failing_step() -> None:
        raise boom

    with pytest.raises(ValueError) as raised:
        async with sv.session() as sess:
            await sess.run(failing_step)
    assert raised.value is boom
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "failing_step" in frames
    assert service_saw_stop.is_set()
    assert sess.stop_reason == "exception"


async def test_a_service_error_reaches_the_caller_unchanged_and_cancels_the_body() -> None:
    sv = quick(None)
    boom = RuntimeError("service broke")

    @sv.service
    async def broken(sess: asv.ManagedSession) -> None:
        await anyio.sleep(0.1)
        raise boom

    body_cancelled = []
    with pytest.raises(RuntimeError) as raised:
        async with sv.session():
            try:
                await anyio.sleep(600)  # the body never checks should_stop
            except anyio.get_cancelled_exc_class():
                body_cancelled.append(True)
                raise
    assert raised.value is boom
    assert "broken" in [f.name for f in traceback.extract_tb(raised.value.__traceback__)]
    # Bound by what happened, not by the clock (a loaded machine only delays it): the body's
    # sleep was cancelled, not waited out.
    assert body_cancelled == [True]


async def test_a_body_error_is_reraised_as_the_same_object() -> None:
    sv = quick(None)
    boom = KeyError("mine")
    with pytest.raises(KeyError) as raised:
        async with sv.session():
            raise boom
    assert raised.value is boom


async def test_a_service_that_ignores_stop_is_cancelled_after_the_grace_period(
    events: list[dict[str, Any]],
) -> None:
    sv = quick(None, stop_grace_secs=0.3)
    cancelled = []

    @sv.service
    async def stubborn(sess: asv.ManagedSession) -> None:
        try:
            await anyio.sleep(600)
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise

    async with sv.session() as sess:
        await anyio.sleep(0.05)
        stopped = time.monotonic()
    elapsed = time.monotonic() - stopped
    assert cancelled == [True]
    assert 0.25 <= elapsed < 60  # the grace, then cancelled: not the service's 600 s
    assert sess.stop_reason == "requested"
    assert named(events, "service.cancelled")


async def test_a_stuck_step_gives_grace_period_expired_within_about_the_grace() -> None:
    sv = quick(None, stop_grace_secs=0.3)

    @sv.service
    async def stopper(sess: asv.ManagedSession) -> None:
        await anyio.sleep(0.1)
        sess.request_stop()

    finished = threading.Event()

    def stuck_step() -> None:
        time.sleep(10)
        finished.set()

    with pytest.raises(asv.GracePeriodExpired, match="stuck_step") as raised:
        async with sv.session() as sess:
            await sess.run(stuck_step)
    # Bound by what happened: the session ended while the 10 s step was still running.
    assert not finished.is_set(), "waited for the stuck step instead of the grace"
    assert raised.value.__cause__ is None
    assert sess.stop_reason == "requested"


async def test_a_stuck_step_after_an_error_names_the_error_as_cause() -> None:
    sv = quick(None, stop_grace_secs=0.3)
    boom = OSError("service lost its socket")

    @sv.service
    async def broken(sess: asv.ManagedSession) -> None:
        await anyio.sleep(0.1)
        raise boom

    with pytest.raises(asv.GracePeriodExpired) as raised:
        async with sv.session() as sess:
            await sess.run(time.sleep, 3)
    assert raised.value.__cause__ is boom


async def test_end_of_data_inside_a_step_is_a_clean_stop(pair: Pair) -> None:
    sv = quick(None, checkpoint={"pair": pair})
    data = iter(range(3))

    def step() -> None:
        try:
            next(data)
        except StopIteration:
            raise tf.errors.OutOfRangeError(None, None, "End of sequence") from None
        pair.step()

    async with sv.session() as sess:
        while True:
            await sess.run(step)
    assert sess.stop_reason == "end_of_data"
    assert sess.global_step == 3


async def test_request_stop_and_sleep_until_stop() -> None:
    sv = quick(None)
    async with sv.session() as sess:
        assert await sess.sleep_until_stop(0.01) is False
        assert sess.stop_reason is None and not sess.should_stop()
        sess.request_stop()
        assert sess.should_stop() and sv.should_stop()
        assert await sess.sleep_until_stop(60) is True
    assert sess.stop_reason == "requested"


async def test_call_runs_on_the_training_thread_without_counting_a_step(pair: Pair) -> None:
    sv = quick(None, checkpoint={"pair": pair})
    async with sv.session() as sess:
        await sess.run(pair.step)
        value = await sess.call(lambda: float(pair.a.numpy()))
        assert value == 1.0
        assert sess.global_step == 1
        await sess.call(pair.step)
        assert sess.global_step == 1


async def test_between_steps_holds_the_training_thread(pair: Pair) -> None:
    sv = quick(None, checkpoint={"pair": pair})
    async with sv.session() as sess, anyio.create_task_group() as tg:
        async with sess.between_steps():
            tg.start_soon(sess.run, pair.step)
            await anyio.sleep(0.2)
            assert float(pair.a.numpy()) == 0.0, "a step ran while the thread was held"
        await anyio.sleep(0.01)
        with anyio.fail_after(120):
            while sess.global_step < 1:
                await anyio.sleep(0.01)


async def test_the_session_can_be_reopened_but_not_nested() -> None:
    sv = quick(None)
    async with sv.session() as sess:
        with pytest.raises(RuntimeError, match="already has an open session"):
            async with sv.session():
                pass
    assert sess.stop_reason == "requested"
    async with sv.session() as again:
        assert not again.should_stop()


async def test_a_cancellation_from_outside_ends_the_session_at_once(
    logdir: str, pair: Pair
) -> None:
    sv = quick(logdir, checkpoint={"pair": pair}, save_model_secs=60)
    with anyio.CancelScope() as outer:
        async with sv.session() as sess:
            while True:
                await sess.run(pair.step)
                if sess.global_step == 3:  # some steps in, whatever the machine's load
                    outer.cancel()
    assert outer.cancelled_caught
    steps = sess.global_step
    assert steps > 0
    # no final save on cancellation: only the initial checkpoint (step 0) exists
    state = tf.train.get_checkpoint_state(logdir)
    assert [int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths] == [0]


async def test_lifecycle_events_are_logged(events: list[dict[str, Any]], pair: Pair) -> None:
    sv = quick(None, checkpoint={"pair": pair})
    async with sv.session() as sess:
        await sess.run(pair.step)
    started = named(events, "session.started")
    assert started and started[0]["step"] == 0 and started[0]["restored_from"] is None
    assert named(events, "stop.requested")[0]["reason"] == "requested"
    stopped = named(events, "session.stopped")
    assert stopped and stopped[0]["step"] == 1 and stopped[0]["reason"] == "requested"
