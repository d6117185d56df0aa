"""Service failure policies and user loops."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor.services import LoopService
from tests.conftest import named

pytestmark = pytest.mark.asyncio


def quick(**kwargs: Any) -> asv.Supervisor:
    return asv.Supervisor(
        None, save_summaries_secs=0, handle_signals=False, stop_grace_secs=1, **kwargs
    )


async def test_restart_policy_restarts_with_backoff_then_stops(
    events: list[dict[str, Any]],
) -> None:
    sv = quick()
    runs: list[float] = []
    boom = ConnectionError("flaky")

    class Flaky:
        name = "flaky"

        async def run(self, sess: asv.ManagedSession) -> None:
            runs.append(time.monotonic())
            raise boom

    from asupervisor._session.services import register

    sv._services.append(register(Flaky(), on_error="restart", max_restarts=2, backoff_secs=0.05))
    with pytest.raises(ConnectionError) as raised:
        async with sv.session() as sess:
            await sess.sleep_until_stop(10)
    assert raised.value is boom
    assert len(runs) == 3  # the first run and two restarts
    assert runs[2] - runs[1] >= runs[1] - runs[0] >= 0.04  # the backoff doubles
    failed = named(events, "service.failed")
    assert [e["action"] for e in failed] == ["restart", "restart", "stop"]
    assert all(e["service"] == "flaky" for e in failed)


async def test_restart_policy_recovers_a_service_that_fails_once() -> None:
    sv = quick()
    attempts: list[int] = []

    @sv.service(on_error="restart")
    async def once(sess: asv.ManagedSession) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("first time only")
        await sess.sleep_until_stop(60)

    async with sv.session() as sess:
        with anyio.fail_after(120):
            while len(attempts) < 2:
                await anyio.sleep(0.05)
        assert not sess.should_stop()
    assert sess.stop_reason == "requested"


async def test_log_policy_ends_only_that_service(events: list[dict[str, Any]]) -> None:
    sv = quick()
    ticks: list[int] = []

    @sv.service(on_error="log")
    async def fragile(sess: asv.ManagedSession) -> None:
        raise ValueError("ignored but logged")

    @sv.service
    async def steady(sess: asv.ManagedSession) -> None:
        while not await sess.sleep_until_stop(0.02):
            ticks.append(1)

    async with sv.session() as sess:
        await anyio.sleep(0.3)
        assert not sess.should_stop()
    assert len(ticks) >= 5
    failed = named(events, "service.failed")
    assert len(failed) == 1 and failed[0]["service"] == "fragile" and failed[0]["action"] == "end"
    assert "ignored but logged" in failed[0]["error"]


async def test_stop_policy_is_the_default_for_user_services() -> None:
    sv = quick()
    boom = LookupError("default policy")

    @sv.service
    async def failing(sess: asv.ManagedSession) -> None:
        raise boom

    with pytest.raises(LookupError) as raised:
        async with sv.session() as sess:
            await sess.sleep_until_stop(10)
    assert raised.value is boom and sess.stop_reason == "exception"


async def test_loop_calls_at_once_then_every_interval() -> None:
    sv = quick()
    calls: list[float] = []
    hourly: list[float] = []

    async def call() -> None:
        # On the loop, as it comes due: a plain target's worker thread may start late
        # under load, and its clock would show the schedule's jitter, not the schedule.
        calls.append(time.monotonic())

    sv.loop(0.1, call)
    sv.loop(3600, lambda: hourly.append(time.monotonic()))
    async with sv.session() as sess:
        started = time.monotonic()
        # Bound by what happened, not by the machine's speed (load only delays calls): an
        # hourly loop's first call comes long before its first hour.
        with anyio.fail_after(60):
            while not hourly or len(calls) < 3:
                await anyio.sleep(0.01)
        elapsed = time.monotonic() - started
    assert len(hourly) == 1
    assert len(calls) <= elapsed / 0.1 + 2, calls  # at most one call per interval: no burst
    for k, at in enumerate(calls):  # a fixed rate: the k-th call never before k intervals
        assert at - calls[0] >= k * 0.1 - 0.01, [b - a for a, b in itertools.pairwise(calls)]
    assert sess.stop_reason == "requested"


async def test_loop_runs_plain_targets_off_the_loop_and_awaits_coroutines() -> None:
    sv = quick()
    threads: list[int] = []
    coroutine_calls: list[str] = []

    async def tick(label: str, *, suffix: str) -> None:
        coroutine_calls.append(label + suffix)

    async with sv.session() as sess:
        sess.loop(0.05, lambda: threads.append(threading.get_ident()))
        sess.loop(0.05, tick, "a", suffix="!")
        await anyio.sleep(0.2)
    assert threads and threading.get_ident() not in threads
    assert coroutine_calls and set(coroutine_calls) == {"a!"}


async def test_a_failing_loop_target_stops_the_session() -> None:
    sv = quick()
    boom = ArithmeticError("target failed")

    def target() -> None:
        raise boom

    with pytest.raises(ArithmeticError) as raised:
        async with sv.session() as sess:
            sess.loop(0.05, target)
            await sess.sleep_until_stop(10)
    assert raised.value is boom


async def test_service_objects_and_start_service() -> None:
    sv = quick()
    names: list[str] = []

    class Named:
        name = "named-service"

        async def run(self, sess: asv.ManagedSession) -> None:
            names.append(self.name)

    assert isinstance(Named(), asv.Service)
    async with sv.session() as sess:
        sess.start_service(Named())
        await anyio.sleep(0.05)
    assert names == ["named-service"]
    assert LoopService(1, print).name == "loop:print"


async def test_a_service_failing_with_a_clean_stop_type_is_still_an_error() -> None:
    """OutOfRangeError from a broken service is a failure, not the end of the training data."""
    sv = quick()
    boom = tf.errors.OutOfRangeError(None, None, "the service's own dataset ran dry")

    @sv.service
    async def dry(sess: asv.ManagedSession) -> None:
        raise boom

    with pytest.raises(tf.errors.OutOfRangeError) as raised:
        async with sv.session() as sess:
            await sess.sleep_until_stop(10)
    assert raised.value is boom and sess.stop_reason == "exception"
