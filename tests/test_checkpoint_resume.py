"""Minimal checkpointing: interval saves, final save, restore-or-init on entry."""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from tests.conftest import Pair, named


def steps_on_disk(sv: asv.Supervisor) -> list[int]:
    assert sv.logdir is not None
    return sorted(
        int(name.split("-")[1].split(".")[0])
        for name in os.listdir(sv.logdir)
        if name.startswith(sv.checkpoint_basename + "-") and name.endswith(".index")
    )


def make(logdir: str, pair: Pair, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_secs", 60)
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("handle_signals", False)
    return asv.Supervisor(logdir, checkpoint={"pair": pair}, **kwargs)


@pytest.mark.asyncio
async def test_a_restart_restores_values_and_step_and_skips_init_fn(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    first, inits = Pair(), []
    sv = make(logdir, first, init_fn=lambda: inits.append(first.a.assign(100.0)))
    async with sv.session() as sess:
        assert sess.restore_report.source == "init_fn"
        for _ in range(7):
            await sess.run(first.step)
    assert len(inits) == 1
    assert steps_on_disk(sv) == [0, 7]  # the fresh start, then the final save

    second = Pair()
    again = make(logdir, second, init_fn=lambda: inits.append("again"))
    async with again.session() as sess:
        report = sess.restore_report
        assert report.source == "checkpoint" and report.step == 7
        assert report.path is not None and report.path.endswith("model.ckpt-7")
        assert sess.global_step == 7
        assert float(second.a.numpy()) == 107.0 and float(second.b.numpy()) == 7.0
        await sess.run(second.step)
    assert len(inits) == 1, "init_fn ran although a checkpoint was restored"
    assert steps_on_disk(again) == [0, 7, 8]
    restored = named(events, "checkpoint.restored")
    assert restored and restored[-1]["step"] == 7
    assert named(events, "session.started")[-1]["restored_from"].endswith("model.ckpt-7")


@pytest.mark.asyncio
async def test_timed_saves_come_on_their_interval(
    logdir: str, pair: Pair, events: list[dict[str, Any]]
) -> None:
    sv = make(logdir, pair, save_model_secs=0.1, max_to_keep=None)
    async with sv.session() as sess:
        for _ in range(30):
            await sess.run(pair.step)
            await anyio.sleep(0.02)
    steps = steps_on_disk(sv)
    assert len(steps) >= 4, steps  # 0, a few interval saves, the final 30
    assert steps[0] == 0 and steps[-1] == 30
    assert len(steps) == len(set(steps))
    saved = named(events, "checkpoint.saved")
    assert all(e["bytes"] > 0 and e["seconds"] >= 0 for e in saved)
    assert {e["step"] for e in saved} == set(steps)


@pytest.mark.asyncio
async def test_the_checkpoint_service_started_by_hand_saves_by_the_clock_between_steps(
    logdir: str, pair: Pair
) -> None:
    from asupervisor.services import CheckpointService

    saved: list[int] = []

    class Saves(asv.Hook):
        def after_save(self, session: asv.ManagedSession, step: int, path: str) -> None:
            saved.append(step)

    sv = make(logdir, pair, hooks=[Saves()])  # timed saves every 60 s: none here
    async with sv.session(start_standard_services=False) as sess:
        sess.start_service(CheckpointService(0.05))
        await sess.run(pair.step)
        with anyio.fail_after(60):
            while 1 not in saved:  # idle after step 1: the service saves it anyway
                await anyio.sleep(0.01)
    assert saved == [0, 1]  # the final save finds step 1 saved


@pytest.mark.asyncio
async def test_checkpoints_hold_step_boundary_states(logdir: str, pair: Pair) -> None:
    """Saves are jobs on the training thread: never between a and b's updates."""
    sv = make(logdir, pair, save_model_secs=0.01, max_to_keep=None)
    async with sv.session() as sess:
        for _ in range(50):
            await sess.run(pair.step)
    for step in steps_on_disk(sv):
        reader = tf.train.load_checkpoint(os.path.join(logdir, f"model.ckpt-{step}"))
        names = {
            n.split("/")[1]: n for n in reader.get_variable_to_shape_map() if n.startswith("pair/")
        }
        a, b = reader.get_tensor(names["a"]), reader.get_tensor(names["b"])
        assert a == b == step


@pytest.mark.asyncio
async def test_save_model_steps_saves_every_n_steps(logdir: str, pair: Pair) -> None:
    sv = make(logdir, pair, save_model_secs=0, save_model_steps=5, max_to_keep=None)
    async with sv.session() as sess:
        for _ in range(12):
            await sess.run(pair.step)
    assert steps_on_disk(sv) == [0, 5, 10, 12]


@pytest.mark.asyncio
async def test_save_model_secs_zero_disables_checkpoints(logdir: str, pair: Pair) -> None:
    sv = make(logdir, pair, save_model_secs=0)
    async with sv.session() as sess:
        await sess.run(pair.step)
    assert steps_on_disk(sv) == []


@pytest.mark.asyncio
async def test_no_final_save_after_an_error(logdir: str, pair: Pair) -> None:
    sv = make(logdir, pair)
    with pytest.raises(ZeroDivisionError):
        async with sv.session() as sess:
            await sess.run(pair.step)
            await sess.run(lambda: 1 / 0)
    assert steps_on_disk(sv) == [0]


@pytest.mark.asyncio
async def test_max_to_keep_keeps_the_newest(logdir: str, pair: Pair) -> None:
    sv = make(logdir, pair, save_model_secs=0, save_model_steps=1, max_to_keep=2)
    async with sv.session() as sess:
        for _ in range(6):
            await sess.run(pair.step)
    assert steps_on_disk(sv) == [5, 6]
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-6")


@pytest.mark.asyncio
async def test_a_non_chief_restores_but_writes_nothing(logdir: str) -> None:
    chief_pair = Pair()
    async with make(logdir, chief_pair).session() as sess:
        for _ in range(3):
            await sess.run(chief_pair.step)
    before = sorted(os.listdir(logdir))
    worker_pair = Pair()
    worker = make(logdir, worker_pair, is_chief=False, save_model_secs=0.05)
    async with worker.session(wait_for_checkpoint=True, max_wait_secs=1) as sess:
        assert sess.restore_report.step == 3 and float(worker_pair.a.numpy()) == 3.0
        for _ in range(5):
            await sess.run(worker_pair.step)
        await anyio.sleep(0.2)
    assert sorted(os.listdir(logdir)) == before


@pytest.mark.asyncio
async def test_a_waiting_non_chief_times_out(logdir: str, pair: Pair) -> None:
    worker = make(logdir, pair, is_chief=False, recovery_wait_secs=0.05)
    with pytest.raises(asv.WaitTimeout, match="no checkpoint"):
        async with worker.session(wait_for_checkpoint=True, max_wait_secs=0.2):
            pass


@pytest.mark.asyncio
async def test_a_mismatched_checkpoint_is_refused(logdir: str, pair: Pair) -> None:
    async with make(logdir, pair).session() as sess:
        await sess.run(pair.step)

    class Other(tf.Module):
        def __init__(self) -> None:
            self.c = tf.Variable([1.0, 2.0])

    other = asv.Supervisor(logdir, checkpoint={"pair": Other()}, handle_signals=False)
    with pytest.raises(asv.CheckpointMismatchError, match=r"model\.ckpt-1"):
        async with other.session():
            pass


def keras_model(units: int, layers: int) -> Any:
    import keras

    dense = [keras.layers.Dense(units, name=f"hidden{i}") for i in range(layers)]
    model = keras.Sequential([keras.Input((3,)), *dense], name="net")
    model.compile(optimizer="sgd", loss="mse")
    return model


def run_once(logdir: str, model: Any) -> int:
    """One program under ``asv.run``: a session over ``model``, one step."""

    async def main() -> None:
        sv = asv.Supervisor(
            logdir, checkpoint={"model": model, "opt": model.optimizer}, save_model_secs=0,
            save_model_steps=1, save_summaries_secs=0, handle_signals=False,
        )  # fmt: skip
        async with sv.session() as sess:
            await sess.run(lambda: None)

    return asv.run(main)


@pytest.mark.parametrize(
    ("units", "layers", "difference"),
    [
        (8, 1, r"hidden0/kernel: checkpoint \(3, 4\), model \(3, 8\)"),
        (4, 2, r"the model has \S*hidden1/kernel \(4, 4\) that the checkpoint lacks"),
    ],
)
def test_a_model_changed_between_runs_ends_78_with_each_variable_and_what_to_do(
    tmp_path: Any, capfd: pytest.CaptureFixture[str], units: int, layers: int, difference: str
) -> None:
    import gc
    import json
    import re
    import time

    from asupervisor._cli.inspect import describe_beat
    from asupervisor._logdir.heartbeat import Beat

    logdir = str(tmp_path / "run")
    assert run_once(logdir, keras_model(4, 1)) == 0
    # What earlier tests in this process left for the collector (a test's checkpoint read
    # without expect_partial warns as it is collected) goes before the capture that counts.
    gc.collect()
    capfd.readouterr()
    assert run_once(logdir, keras_model(units, layers)) == 78
    err = capfd.readouterr().err
    assert re.search(difference, err), err
    assert "new logdir" in err and "Traceback" not in err
    assert len(err.splitlines()) < 10, err
    # The step it ended at is not the run's: it never restored.
    beat = Beat.from_json((tmp_path / "run" / ".asupervisor.heartbeat").read_bytes())
    assert beat.step is None and "before its restore" in describe_beat(beat, time.time())
    lines = (tmp_path / "run" / "asupervisor-ledger.jsonl").read_text().splitlines()
    end = json.loads(lines[-1])
    assert end["event"] == "end" and end["exit_status"] == 78 and end["step"] is None
