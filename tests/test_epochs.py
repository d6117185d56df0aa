"""Epochs and the position inside them are saved: a resumed run goes on at the same batch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import asupervisor as asv
from tests import forked


def make(logdir: str, **objects: Any) -> asv.Supervisor:
    return asv.Supervisor(
        logdir,
        checkpoint=objects,
        save_model_secs=0,
        save_model_steps=4,
        save_summaries_secs=0,
        handle_signals=False,
    )


@pytest.mark.asyncio
async def test_train_with_epochs_resumes_at_the_same_batch_after_a_crash(logdir: str) -> None:
    v = tf.Variable(0.0)
    data = tf.data.Dataset.range(10)  # one epoch: the batches 0..9
    seen: list[tuple[int, int]] = []

    def step(batch: tf.Tensor) -> None:
        seen.append((int(v.numpy()) // 10, int(batch)))  # (epoch by count, batch)
        v.assign_add(1.0)

    with pytest.raises(RuntimeError, match="crash"):
        async with make(logdir, v=v).session() as sess:
            await sess.train(step, data, epochs=3, max_steps=14)
            raise RuntimeError("crash: no final save")  # as a kill: the last save was at 12
    assert sess.data_position == (1, 4)

    seen.clear()
    v.assign(0.0)
    async with make(logdir, v=v).session() as sess:
        assert sess.restore_report.step == 12 and sess.data_position == (1, 2)
        assert float(v.numpy()) == 12.0
        ran = await sess.train(step, data, epochs=3)
    assert ran == 18 and sess.global_step == 30 and sess.data_position == (3, 0)
    assert [b for _, b in seen] == [*range(2, 10), *range(10)]  # epoch 1 from batch 2, epoch 2


@pytest.mark.asyncio
async def test_the_position_is_saved_as_one_value_and_an_older_checkpoints_five_are_still_read(
    tmp_path: Path,
) -> None:
    """A save writes the position as one string (TF's write costs per variable); a
    checkpoint of the older layout, a variable each in two objects, resumes where it was."""
    older_dir, logdir = str(tmp_path / "older"), str(tmp_path / "run")
    v = tf.Variable(14.0)
    position, fit = tf.Module(), tf.Module()
    position.epoch = tf.Variable(1, dtype=tf.int64)
    position.batch = tf.Variable(4, dtype=tf.int64)
    fit.epoch_batches = tf.Variable(10, dtype=tf.int64)
    fit.stopped = tf.Variable(0, dtype=tf.int64)
    fit.logs = tf.Variable('{"loss": 0.5}')
    older = tf.train.Checkpoint(
        root=tf.train.Checkpoint(v=v),
        global_step=tf.Variable(14, dtype=tf.int64),
        data_position=position,
        fit_state=fit,
    )
    _ = older.save_counter  # as every checkpoint the supervisor writes has
    tf.compat.v1.train.update_checkpoint_state(older_dir, older.write(f"{older_dir}/model.ckpt-14"))

    seen: list[int] = []

    def step(batch: tf.Tensor) -> None:
        seen.append(int(batch))
        v.assign_add(1.0)

    v.assign(0.0)
    async with make(older_dir, v=v).session() as sess:
        assert sess.restore_report.step == 14 and sess.data_position == (1, 4)
        await sess.train(step, tf.data.Dataset.range(10), epochs=3, max_steps=2)
    assert seen == [4, 5] and float(v.numpy()) == 16.0

    async with make(logdir, v=v).session() as sess:
        await sess.train(step, tf.data.Dataset.range(10), epochs=3, max_steps=12)
    saved = dict(tf.train.list_variables(tf.train.latest_checkpoint(logdir)))
    assert "data_place/json/.ATTRIBUTES/VARIABLE_VALUE" in saved
    assert not [k for k in saved if k.startswith(("data_position/", "fit_state/"))]
    async with make(logdir, v=v).session() as sess:
        assert sess.restore_report.step == 12 and sess.data_position == (1, 2)


@pytest.mark.asyncio
async def test_a_function_of_the_epoch_is_called_with_each_epoch(logdir: str) -> None:
    v = tf.Variable(0.0)
    epochs: list[int] = []

    def data(epoch: int) -> tf.data.Dataset:
        epochs.append(epoch)
        return tf.data.Dataset.range(5).shuffle(5, seed=epoch)  # the same order again

    async with make(logdir, v=v).session() as sess:
        await sess.train(lambda batch: v.assign_add(1.0), data, epochs=2)
    assert epochs == [0, 1] and sess.global_step == 10


def model_and_data() -> tuple[keras.Model, keras.optimizers.Optimizer, tf.data.Dataset]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=4, decay_rate=0.5)
    opt = keras.optimizers.SGD(schedule)
    model.compile(optimizer=opt, loss="mse")
    x = np.arange(64 * 4, dtype="float32").reshape(64, 4) / 256.0
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(8)  # 8 batches
    return model, opt, data


class Record(keras.callbacks.Callback):
    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        self.epochs: list[int] = []
        self.batches = 0
        self.crash_at = crash_at

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epochs.append(epoch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches += 1
        if self.batches == self.crash_at:
            raise RuntimeError("crash in a callback")


@pytest.mark.asyncio
async def test_fit_resumes_at_the_exact_batch_with_optimizer_schedule_and_callbacks(
    logdir: str,
) -> None:
    model, opt, data = model_and_data()
    with pytest.raises(RuntimeError, match="crash"):
        async with make(logdir, model=model, opt=opt).session() as sess:
            await sess.fit(model, data, epochs=3, callbacks=[Record(crash_at=13)], verbose=0)
    # The last step-based save was at 12 = epoch 1, batch 4.

    model, opt, data = model_and_data()
    record = Record()
    sv = make(logdir, model=model, opt=opt)
    async with sv.session() as sess:
        assert sess.restore_report.step == 12 and sess.data_position == (1, 4)
        history = await sess.fit(model, data, epochs=3, callbacks=[record], verbose=0)
    assert record.epochs == [1, 2]  # Keras' callbacks see the epochs that ran
    assert record.batches == 4 + 8  # the rest of epoch 1, then epoch 2: nothing twice
    assert sess.global_step == 24 and int(opt.iterations.numpy()) == 24
    assert int(sv.global_step.numpy()) == 24  # fit's deferred steps are in the variable
    assert sess.data_position == (3, 0)
    assert np.isclose(float(opt.learning_rate), 0.1 * 0.5 ** (24 / 4))  # the schedule goes on
    assert history.epoch == [1, 2] and len(history.history["loss"]) == 2
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-24")


@pytest.mark.asyncio
async def test_fit_is_refused_for_data_it_cannot_resume_into(logdir: str) -> None:
    model, opt, _ = model_and_data()
    async with make(logdir, model=model, opt=opt).session() as sess:
        with pytest.raises(ValueError, match=r"tf\.data\.Dataset"):
            await sess.fit(model, np.zeros((8, 4)), epochs=1)
        with pytest.raises(ValueError, match="initial_epoch"):
            await sess.fit(model, tf.data.Dataset.range(1), epochs=1, initial_epoch=2)


@pytest.mark.asyncio
async def test_fit_runs_under_a_mirrored_strategy(logdir: str) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model, opt, data = model_and_data()
    sv = asv.Supervisor(
        logdir,
        checkpoint={"model": model, "opt": opt},
        strategy=strategy,
        save_model_secs=0,
        save_model_steps=4,
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        await sess.fit(model, data, epochs=2, verbose=0)
    assert sess.global_step == 16 and sess.data_position == (2, 0)
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-16")


EPOCH_TRAINER = """
import sys
import time

import anyio
import tensorflow as tf

import asupervisor as asv

v = tf.Variable(0.0)


def step(batch):
    time.sleep(0.01)  # slow enough for a kill to land inside an epoch
    v.assign_add(1.0)
    print(f"ran batch {int(batch)}", flush=True)


async def main() -> None:
    sv = asv.Supervisor(
        sys.argv[1], checkpoint={"v": v}, save_model_secs=0, save_model_steps=4,
        save_summaries_secs=0,
    )
    async with sv.session() as sess:
        epoch, batch = sess.data_position
        print(f"starting at epoch {epoch} batch {batch} step {sess.global_step} "
              f"v {v.numpy():.0f}", flush=True)
        await sess.train(step, tf.data.Dataset.range(10), epochs=int(sys.argv[2]))


anyio.run(main)
"""


@pytest.mark.slow
def test_train_with_epochs_killed_mid_epoch_resumes_at_the_same_batch(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    logdir = str(tmp_path / "run")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}

    def start(epochs: int) -> forked.Popen:
        return forked.Popen(
            [sys.executable, "-c", EPOCH_TRAINER, logdir, str(epochs)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip

    run = start(1000)
    assert run.stdout is not None
    ran = 0
    for line in run.stdout:
        ran += line.startswith("ran batch")
        if ran == 27:  # inside the third epoch, 3 batches past the save at step 24
            run.kill()
            break
    run.wait(60)
    again = start(4)
    out, _ = again.communicate(timeout=120)
    assert again.returncode == 0, out[-3000:]
    found = re.search(r"starting at epoch (\d+) batch (\d+) step (\d+) v (\d+)", out)
    assert found, out[-3000:]
    epoch, batch, step, v = (int(g) for g in found.groups())
    assert 24 <= step <= 27 and step % 4 == 0  # the last checkpoint before the kill
    assert (epoch, batch) == divmod(step, 10) and v == step  # the same batch, the same state
    batches = [int(b) for b in re.findall(r"ran batch (\d+)", out)]
    assert batches[0] == batch  # it goes on at that batch of that epoch
    assert len(batches) == 40 - step  # to the end of epoch 4: nothing twice, nothing skipped


@pytest.mark.asyncio
async def test_a_recovered_error_inside_train_epochs_takes_the_data_back_with_the_state(
    logdir: str,
) -> None:
    v = tf.Variable(0.0)
    per_epoch: dict[int, int] = {}
    failed: list[int] = []

    def step(batch: tf.Tensor) -> None:
        epoch = int(v.numpy()) // 8
        if int(v.numpy()) == 13 and not failed:  # once, in the middle of epoch 1
            failed.append(13)
            raise tf.errors.UnavailableError(None, None, "a flaky device")
        v.assign_add(1.0)
        per_epoch[epoch] = per_epoch.get(epoch, 0) + 1

    async with make(logdir, v=v).session() as sess:  # saves every 4 steps: 12 is on disk
        ran = await sess.train(step, tf.data.Dataset.range(8), epochs=3)
    assert failed and sess.global_step == 24 and sess.data_position == (3, 0)
    assert float(v.numpy()) == 24.0
    # Restored to step 12 = (1, 4): epoch 1 again from its batch 4, not from where it was.
    assert per_epoch == {0: 8, 1: 8 + 1, 2: 8}  # the one step at 12 ran twice: it was undone
    assert ran == 25  # every step that ran, the undone one too


@pytest.mark.asyncio
async def test_an_iterator_that_runs_out_once_is_refused_with_epochs(logdir: str) -> None:
    v = tf.Variable(0.0)
    async with make(logdir, v=v).session() as sess:
        for data in (iter(tf.data.Dataset.range(4)), iter(range(4)), (i for i in range(4))):
            with pytest.raises(ValueError, match="iterator"):
                await sess.train(lambda b: v.assign_add(1.0), data, epochs=3)
        assert sess.global_step == 0
