"""async_checkpoint=True: training is held only for the snapshot; files follow in the background."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor._logdir.verify import verify_checkpoint
from tests.conftest import Pair, named

pytestmark = pytest.mark.asyncio


def keras_setup() -> tuple[Any, Any, Any]:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    opt = keras.optimizers.Adam(0.01)
    x, y = tf.random.normal((32, 8), seed=1), tf.random.normal((32, 2), seed=2)

    @tf.function
    def step() -> dict[str, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return {"loss": loss}

    return model, opt, step


async def test_a_keras_model_saves_asynchronously_again_and_again(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    model, opt, step = keras_setup()
    sv = asv.Supervisor(
        logdir,
        checkpoint={"model": model, "opt": opt},
        global_step=opt.iterations,
        save_model_secs=0,
        save_model_steps=3,
        max_to_keep=None,
        async_checkpoint=True,
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(20):
            await sess.run(step)
    final = [w.numpy() for w in model.weights]
    saved = named(events, "checkpoint.saved")
    assert [e["step"] for e in saved] == [0, 3, 6, 9, 12, 15, 18, 20]
    assert all(e["blocked_seconds"] <= e["seconds"] for e in saved)
    for e in saved:
        assert verify_checkpoint(e["path"]) is None, e["path"]

    model2, opt2, _ = keras_setup()
    again = asv.Supervisor(
        logdir,
        checkpoint={"model": model2, "opt": opt2},
        global_step=opt2.iterations,
        handle_signals=False,
    )
    async with again.session() as sess:
        assert sess.restore_report.step == 20
        for restored, expected in zip(model2.weights, final, strict=True):
            np.testing.assert_array_equal(restored.numpy(), expected)


async def test_after_save_runs_on_the_training_thread_once_the_files_are_on_disk(
    logdir: str, pair: Pair
) -> None:
    seen: list[tuple[int, bool]] = []

    class Check(asv.Hook):
        def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
            seen.append((step, os.path.exists(path + ".index") and verify_checkpoint(path) is None))
            return False

    sv = asv.Supervisor(
        logdir,
        checkpoint={"p": pair},
        save_model_secs=0,
        save_model_steps=2,
        async_checkpoint=True,
        hooks=[Check()],
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(7):
            await sess.run(pair.step)
    assert [step for step, _ in seen] == [0, 2, 4, 6, 7]
    assert all(on_disk for _, on_disk in seen)


def saving_every_two_steps_except(
    logdir: str, pair: Pair, failing: tuple[int, ...], async_checkpoint: bool
) -> asv.Supervisor:
    """A supervisor saving every 2 steps, whose saves at the ``failing`` steps fail for
    real: a file stands where TF must create the save's temp directory."""
    os.makedirs(logdir)
    for step in failing:
        Path(logdir, f"model.ckpt-{step}_temp").write_text("in the way")
    return asv.Supervisor(
        logdir,
        checkpoint={"p": pair},
        save_model_secs=0,
        save_model_steps=2,
        max_to_keep=None,
        async_checkpoint=async_checkpoint,
        save_summaries_secs=0,
        handle_signals=False,
    )


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
async def test_failed_writes_are_counted_and_the_third_stops_training(
    logdir: str, pair: Pair, async_checkpoint: bool, events: list[dict[str, Any]]
) -> None:
    sv = saving_every_two_steps_except(logdir, pair, (4, 6, 8), async_checkpoint)
    with pytest.raises(asv.CheckpointSaveError, match="3 checkpoint saves in a row") as raised:
        async with sv.session() as sess:
            for _ in range(30):
                if sess.should_stop():
                    break
                await sess.run(pair.step)
    assert raised.value.__cause__ is not None
    failed = named(events, "checkpoint.failed")
    assert [e["step"] for e in failed] == [4, 6, 8]
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-2")
    assert verify_checkpoint(os.path.join(logdir, "model.ckpt-2")) is None


async def test_one_failed_write_is_retried_at_the_next_trigger(logdir: str, pair: Pair) -> None:
    sv = saving_every_two_steps_except(logdir, pair, (4,), async_checkpoint=True)
    async with sv.session() as sess:
        for _ in range(8):
            await sess.run(pair.step)
    steps = sorted(int(p.name.split("-")[1].split(".")[0]) for p in Path(logdir).glob("*.index"))
    assert steps == [0, 2, 6, 8]
    assert sess.stop_reason == "requested"


async def test_a_snapshot_under_a_strategy_holds_the_values_of_its_step_not_of_the_write(
    tmp_path: Path,
) -> None:
    """Under a distribution strategy TensorFlow describes a variable to save by a function
    that reads it when the file is written. The snapshot reads it at once: a background
    write that lands after the next step still holds the snapshot's step."""
    from asupervisor._checkpointing.async_save import take_snapshot, write_snapshot

    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        weight = tf.Variable(0.0)
    snapshot = take_snapshot(tf.train.Checkpoint(weight=weight))
    weight.assign_add(1.0)  # the next step, before the writer gets to the snapshot
    write_snapshot(snapshot, str(tmp_path / "ckpt"))
    assert (
        tf.train.load_variable(str(tmp_path / "ckpt"), "weight/.ATTRIBUTES/VARIABLE_VALUE") == 0.0
    )
