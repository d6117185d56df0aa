"""sess.train(steps_per_loop=K): K steps in one tf.function call, every promise kept at the
boundary of a call: one summary point per step, divergence found at its own step, saves
and stops at boundaries, a resume from a boundary bitwise equal to the run left alone."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import plugin_event_accumulator

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.anyio


class Line(tf.Module):
    """Fits a line; its step is a tf.function that also writes a summary of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(0.0)
        self.b = tf.Variable(0.0)

    @tf.function
    def step(self, x: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((self.w * x + self.b - y) ** 2)
        dw, db = tape.gradient(loss, [self.w, self.b])
        self.w.assign_sub(0.1 * dw)
        self.b.assign_sub(0.1 * db)
        tf.summary.scalar("inside", loss)
        return {"loss": loss}


def line_data(batches: int, poisoned: int | None = None) -> tf.data.Dataset:
    xs = tf.linspace(0.0, 1.0, batches)
    if poisoned is not None:
        xs = tf.where(tf.range(batches) == poisoned, math.nan, xs)
    return tf.data.Dataset.from_tensor_slices((xs, 3.0 * tf.linspace(0.0, 1.0, batches) + 1.0))


def supervisor(logdir: str, line: Line, **kwargs: Any) -> asv.Supervisor:
    settings: dict[str, Any] = {
        "save_model_secs": 0,
        "save_model_steps": 10,
        "save_summaries_secs": 0,
        "handle_signals": False,
    }
    return asv.Supervisor(logdir, checkpoint={"line": line}, **{**settings, **kwargs})


def steps_of(logdir: str, tag: str) -> list[int]:
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    return [e.step for e in acc.Tensors(tag)]


async def test_with_ten_steps_per_call_the_summaries_hold_one_point_per_step(
    logdir: str,
) -> None:
    line = Line()
    async with supervisor(logdir, line, save_summaries_steps=1).session() as sess:
        # 25 batches an epoch: the epoch ends inside a call, which ends there.
        ran = await sess.train(line.step, line_data(25), epochs=2, steps_per_loop=10)
    assert ran == 50 and sess.global_step == 50 and sess.data_position == (2, 0)
    assert steps_of(logdir, "loss") == list(range(1, 51))  # the supervisor's, per step
    assert steps_of(logdir, "inside") == list(range(1, 51))  # the step's own, at its step
    # Saves at the first boundary at or after each 10 steps: 10, 20, (epoch end at 25)
    # 35, 45, and the final one.
    saved = tf.train.get_checkpoint_state(logdir).all_model_checkpoint_paths
    assert [int(p.rsplit("-", 1)[1]) for p in saved][-3:] == [35, 45, 50]


async def test_a_nan_at_step_37_of_a_call_covering_30_to_39_is_reported_as_37_and_rolled_back(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    line = Line()
    policy = asv.Rollback()
    sv = supervisor(logdir, line, on_divergence=policy, save_summaries_steps=1)

    def data(epoch: int) -> tf.data.Dataset:
        return line_data(50, poisoned=36 if epoch == 0 else None)  # step 37 trains batch 36

    async with sv.session() as sess:
        await sess.train(line.step, data, epochs=1, steps_per_loop=10)
    (diverged,) = named(events, "step.diverged")
    assert diverged["step"] == 37 and diverged["reason"] == "non-finite"
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["step"] == 30 and back["data_position"] == [0, 37]
    # From step 30 on at batch 37: 13 batches left in the epoch.
    assert sess.global_step == 30 + 13 and sess.data_position == (1, 0)
    assert math.isfinite(float(line.w.numpy())) and math.isfinite(float(line.b.numpy()))


async def test_a_stop_during_a_call_waits_for_its_end_and_saves_at_its_boundary(
    logdir: str,
) -> None:
    line = Line()
    sv = supervisor(logdir, line)
    stop_at = 35  # inside the call of steps 31-40

    async with sv.session() as sess:

        def ask(step: Any) -> Any:
            if int(step) == stop_at:
                sess.request_stop()  # thread-safe, from inside the call
            return step

        @tf.function
        def step(x: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:
            out = line.step(x, y)
            now = tf.py_function(ask, [sv.global_step + 1], tf.int64)
            with tf.control_dependencies([now]):
                return {"loss": tf.identity(out["loss"])}

        ran = await sess.train(step, line_data(100), epochs=1, steps_per_loop=10)
    assert ran == 40 and sess.global_step == 40 and sess.data_position == (0, 40)
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-40")


def weights(line: Line) -> tuple[Any, Any]:
    return line.w.numpy(), line.b.numpy()


def shuffled(batches: int) -> tf.data.Dataset:
    return line_data(batches).shuffle(batches, seed=7).batch(3)


async def test_a_resume_after_a_stop_at_a_call_boundary_is_bitwise_the_run_left_alone(
    tmp_path: Any,
) -> None:
    alone = Line()
    async with supervisor(str(tmp_path / "alone"), alone).session() as sess:
        await sess.train(alone.step, shuffled(40), epochs=3, steps_per_loop=4)

    resumed = Line()
    logdir = str(tmp_path / "resumed")
    async with supervisor(logdir, resumed).session() as sess:
        # Stopped at the boundary after 8 steps, inside the first epoch (14 batches).
        assert (
            await sess.train(resumed.step, shuffled(40), epochs=3, steps_per_loop=4, max_steps=8)
            == 8
        )
    again = Line()
    async with supervisor(logdir, again).session() as sess:
        assert sess.data_position == (0, 8)
        await sess.train(again.step, shuffled(40), epochs=3, steps_per_loop=4)
    assert sess.global_step == 3 * 14
    np.testing.assert_array_equal(weights(again), weights(alone))


async def test_over_a_distributed_dataset_a_call_ends_where_the_data_ends(logdir: str) -> None:
    """A distributed iterator's end is the workers' to agree on (its optional, a
    ``tf.cond`` per step): the call ends at the epoch's last batch there too, each step
    counted and summarized at its own number."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    line = Line()

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:
        loss = strategy.run(lambda a, b: line.step(a, b)["loss"], args=(x, y))
        return {"loss": strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)}

    def data(epoch: int) -> Any:
        return strategy.experimental_distribute_dataset(line_data(25).batch(1))

    async with supervisor(logdir, line, save_summaries_steps=1).session() as sess:
        ran = await sess.train(step, data, epochs=2, steps_per_loop=10)
    assert ran == 50 and sess.global_step == 50 and sess.data_position == (2, 0)
    assert steps_of(logdir, "loss") == list(range(1, 51))


async def test_the_end_of_a_steps_own_data_inside_a_call_stops_the_session(logdir: str) -> None:
    """An end of data raised inside a step (the step's own iterator ran out) is not the
    loop's data ending: the session stops for the end of data, with the steps before it
    counted, as it does one step a call."""
    line = Line()
    own = iter(tf.data.Dataset.range(15))

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:
        extra = tf.cast(next(own), tf.float32) * 0.0  # raises at the 16th step
        return {"loss": line.step(x + extra, y)["loss"]}

    async with supervisor(logdir, line).session() as sess:
        await sess.train(step, line_data(40), epochs=1, steps_per_loop=10)
    assert sess.stop_reason == "end_of_data"
    assert sess.global_step == 15


async def test_a_step_that_raises_inside_a_call_leaves_the_steps_before_it_counted(
    logdir: str,
) -> None:
    """Step 16 raises in a call of steps 11 to 20: steps 11 to 15 trained, and are counted
    (the step, the data's place) before the error reaches the body."""
    line = Line()

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:
        return line.step(tf.debugging.check_numerics(x, "a bad batch"), y)

    with pytest.raises(tf.errors.InvalidArgumentError, match="a bad batch"):
        async with supervisor(logdir, line).session() as sess:
            await sess.train(step, line_data(40, poisoned=15), epochs=1, steps_per_loop=10)
    assert sess.global_step == 15 and sess.data_position == (0, 15)


async def test_steps_per_loop_is_checked_and_needs_a_dataset(pair: Any) -> None:
    async with asv.Supervisor(None, handle_signals=False).session() as sess:
        with pytest.raises(ValueError, match="steps_per_loop"):
            await sess.train(pair.step, [(), ()], steps_per_loop=0)
        with pytest.raises(ValueError, match=r"steps_per_loop > 1.*tf\.data\.Dataset"):
            await sess.train(pair.step, [(), ()], steps_per_loop=2)


async def test_a_second_train_call_with_the_same_step_does_not_trace_its_loop_again(
    logdir: str,
) -> None:
    line = Line()
    traced: list[int] = []

    def step(x: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:  # traced into the loop
        traced.append(1)  # Python runs only when TensorFlow traces
        return line.step(x, y)

    async with supervisor(logdir, line).session() as sess:
        await sess.train(step, line_data(20), steps_per_loop=5)
        after_first = len(traced)
        await sess.train(step, line_data(20), steps_per_loop=5)
    assert sess.global_step == 40 and len(traced) == after_first


def test_the_steps_of_a_call_counted_at_once_make_the_same_means_as_one_at_a_time() -> None:
    from asupervisor._training.means import FOLD_EVERY, ResultMeans

    values = np.random.default_rng(0).normal(size=FOLD_EVERY + 44).astype("float32")
    one, many = ResultMeans(), ResultMeans()
    for v in values[:7]:  # steps before the call, still kept unconverted
        one.add({"loss": tf.constant(v), "acc": tf.constant(2 * v)})
        many.add({"loss": tf.constant(v), "acc": tf.constant(2 * v)})
    for v in values[7:]:
        one.add({"loss": v, "acc": 2 * v})
    many.add_many({"loss": values[7:].tolist(), "acc": (2 * values[7:]).tolist()})
    assert one.take() == many.take()  # the same floats, summed in the same order


def test_finite_losses_of_a_call_join_the_window_at_once_and_a_nan_does_not() -> None:
    from asupervisor._training.divergence import LossWatch

    watch, alone = LossWatch(asv.Rollback(window=4)), LossWatch(asv.Rollback(window=4))
    assert watch.accepts_all([1.0, 2.0, 3.0, 4.0, 5.0])
    for loss in [1.0, 2.0, 3.0, 4.0, 5.0]:
        assert alone.diverges(loss) is None
    assert watch.state() == alone.state() == {"recent": [2.0, 3.0, 4.0, 5.0]}
    # A NaN (or any spike rule) needs the losses one at a time: the window is left as it was.
    assert not watch.accepts_all([6.0, math.nan])
    spiky = LossWatch(asv.Rollback(window=4, spike_factor=3.0))
    assert not spiky.accepts_all([1.0])
    assert watch.state()["recent"] == [2.0, 3.0, 4.0, 5.0] and spiky.state()["recent"] == []
