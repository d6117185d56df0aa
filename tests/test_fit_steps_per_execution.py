"""``sess.fit`` with Keras' ``compile(steps_per_execution=K)``: K batches in one call of
Keras' train function, and the session's promises at the boundary of each call: saves at
the first boundary at or after N, a stop waits for the call in flight, the data position
counts every batch, a divergence is found at the call's end and rolled back; the per-step
numbers are what Keras gives there (its logs after the call's last batch)."""

from __future__ import annotations

import glob
import math
import os
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.asyncio

K = 10


def data(batches: int, poisoned: int | None = None) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * 4, 4)).astype("float32")
    if poisoned is not None:
        x[poisoned * 4] = math.nan
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


def model_of(on_step: Any = None) -> keras.Model:
    """A line; ``on_step(step)`` is called from inside each step (the step it makes)."""

    class Line(keras.Sequential):
        def train_step(self, batch: Any) -> Any:
            if on_step is None:
                return super().train_step(batch)
            now = tf.py_function(on_step, [self.optimizer.iterations + 1], tf.int64)
            with tf.control_dependencies([now]):
                return super().train_step(batch)

    keras.utils.set_random_seed(0)
    model = Line([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=K,
                  jit_compile=False)  # fmt: skip
    return model


def supervisor(logdir: str, model: keras.Model, **kwargs: Any) -> asv.Supervisor:
    settings: dict[str, Any] = {
        "save_model_secs": 0,
        "save_model_steps": 15,
        "save_summaries_secs": 0,
        "handle_signals": False,
    }
    return asv.Supervisor(
        logdir, checkpoint={"model": model, "opt": model.optimizer}, **{**settings, **kwargs}
    )


def saved_steps(logdir: str) -> list[int]:
    state = tf.train.get_checkpoint_state(logdir)
    return [int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths]


def steps_of(logdir: str, tag: str) -> list[int]:
    (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    acc = EventAccumulator(path, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    if tag in tags.get("tensors", []):
        return [e.step for e in acc.Tensors(tag)]
    return [e.step for e in acc.Scalars(tag)]


async def test_ten_batches_a_call_save_at_boundaries_and_count_the_batches_of_a_short_call(
    logdir: str,
) -> None:
    """45 batches, 10 a call: Keras names the last call's batches 40..49 while it trains
    5; the session counts 45."""
    model = model_of()
    sv = supervisor(logdir, model, save_summaries_steps=1, max_to_keep=10)
    async with sv.session() as sess:
        await sess.fit(model, data(45), epochs=1, verbose=0)
    assert sess.global_step == 45 == int(model.optimizer.iterations.numpy())
    assert sess.data_position == (1, 0)
    # Every 15 steps, at the first boundary at or after: 20, then 40 (35 is inside the
    # call of 31..40), and the final save.
    assert saved_steps(logdir) == [0, 20, 40, 45]
    # One point a call, at its last step: Keras' logs after it (the running mean of the
    # epoch's loss); the steps inside a call give no numbers of their own to fit.
    assert steps_of(logdir, "loss") == [10, 20, 30, 40, 45]


async def test_a_stop_inside_a_call_of_ten_waits_for_its_end_and_saves_there(
    logdir: str,
) -> None:
    sessions: list[asv.ManagedSession] = []
    in_call: list[int] = []

    def on_step(step: Any) -> Any:
        if int(step) == 15:  # inside the call of steps 11..20
            in_call.append(sessions[0].steps_in_call())  # the step deadline's factor
            sessions[0].request_stop()
        return step

    model = model_of(on_step)
    async with supervisor(logdir, model, save_model_steps=1000).session() as sess:
        sessions.append(sess)
        await sess.fit(model, data(40), epochs=2, verbose=0)
    assert sess.global_step == 20 == int(model.optimizer.iterations.numpy())
    assert sess.data_position == (0, 20)
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-20")
    assert in_call == [K]


async def test_a_nan_inside_a_call_is_found_at_its_end_and_rolled_back(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """Batch 36 (step 37) is poisoned: fit's logs give the loss after the call of steps
    31..40 only, so the divergence is reported at 40, the end of the call it happened in,
    and rolled back to the commit before it; the data moves past the call."""
    model = model_of()
    policy = asv.Rollback()
    sv = supervisor(logdir, model, save_model_steps=10, on_divergence=policy)
    async with sv.session() as sess:
        await sess.fit(model, data(50, poisoned=36), epochs=1, verbose=0)
    (diverged,) = named(events, "step.diverged")
    assert diverged["step"] == 40 and diverged["reason"] == "non-finite"
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["step"] == 30 and back["data_position"] == [0, 40]
    assert back["batches_dropped"] == K
    # From step 30 at batch 40: the epoch's last 10 batches.
    assert sess.global_step == 40 and sess.data_position == (1, 0)
    assert all(math.isfinite(float(w)) for w in np.ravel(model.layers[0].kernel.numpy()))
