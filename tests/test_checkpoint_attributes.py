"""A checkpoint saves what the user's tf.train.Checkpoint holds at the save, as
`ckpt.save()` would, and restores into what it holds at the restore (issue 25)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

import asupervisor as asv
from tests import forked


def saved(path: str, name: str) -> float:
    return float(tf.train.load_checkpoint(path).get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE"))


def make(logdir: str, ckpt: tf.train.Checkpoint, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_secs", 0)
    kwargs.setdefault("save_model_steps", 1)
    return asv.Supervisor(
        logdir, checkpoint=ckpt, save_summaries_secs=0, handle_signals=False, **kwargs
    )


@pytest.mark.asyncio
async def test_attributes_reassigned_or_added_after_construction_are_saved_as_they_are(
    logdir: str,
) -> None:
    v = tf.Variable(1.0)
    ckpt = tf.train.Checkpoint(v=v)
    ckpt.w = tf.Variable(5.0)
    sv = make(logdir, ckpt)
    ckpt.w = tf.Variable(7.0)  # reassigned after construction
    ckpt.extra = tf.Variable(9.0)  # added after construction
    async with sv.session() as sess:
        await sess.run(v.assign_add, 1.0)
    latest = tf.train.latest_checkpoint(logdir)
    assert saved(latest, "w") == 7.0 and saved(latest, "extra") == 9.0 and saved(latest, "v") == 2
    # Nothing set on it but TF's own counter of saves, as ckpt.save() would make it.
    children = sorted(dict(tf.train.TrackableView(ckpt).children(ckpt)))
    assert children == ["extra", "save_counter", "v", "w"]


@pytest.mark.asyncio
async def test_an_attribute_reassigned_between_two_saves_is_saved_new_at_the_second(
    logdir: str,
) -> None:
    v = tf.Variable(0.0)
    ckpt = tf.train.Checkpoint(v=v, w=tf.Variable(1.0))
    async with make(logdir, ckpt).session() as sess:
        await sess.run(v.assign_add, 1.0)  # saved at 1
        ckpt.w = tf.Variable(2.0)
        await sess.run(v.assign_add, 1.0)  # saved at 2
    assert saved(os.path.join(logdir, "model.ckpt-1"), "w") == 1.0
    assert saved(os.path.join(logdir, "model.ckpt-2"), "w") == 2.0


@pytest.mark.asyncio
async def test_a_restore_goes_into_the_objects_the_attributes_name_at_restore_time(
    logdir: str,
) -> None:
    ckpt = tf.train.Checkpoint(v=tf.Variable(0.0), w=tf.Variable(5.0), extra=tf.Variable(9.0))
    async with make(logdir, ckpt).session() as sess:
        await sess.run(ckpt.v.assign_add, 1.0)

    again = tf.train.Checkpoint(v=tf.Variable(0.0))
    sv = make(logdir, again)
    again.w = tf.Variable(0.0)  # assigned after construction, before the session
    async with sv.session() as sess:
        assert float(again.w.numpy()) == 5.0
        again.extra = tf.Variable(0.0)  # assigned after the restore: TF restores it then
        assert float(again.extra.numpy()) == 9.0
        await sess.run(again.v.assign_add, 1.0)
    assert float(again.v.numpy()) == 2.0


@pytest.mark.asyncio
async def test_a_value_no_attribute_takes_by_the_first_step_is_a_mismatch(logdir: str) -> None:
    ckpt = tf.train.Checkpoint(v=tf.Variable(0.0), extra=tf.Variable(9.0))
    async with make(logdir, ckpt).session() as sess:
        await sess.run(ckpt.v.assign_add, 1.0)
    again = tf.train.Checkpoint(v=tf.Variable(0.0))  # never given `extra`
    with pytest.raises(asv.CheckpointMismatchError, match=r"not fully restored.*extra"):
        async with make(logdir, again).session() as sess:
            await sess.run(again.v.assign_add, 1.0)


GUIDE_LOOP = textwrap.dedent(
    """
    import sys
    import anyio, tensorflow as tf
    import asupervisor as asv

    logdir, epochs = sys.argv[1], int(sys.argv[2])
    dataset = tf.data.Dataset.range(47)  # 47 batches an epoch
    total = tf.Variable(0, dtype=tf.int64)
    epoch = tf.Variable(0, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(total=total, epoch=epoch)

    def step(batch):
        total.assign_add(1)
        print(f"batch {int(epoch.numpy())} {int(batch)}", flush=True)

    async def main():
        sv = asv.Supervisor(logdir, checkpoint=ckpt, save_model_secs=0, save_model_steps=5,
                            save_summaries_secs=0)
        async with sv.session() as sess:
            print(f"resumed at {sess.global_step}", flush=True)
            while int(epoch.numpy()) < epochs:
                ckpt.data = iter(dataset)  # as TF's guides: a fresh iterator each epoch
                await sess.train(step, ckpt.data)
                await sess.call(epoch.assign_add, 1)

    anyio.run(main)
    """
)


@pytest.mark.slow
def test_the_guides_iterator_per_epoch_loop_resumes_at_the_batch_it_was_killed_near(
    tmp_path: Path,
) -> None:
    logdir = str(tmp_path / "run")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    args = [sys.executable, "-c", GUIDE_LOOP, logdir]
    run = forked.Popen([*args, "1000"], stdout=subprocess.PIPE, text=True, env=env)
    assert run.stdout is not None
    for line in run.stdout:
        if line.startswith("batch 1 15"):  # inside the second epoch
            run.kill()
            break
    run.wait(60)
    latest = tf.train.latest_checkpoint(logdir)
    restored = int(latest.rsplit("-", 1)[1])
    assert 47 < restored <= 47 + 16, latest

    again = forked.run([*args, "2"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resumed at {restored}" in again.stdout
    batches = [tuple(map(int, b)) for b in re.findall(r"batch (\d+) (\d+)", again.stdout)]
    # The rest of epoch 1 from where the checkpoint was, then nothing else (epochs=2).
    assert batches == [(1, b) for b in range(restored - 47, 47)], batches[:5]


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
@pytest.mark.asyncio
async def test_reading_save_counter_during_a_session_leaves_every_save_working(
    logdir: str, async_checkpoint: bool
) -> None:
    # TF's guides print ckpt.save_counter; TF creates it on the first read.
    v = tf.Variable(0.0)
    ckpt = tf.train.Checkpoint(v=v)
    sv = make(logdir, ckpt, async_checkpoint=async_checkpoint)
    async with sv.session() as sess:
        await sess.run(v.assign_add, 1.0)
        counted = int(ckpt.save_counter)  # the initial save and the one at step 1
        for _ in range(2):
            await sess.run(v.assign_add, 1.0)
    assert counted == 2
    assert int(ckpt.save_counter) == 4  # as Checkpoint.save counts: every save
    latest = tf.train.latest_checkpoint(logdir)
    assert latest.endswith("model.ckpt-3") and saved(latest, "v") == 3.0

    again = tf.train.Checkpoint(v=tf.Variable(0.0))
    async with make(logdir, again).session():
        assert int(again.save_counter) == 4  # restored with the rest
