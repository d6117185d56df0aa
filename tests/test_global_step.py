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
