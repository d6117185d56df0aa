"""A diverging loss rolls the run back to its last healthy checkpoint, past the batch that
diverged, with no person involved; too many rollbacks end it with DivergedError."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import plugin_event_accumulator

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.asyncio

BATCHES = 10


def regression(poisoned: set[int]) -> tf.data.Dataset:
    """Batches of a line to fit; the batch indices in ``poisoned`` hold a NaN."""
    xs = tf.linspace(0.0, 1.0, BATCHES)
    bad = tf.constant([i in poisoned for i in range(BATCHES)])
    xs = tf.where(bad, tf.fill([BATCHES], math.nan), xs)
    return tf.data.Dataset.from_tensor_slices((xs, 3.0 * tf.linspace(0.0, 1.0, BATCHES) + 1.0))


class Line(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(0.0)
        self.b = tf.Variable(0.0)
        self.seen: list[tuple[int, float]] = []  # (batch index, loss), as trained

    def step(self, x: tf.Tensor, y: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = (self.w * x + self.b - y) ** 2
        dw, db = tape.gradient(loss, [self.w, self.b])
        self.w.assign_sub(0.1 * dw)
        self.b.assign_sub(0.1 * db)
        self.seen.append((len(self.seen), float(loss)))
        return {"loss": loss}


def supervisor(logdir: str, line: Line, policy: asv.Rollback, **kwargs: Any) -> asv.Supervisor:
    return asv.Supervisor(
        logdir,
        checkpoint={"line": line},
        save_model_secs=0,
        save_model_steps=3,
        save_summaries_secs=0,
        save_summaries_steps=1,
        on_divergence=policy,
        handle_signals=False,
        **kwargs,
    )


async def test_a_nan_at_a_known_batch_rolls_back_skips_it_and_training_finishes(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    line = Line()
    sv = supervisor(logdir, line, asv.Rollback(skip=1))

    def data(epoch: int) -> tf.data.Dataset:
        return regression(poisoned={7} if epoch == 0 else set())  # one bad batch in the run

    async with sv.session() as sess:
        await sess.train(line.step, data, epochs=3)
    # Step 8 trained batch 7 and diverged; the run went back to step 6 (healthy) and on
    # from batch 9: batches 6 and 7 (since the checkpoint) and 8 (skip=1) are skipped.
    (diverged,) = named(events, "step.diverged")
    assert diverged["step"] == 8 and diverged["reason"] == "non-finite"
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["step"] == 6 and back["data_position"] == [0, 9]
    assert sess.stop_reason == "requested" and sess.outcome is asv.Outcome.DONE
    assert math.isfinite(float(line.w.numpy())) and math.isfinite(float(line.b.numpy()))
    assert sess.data_position == (3, 0) and sess.global_step == 6 + 1 + 2 * BATCHES
    curve = [loss for _, loss in line.seen]
    print("loss curve, in training order:", [round(x, 4) for x in curve])
    assert math.isnan(curve[7]) and all(math.isfinite(x) for x in curve[8:])
    assert curve[-1] < curve[0]  # it trained on, and learned
    # No checkpoint of non-finite state was ever committed.
    state = tf.train.get_checkpoint_state(logdir)
    for path in state.all_model_checkpoint_paths:
        reader = tf.train.load_checkpoint(path)
        assert math.isfinite(reader.get_tensor("line/w/.ATTRIBUTES/VARIABLE_VALUE"))
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    (marker,) = acc.Tensors("rollback/diverged_at_step")
    assert marker.step == 7 and float(tf.make_ndarray(marker.tensor_proto)) == 8.0


async def test_too_many_divergences_end_the_run_with_an_error_that_says_what_happened(
    logdir: str,
) -> None:
    line = Line()
    sv = supervisor(logdir, line, asv.Rollback(max_rollbacks=2))
    with pytest.raises(asv.DivergedError, match=r"after 2 rollbacks \(max_rollbacks=2\)") as raised:
        async with sv.session() as sess:
            # Every batch from 4 on is poisoned: each rollback meets another.
            await sess.train(line.step, regression(poisoned=set(range(4, BATCHES))), epochs=2)
    assert "model.ckpt-3" in str(raised.value)
    assert sess.outcome is asv.Outcome.FAILED_PERMANENTLY


async def test_a_loss_spike_rolls_back_too(logdir: str, events: list[dict[str, Any]]) -> None:
    v = tf.Variable(0.0)
    data = [1.0] * 20 + [1000.0] + [1.0] * 9

    def step(loss: float) -> dict[str, Any]:
        v.assign_add(1.0)
        return {"loss": tf.constant(loss)}

    sv = asv.Supervisor(
        logdir, checkpoint={"v": v}, save_model_secs=0, save_model_steps=5, save_summaries_secs=0,
        on_divergence=asv.Rollback(spike_factor=10, window=10), handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.train(step, data, epochs=1)
    (diverged,) = named(events, "step.diverged")
    assert diverged["reason"] == "spike" and diverged["step"] == 21
    assert sess.data_position == (1, 0) and float(v.numpy()) == sess.global_step


async def test_without_a_policy_a_nan_is_trained_through_as_before(logdir: str) -> None:
    line = Line()
    sv = asv.Supervisor(
        logdir, checkpoint={"line": line}, save_model_secs=0, save_summaries_secs=0,
        handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.train(line.step, regression(poisoned={2}), epochs=1)
    assert math.isnan(float(line.w.numpy()))
    assert os.path.exists(logdir)


async def test_fit_rolls_back_past_a_diverging_batch_and_goes_on(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=False)
    x = np.linspace(0, 1, 80, dtype="float32").reshape(-1, 1)

    def data(epoch: int) -> tf.data.Dataset:
        xs = x.copy()
        if epoch == 1:
            xs[44:48] = np.nan  # batch 5 of epoch 1 diverges
        return tf.data.Dataset.from_tensor_slices((xs, 2 * x + 1)).batch(8)  # 10 batches

    sv = asv.Supervisor(
        logdir, checkpoint={"model": model, "opt": model.optimizer}, save_model_secs=0,
        save_model_steps=4, save_summaries_secs=0, on_divergence=asv.Rollback(),
        handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        history = await sess.fit(model, data, epochs=3, verbose=0)
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["diverged_at"] == 16 and back["step"] == 12 and back["data_position"] == [1, 6]
    assert sess.data_position == (3, 0)
    assert all(math.isfinite(v) for v in history.history["loss"])  # the epochs after it
    assert all(
        math.isfinite(float(w)) for w in np.concatenate([v.ravel() for v in model.get_weights()])
    )
