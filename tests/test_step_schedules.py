"""Step schedules as MonitoredTrainingSession had them, with TF's numbers.

TF's CheckpointSaverHook and SummarySaverHook fire when the global step has moved
N past the last time (a SecondOrStepTimer), counted from the session's start, not
when it lands on a multiple of N.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import asupervisor as asv
from tests.conftest import named

pytestmark = pytest.mark.asyncio


def saved_steps(events: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in named(events, "checkpoint.saved")]


async def test_a_step_that_advances_by_three_saves_every_ten_as_tf_does(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    step = tf.Variable(0, dtype=tf.int64)
    sv = asv.Supervisor(
        logdir,
        checkpoint={"step": step},
        global_step=step,
        save_model_secs=0,
        save_model_steps=10,
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(9):  # 3, 6, ..., 27
            await sess.run(step.assign_add, 3)
    assert saved_steps(events) == [0, 12, 24, 27]  # 27: the final save


async def test_step_saves_count_from_the_restored_step(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    v = tf.Variable(0.0)

    def make(save_steps: int) -> asv.Supervisor:
        return asv.Supervisor(
            logdir,
            checkpoint={"v": v},
            save_model_secs=0,
            save_model_steps=save_steps,
            save_summaries_secs=0,
            handle_signals=False,
        )

    async with make(1000).session() as sess:
        await sess.run(v.assign_add, 1.0)  # restored at step 1 below
    events.clear()
    async with make(3).session() as sess:
        assert sess.restore_report.step == 1
        for _ in range(5):
            await sess.run(v.assign_add, 1.0)
    assert saved_steps(events) == [4, 6]  # TF: 1 + 3 = 4; then the final save at 6


async def test_summaries_every_n_steps_with_the_rate_from_the_first_step(logdir: str) -> None:
    v = tf.Variable(0.0)
    sv = asv.Supervisor(
        logdir,
        checkpoint={"v": v},
        save_model_secs=0,
        save_model_steps=1000,
        save_summaries_secs=0,
        save_summaries_steps=5,
        summary_fn=lambda: {"v": v},
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(12):
            await sess.run(v.assign_add, 1.0)
    (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    reader = EventAccumulator(path)
    reader.Reload()
    # As TF's SummarySaverHook: at the session's first step, then every 5 (TF: 1, 6, 11).
    assert [e.step for e in reader.Tensors("v")] == [1, 6, 11]
    values = [float(tf.make_ndarray(e.tensor_proto)) for e in reader.Tensors("v")]
    assert values == [1.0, 6.0, 11.0]  # summary_fn's value at the step it is labelled with
    rates = reader.Tensors("global_step/sec")
    assert [e.step for e in rates] == [6, 11]  # from the end of the first step
    assert all(float(tf.make_ndarray(e.tensor_proto)) > 0 for e in rates)


async def test_no_summary_is_written_when_no_step_ran_since_the_last(logdir: str) -> None:
    v = tf.Variable(0.0)

    def make() -> asv.Supervisor:
        return asv.Supervisor(
            logdir,
            checkpoint={"v": v},
            save_model_secs=0,
            save_model_steps=1000,
            save_summaries_secs=0.05,
            summary_fn=lambda: {"v": v},
            handle_signals=False,
        )

    async with make().session() as sess:
        for _ in range(3):
            await sess.run(v.assign_add, 1.0)
    async with make().session():  # restored at 3, no step: nothing at the restart boundary
        pass
    steps: list[int] = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        reader = EventAccumulator(path)
        reader.Reload()
        steps += [e.step for e in reader.Tensors("v")] if "v" in reader.Tags()["tensors"] else []
    assert steps == [3]  # the first session's final point only
