"""sess.train: the fast path runs the loop on the training thread and keeps every promise of run."""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor.hooks import StopAtStepHook
from tests.conftest import Pair

pytestmark = pytest.mark.asyncio


def make(logdir: str | None, pair: Pair, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("handle_signals", False)
    return asv.Supervisor(logdir, checkpoint={"p": pair}, **kwargs)


async def test_train_runs_each_element_and_the_session_goes_on(pair: Pair) -> None:
    seen: list[tuple[Any, ...]] = []
    threads: set[int] = set()

    def step(x: int, y: str) -> dict[str, float]:
        seen.append((x, y))
        threads.add(threading.get_ident())
        pair.step()
        return {"loss": float(x)}

    async with make(None, pair).session() as sess:
        assert await sess.train(step, [(1, "a"), (2, "b"), (3, "c")]) == 3
        assert not sess.should_stop()  # exhausted data is not a stop: the next epoch
        assert await sess.train(step, [(4, "d")]) == 1
        assert sess.global_step == 4
    assert seen == [(1, "a"), (2, "b"), (3, "c"), (4, "d")]
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_train_takes_a_tf_data_dataset_and_passes_non_tuples_whole(pair: Pair) -> None:
    dicts: list[int] = []
    dataset = tf.data.Dataset.range(5).map(lambda i: {"i": i})
    async with make(None, pair).session() as sess:
        n = await sess.train(lambda batch: dicts.append(int(batch["i"])), dataset)
    assert n == 5 and dicts == [0, 1, 2, 3, 4]


async def test_max_steps_and_stop_requests_end_train_early(pair: Pair) -> None:
    async with make(None, pair).session() as sess:
        assert await sess.train(pair.step, iter(lambda: (), None), max_steps=7) == 7
        forever = iter(lambda: (), None)  # an endless stream of empty tuples
        sess.loop(0.1, sess.request_stop)  # first call at once: stop during the loop
        n = await sess.train(pair.step, forever)
    assert sess.stop_reason == "requested" and sess.global_step == 7 + n


async def test_hooks_and_step_limits_work_in_train(logdir: str, pair: Pair) -> None:
    sv = make(logdir, pair, hooks=[StopAtStepHook(last_step=25)])
    async with sv.session() as sess:
        n = await sess.train(pair.step, iter(lambda: (), None))
    assert n == 25 and sess.stop_reason == "step_limit"
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-25")


async def test_end_of_data_inside_a_step_stops_the_session(pair: Pair) -> None:
    iterator = iter(tf.data.Dataset.range(3))

    @tf.function
    def step() -> tf.Tensor:
        return iterator.get_next()  # raises OutOfRangeError after 3

    async with make(None, pair).session() as sess:
        n = await sess.train(step, iter(lambda: (), None))
    assert n == 3 and sess.stop_reason == "end_of_data"


async def test_saves_during_train_hold_one_step_boundary(logdir: str) -> None:
    pair = Pair()

    def half_step() -> None:
        pair.a.assign_add(1.0)
        time.sleep(0.01)
        pair.b.assign_add(1.0)

    sv = make(logdir, pair, save_model_secs=0.02, max_to_keep=None)
    async with sv.session() as sess:
        await sess.train(half_step, iter(lambda: (), None), max_steps=60)
    indexes = list(Path(logdir).glob("model.ckpt-*.index"))
    assert len(indexes) >= 5
    for index in indexes:
        reader = tf.train.load_checkpoint(str(index)[: -len(".index")])
        a, b = (reader.get_tensor(f"p/{n}/.ATTRIBUTES/VARIABLE_VALUE") for n in "ab")
        assert a == b == int(index.name.split("-")[1].split(".")[0])


async def test_between_steps_and_call_reach_the_training_thread_during_train(pair: Pair) -> None:
    async with make(None, pair).session() as sess, anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(sess.train, pair.step, iter(lambda: (), None)))
        await anyio.sleep(0.1)
        async with sess.between_steps():
            held = sess.global_step
            await anyio.sleep(0.1)
            assert sess.global_step == held  # nothing ran while held
        values = await sess.call(lambda: (float(pair.a.numpy()), float(pair.b.numpy())))
        assert values[0] == values[1]
        sess.request_stop()


async def test_a_hung_step_inside_train_is_caught_by_the_watchdog() -> None:
    sv = asv.Supervisor(None, step_timeout_secs=0.2, stop_grace_secs=0.2, handle_signals=False)
    calls = iter(range(100))

    def step() -> None:
        if next(calls) == 3:
            time.sleep(600)

    started = time.monotonic()
    with pytest.raises(asv.StepTimeout, match="step"):
        async with sv.session() as sess:
            await sess.train(step, iter(lambda: (), None))
    assert time.monotonic() - started < 300  # caught, not waited for (the step takes 600 s)
    assert sess.global_step == 3


async def test_max_steps_is_checked(pair: Pair) -> None:
    async with make(None, pair).session() as sess:
        with pytest.raises(ValueError, match="max_steps"):
            await sess.train(pair.step, [()], max_steps=0)


@pytest.mark.asyncio
async def test_a_fused_step_traces_no_more_often_than_the_users_function() -> None:
    v = tf.Variable(0.0)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def step(batch: tf.Tensor) -> tf.Tensor:
        v.assign_add(tf.reduce_sum(batch))
        return v

    sv = asv.Supervisor(None, save_summaries_secs=0, handle_signals=False)
    async with sv.session() as sess:
        for size in range(1, 31):  # 30 shapes: the signature covers them all
            await sess.run(step, tf.ones([size]))
        fused, counted_in_graph = sess._rt.stepper.prepared(step)
    assert counted_in_graph and sess.global_step == 30
    assert step.experimental_get_tracing_count() == 1
    assert fused.experimental_get_tracing_count() == 1  # not once per shape


@pytest.mark.asyncio
async def test_a_thousand_partials_leave_the_step_cache_bounded() -> None:
    v = tf.Variable(0.0)
    alive: list[weakref.ref[Any]] = []
    sv = asv.Supervisor(None, save_summaries_secs=0, handle_signals=False)
    async with sv.session() as sess:
        for i in range(1_000):  # far more than the cache may keep
            call = functools.partial(v.assign_add, float(i % 3))  # a new callable per step
            alive.append(weakref.ref(call))
            await sess.run(call)
            del call
    assert sess.global_step == 1_000
    gc.collect()
    assert sum(ref() is not None for ref in alive) <= 64  # the cache keeps a few, not all
