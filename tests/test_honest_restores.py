"""A restore is what it says: every value taken, or an error that says what to build first;
checkpoints another tool wrote are restored from, and never deleted."""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.asyncio


class Net(keras.Model):
    """The TF checkpoint guide's subclassed model: unbuilt until it is first called."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = keras.layers.Dense(5)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        return self.l1(x)


def trainer(model: keras.Model, opt: keras.optimizers.Optimizer) -> Any:
    x = tf.ones((4, 3))

    @tf.function
    def step() -> dict[str, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        opt.apply_gradients(
            zip(
                tape.gradient(loss, model.trainable_variables),
                model.trainable_variables,
                strict=True,
            )
        )
        return {"loss": loss}

    return step


def supervisor(logdir: str, **objects: Any) -> asv.Supervisor:
    return asv.Supervisor(
        logdir,
        checkpoint=objects,
        save_model_secs=0,
        save_model_steps=1000,
        save_summaries_secs=0,
        handle_signals=False,
    )


# Keras warns that the duplicate kernel it made gets no gradient: the very symptom.
@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")
async def test_an_unbuilt_subclassed_model_is_an_error_not_a_silent_fresh_start(
    logdir: str,
) -> None:
    model, opt = Net(), keras.optimizers.Adam(0.1)
    async with supervisor(logdir, model=model, opt=opt).session() as sess:
        step = trainer(model, opt)
        for _ in range(3):
            await sess.run(step)
    saved = [w.numpy() for w in model.weights]

    model, opt = Net(), keras.optimizers.Adam(0.1)  # not built: restored deferred
    with pytest.raises(asv.CheckpointMismatchError, match=r"not fully restored.*Build the model"):
        async with supervisor(logdir, model=model, opt=opt).session() as sess:
            assert sess.restore_report.source == "checkpoint"
            await sess.run(trainer(model, opt))
    # Nothing was saved over the good checkpoint.
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(logdir))
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-3")
    kernel = next(k for k in reader.get_variable_to_shape_map() if "kernel" in k and "opt" not in k)
    assert np.allclose(reader.get_tensor(kernel), saved[0])


async def test_a_built_model_with_an_unbuilt_optimizer_restores_whole(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    def built() -> keras.Model:
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(5)])

    model, opt = built(), keras.optimizers.Adam(0.1)
    async with supervisor(logdir, model=model, opt=opt).session() as sess:
        step = trainer(model, opt)
        for _ in range(3):
            await sess.run(step)
    momentum = [v.numpy() for v in opt.variables if "momentum" in v.path]
    with tf.GradientTape() as tape:  # the gradient the next step will see
        loss = tf.reduce_mean(model(tf.ones((4, 3))) ** 2)
    gradient = tape.gradient(loss, model.trainable_variables)[0].numpy()

    model2, opt2 = built(), keras.optimizers.Adam(0.1)  # the optimizer builds on its first step
    async with supervisor(logdir, model=model2, opt=opt2).session() as sess:
        assert named(events, "checkpoint.deferred")  # its slots were waiting...
        await sess.run(trainer(model2, opt2))  # ...and were taken: no error
    restored = [v for v in opt2.variables if "momentum" in v.path]
    # Adam's momentum after one more step from the restored one (beta_1 = 0.9), not from 0.
    assert np.allclose(restored[0].numpy(), 0.9 * momentum[0] + 0.1 * gradient, atol=1e-6)
    assert int(opt2.iterations.numpy()) == 4


async def test_checkpoints_of_a_checkpoint_manager_are_restored_and_never_deleted(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    v = tf.Variable(0.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), logdir, max_to_keep=None)
    for value in (1.0, 2.0):
        v.assign(value)
        manager.save()  # ckpt-1, ckpt-2: another tool's names
    v.assign(-1.0)

    sv = asv.Supervisor(
        logdir,
        checkpoint={"v": v},
        save_model_secs=0,
        save_model_steps=1,
        max_to_keep=1,
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        assert sess.restore_report.path == os.path.join(logdir, "ckpt-2")
        assert float(v.numpy()) == 2.0  # the run went on from it, not from scratch
        for _ in range(5):
            await sess.run(v.assign_add, 1.0)
    assert named(events, "checkpoint.migrated")
    names = set(os.listdir(logdir))
    for foreign in ("ckpt-1", "ckpt-2"):  # the supervisor's sweep never touched them
        assert f"{foreign}.index" in names
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-5")

    async with sv.session() as sess:  # and the next run resumes from its own
        assert sess.restore_report.path.endswith("model.ckpt-5")


async def test_checkpoint_manager_checkpoints_matching_a_custom_basename_are_migrated(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """``checkpoint_basename="ckpt"`` over ``tf.train.CheckpointManager``'s ``ckpt-1``...:
    the names look like the supervisor's own, the contents (no global step) do not: a
    migration (the global step left as it is), and those files are never swept."""
    v = tf.Variable(0.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=v), logdir, max_to_keep=None)
    for value in (1.0, 2.0):
        v.assign(value)
        manager.save()  # ckpt-1, ckpt-2
    v.assign(-1.0)
    sv = asv.Supervisor(
        logdir,
        checkpoint={"v": v},
        checkpoint_basename="ckpt",
        save_model_secs=0,
        save_model_steps=1,
        max_to_keep=1,
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        assert sess.restore_report.path == os.path.join(logdir, "ckpt-2")
        assert float(v.numpy()) == 2.0 and sess.restore_report.step == 0
        for _ in range(4):
            await sess.run(v.assign_add, 1.0)
    assert named(events, "checkpoint.migrated")
    names = set(os.listdir(logdir))
    for foreign in ("ckpt-1", "ckpt-2"):  # migrated from: never swept
        assert f"{foreign}.index" in names
    assert tf.train.latest_checkpoint(logdir).endswith("ckpt-4")
    async with sv.session() as sess:  # the next run resumes from its own
        assert sess.restore_report.path.endswith("ckpt-4") and sess.restore_report.step == 4
