"""The global step: the supervisor's own variable, or the user's."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import asupervisor as asv

pytestmark = pytest.mark.asyncio


async def test_the_supervisors_step_advances_once_per_successful_run() -> None:
    sv = asv.Supervisor(None, handle_signals=False, save_summaries_secs=0)
    async with sv.session() as sess:
        for _ in range(5):
            await sess.run(lambda: None)
        with pytest.raises(ValueError):
            await sess.run(lambda: (_ for _ in ()).throw(ValueError("failed step")))
    assert sess.global_step == 5
    assert int(sv.global_step.numpy()) == 5


async def test_steps_see_the_variable_already_advanced_by_earlier_steps() -> None:
    sv = asv.Supervisor(None, handle_signals=False, save_summaries_secs=0)
    seen: list[int] = []
    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(lambda: seen.append(int(sv.global_step.numpy())))
    assert seen == [0, 1, 2]


async def test_a_users_step_variable_is_read_not_advanced(logdir: str) -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.1)
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")

    @tf.function
    def train_step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(
            zip(
                tape.gradient(loss, model.trainable_variables),
                model.trainable_variables,
                strict=True,
            )
        )
        return loss

    sv = asv.Supervisor(
        logdir,
        checkpoint={"model": model, "opt": opt},
        global_step=opt.iterations,
        save_model_secs=60,
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(4):
            await sess.run(train_step)
        assert sess.global_step == 4
    assert int(opt.iterations.numpy()) == 4
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-4")


async def test_a_tf_function_step_sees_and_advances_the_step_as_a_plain_one_does() -> None:
    sv = asv.Supervisor(None, handle_signals=False, save_summaries_secs=0)
    counter = tf.Variable(0.0)

    @tf.function
    def step() -> tf.Tensor:
        counter.assign_add(1.0)
        return sv.global_step.read_value()  # the step before this one's increment

    def plain_step() -> int:
        return int(sv.global_step.numpy())

    async with sv.session() as sess:
        seen = [int(await sess.run(step)) for _ in range(3)]
        seen.append(await sess.run(plain_step))
        await sess.train(step, [(), (), ()])
        seen.append(int(await sess.run(step)))
    assert seen == [0, 1, 2, 3, 7]
    assert sess.global_step == int(sv.global_step.numpy()) == 8


async def test_a_failing_tf_function_step_does_not_count() -> None:
    sv = asv.Supervisor(None, handle_signals=False, save_summaries_secs=0)
    items = iter(tf.data.Dataset.range(2))

    @tf.function
    def step() -> tf.Tensor:
        return items.get_next()

    async with sv.session() as sess:
        n = await sess.train(step, iter(lambda: (), None))
    assert n == 2 and sess.stop_reason == "end_of_data"
    assert sess.global_step == int(sv.global_step.numpy()) == 2
