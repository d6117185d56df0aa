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
    settings: dict[str, Any] = {
        "save_model_secs": 0,
        "save_model_steps": 3,
        "save_summaries_secs": 0,
        "save_summaries_steps": 1,
        "on_divergence": policy,
        "handle_signals": False,
    }
    return asv.Supervisor(logdir, checkpoint={"line": line}, **{**settings, **kwargs})


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
    # The run's count of rollbacks, on the same axis (TensorBoard's faults, beside restarts).
    counts = [
        (e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors("run/rollbacks")
    ]
    assert counts == [(0, 0.0), (7, 1.0)]  # at the session's start, then at the rollback


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


# -- one history: what a rollback commits, keeps and leaves behind, across restarts ----


def history_of(logdir: str) -> Any:
    from asupervisor._logdir.history import read_history
    from asupervisor._logdir.store import Store

    return read_history(Store(logdir))


def weights(path: str) -> tuple[float, float]:
    reader = tf.train.load_checkpoint(path)
    return (
        float(reader.get_tensor("line/w/.ATTRIBUTES/VARIABLE_VALUE")),
        float(reader.get_tensor("line/b/.ATTRIBUTES/VARIABLE_VALUE")),
    )


class SqrtLine(Line):
    """A line whose step at a marked batch has a finite loss and a NaN update: the
    gradient of ``sqrt(0 * w)`` is 0/0."""

    def step(self, x: tf.Tensor, y: tf.Tensor, bad: bool = False) -> dict[str, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = (self.w * x + self.b - y) ** 2
            if bad:
                loss += tf.sqrt(0.0 * self.w)  # the value 0, the gradient NaN
        dw, db = tape.gradient(loss, [self.w, self.b])
        self.w.assign_sub(0.1 * dw)
        self.b.assign_sub(0.1 * db)
        self.seen.append((len(self.seen), float(loss)))
        return {"loss": loss}


def sqrt_data(bad: int) -> list[tuple[float, float, bool]]:
    xs = [i / (BATCHES - 1) for i in range(BATCHES)]
    return [(x, 3.0 * x + 1.0, i == bad) for i, x in enumerate(xs)]


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
async def test_a_state_with_nan_weights_and_a_finite_loss_is_never_committed_or_rolled_back_to(
    logdir: str, events: list[dict[str, Any]], async_checkpoint: bool
) -> None:
    """Batch 4 (step 5) has a finite loss and makes the weights NaN; step 6's loss is NaN.
    With one checkpoint kept, the save at step 5 must not sweep the good one at step 4."""
    line = SqrtLine()
    sv = supervisor(
        logdir, line, asv.Rollback(), save_model_steps=1, max_to_keep=1,
        async_checkpoint=async_checkpoint,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.train(line.step, sqrt_data(bad=4), epochs=1)
    assert math.isnan(line.seen[5][1]) and math.isfinite(line.seen[4][1])
    (skipped,) = named(events, "checkpoint.skipped")
    assert skipped["step"] == 5 and "not finite" in skipped["reason"]
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["path"].endswith("model.ckpt-4") and back["diverged_at"] == 6
    assert sess.outcome is asv.Outcome.DONE
    assert all(math.isfinite(v) for v in (float(line.w.numpy()), float(line.b.numpy())))
    history = history_of(logdir)
    for commit in history.committed():  # what is on disk is finite, and says so
        assert commit.healthy is True
        assert all(math.isfinite(v) for v in weights(os.path.join(logdir, commit.name)))


async def test_without_a_policy_a_state_with_nan_weights_is_committed_as_not_healthy(
    logdir: str,
) -> None:
    line = SqrtLine()
    sv = asv.Supervisor(
        logdir, checkpoint={"line": line}, save_model_secs=0, save_model_steps=1,
        max_to_keep=None, save_summaries_secs=0, handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.train(line.step, sqrt_data(bad=4), epochs=1, max_steps=5)
    health = {c.name: c.healthy for c in history_of(logdir).committed()}
    assert health["model.ckpt-4"] is True
    assert health["model.ckpt-5"] is False  # a finite loss, NaN weights


def poisoned_at(batch: int, batches: int = 20) -> tf.data.Dataset:
    xs = tf.linspace(0.0, 1.0, batches)
    xs = tf.where(tf.range(batches) == batch, math.nan, xs)
    return tf.data.Dataset.from_tensor_slices((xs, 3.0 * tf.linspace(0.0, 1.0, batches) + 1.0))


async def test_a_restart_after_a_lookback_rollback_resumes_the_new_branch(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """Saves every 3 steps; batch 13 diverges at step 14; lookback=4 goes back to step 9.
    One step later the session stops: the next session resumes that, never the
    abandoned checkpoint at step 12, and never meets the bad batch again."""
    line = Line()
    sv = supervisor(logdir, line, asv.Rollback(lookback=4), max_to_keep=None)
    async with sv.session() as sess:
        await sess.train(line.step, poisoned_at(13), epochs=1, max_steps=15)
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["path"].endswith("model.ckpt-9") and back["diverged_at"] == 14
    assert sess.global_step == 10 and sess.data_position == (0, 15)
    saved = (float(line.w.numpy()), float(line.b.numpy()))

    line = Line()
    async with supervisor(logdir, line, asv.Rollback(lookback=4)).session() as sess:
        assert sess.restore_report.step == 10, sess.restore_report
        assert (float(line.w.numpy()), float(line.b.numpy())) == saved
        assert sess.data_position == (0, 15)
        await sess.train(line.step, poisoned_at(13), epochs=1)
    assert len(named(events, "step.diverged")) == 1  # the bad batch never came again
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-15")
    history = history_of(logdir)
    abandoned = [c.name for c in history.abandoned()]
    assert abandoned == ["model.ckpt-12"]


async def test_a_lookback_rollback_target_survives_max_to_keep(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    line = Line()
    sv = supervisor(logdir, line, asv.Rollback(lookback=4), max_to_keep=1)
    async with sv.session() as sess:
        await sess.train(line.step, poisoned_at(13), epochs=1)
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["path"].endswith("model.ckpt-9") and back["step"] == 9
    assert sess.outcome is asv.Outcome.DONE


def spiky(spikes: set[int], length: int = 70) -> list[float]:
    return [1000.0 if i in spikes else 1.0 for i in range(length)]


async def spike_run(logdir: str, stops_at: list[int]) -> list[tuple[int, int]]:
    """Spikes at batches 50 and 52 (steps 51 and 53): ``(diverged_at, restored step)`` of
    each rollback, over sessions that stop after each step count in ``stops_at``."""
    from structlog.testing import capture_logs

    v = tf.Variable(0.0)

    def step(loss: float) -> dict[str, Any]:
        v.assign_add(1.0)
        return {"loss": tf.constant(loss)}

    policy = asv.Rollback(spike_factor=10, window=100)  # needs 25 losses to judge
    sv = asv.Supervisor(
        logdir, checkpoint={"v": v}, save_model_secs=0, save_model_steps=10,
        save_summaries_secs=0, on_divergence=policy, handle_signals=False,
    )  # fmt: skip
    with capture_logs() as logs:
        for limit in [*stops_at, None]:
            async with sv.session() as sess:
                await sess.train(step, spiky({50, 52}), epochs=1, max_steps=limit)
    return [(e["diverged_at"], e["step"]) for e in named(logs, "checkpoint.rolled_back")]


async def test_a_spike_is_rolled_back_the_same_in_a_run_restarted_in_the_middle(
    tmp_path: Any,
) -> None:
    """The detector's window is part of the saved state: restored at a restart and at a
    rollback, so neither leaves a stretch in which a spike is trained through."""
    straight = await spike_run(str(tmp_path / "straight"), [])
    restarted = await spike_run(str(tmp_path / "restarted"), [40])
    # The second spike comes right after the first rollback: judged by the restored window.
    assert straight == [(51, 50), (52, 50)]
    assert restarted == straight


async def test_divergence_after_max_rollbacks_stays_stopped_on_the_next_run(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """max_rollbacks counts the rollbacks of the run (the logdir's history), not of one
    process: running the same command again does not roll back three more times."""

    async def run(max_rollbacks: int) -> asv.DivergedError:
        line = Line()
        sv = supervisor(logdir, line, asv.Rollback(max_rollbacks=max_rollbacks))
        with pytest.raises(asv.DivergedError) as raised:
            async with sv.session() as sess:
                await sess.train(line.step, regression(poisoned=set(range(4, BATCHES))), epochs=2)
        assert sess.outcome is asv.Outcome.FAILED_PERMANENTLY
        return raised.value

    first = await run(2)
    assert len(named(events, "checkpoint.rolled_back")) == 2
    again = await run(2)
    assert len(named(events, "checkpoint.rolled_back")) == 2  # none more
    assert "2 rollbacks" in str(again) and "max_rollbacks" in str(again)
    assert "history" in str(again)  # it says where the count comes from
    assert "step 5 -> model.ckpt-3" in str(first) == str(again)
    await run(3)  # a higher limit: one more rollback, then it stops again
    assert len(named(events, "checkpoint.rolled_back")) == 3


async def test_a_rollback_says_how_many_batches_it_dropped(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """From the checkpoint at step 6 after the NaN at step 8 (batch 7) with skip=1: the
    run goes on at batch 9. Batches 6 and 7 (trained since the checkpoint) and 8 (skip)
    are not trained again."""
    line = Line()
    sv = supervisor(logdir, line, asv.Rollback(skip=1))
    async with sv.session() as sess:
        await sess.train(line.step, regression(poisoned={7}), epochs=1)
    (back,) = named(events, "checkpoint.rolled_back")
    assert back["step"] == 6 and back["data_position"] == [0, 9]
    assert back["batches_dropped"] == 3
    (record,) = history_of(logdir).rollbacks
    assert (record.at_step, record.batches_dropped) == (8, 3)


async def test_inspect_shows_the_branches_and_what_a_rollback_abandoned(logdir: str) -> None:
    from asupervisor._cli.inspect import render
    from asupervisor._logdir.report import inspect_logdir

    line = Line()
    sv = supervisor(logdir, line, asv.Rollback(lookback=4), max_to_keep=None)
    async with sv.session() as sess:
        await sess.train(line.step, poisoned_at(13), epochs=1)
    report = inspect_logdir(logdir, verify=False)
    (rollback,) = report.rollbacks
    assert (rollback.at_step, rollback.to, rollback.abandoned) == (
        14,
        "model.ckpt-9",
        ["model.ckpt-12"],
    )
    head = next(c for c in report.commits if c.head)
    assert head.branch == 1 and report.latest_checkpoint == os.path.join(logdir, head.name)
    text = render(report)
    assert "abandoned by rollback 1" in text
    assert "back to model.ckpt-9, abandoning model.ckpt-12, 5 batches dropped" in text
    assert report.as_dict()["rollbacks"][0]["abandoned"] == ["model.ckpt-12"]


async def test_a_kill_between_a_rollbacks_record_and_its_branch_commit_does_not_meet_the_bad_batch_again(  # noqa: E501
    logdir: str, events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollback's record holds the moved data position: a process killed after the
    record and before the new branch's first commit restarts from the restored commit at
    the moved position, past the bad batch (with ``max_rollbacks=1`` the bad batch again
    would end the run with ``DivergedError``)."""
    from asupervisor._logdir.catalog import Catalog

    def data(epoch: int) -> tf.data.Dataset:
        return regression(poisoned={7} if epoch == 0 else set())

    real_commit = Catalog.commit

    def dead_after_the_record(self: Catalog, name: str, record: Any, **sweep: Any) -> Any:
        if self.history.rollbacks:  # the process is gone: nothing more is committed
            raise OSError("killed")
        return real_commit(self, name, record, **sweep)

    line = Line()
    with monkeypatch.context() as patch:
        patch.setattr(Catalog, "commit", dead_after_the_record)
        with pytest.raises(asv.CheckpointSaveError):
            async with supervisor(logdir, line, asv.Rollback(max_rollbacks=1)).session() as sess:
                await sess.train(line.step, data, epochs=2)
    history = history_of(logdir)
    (record,) = history.rollbacks
    assert history.head == record.to and history.head_step() == 6  # no branch commit
    line = Line()
    async with supervisor(logdir, line, asv.Rollback(max_rollbacks=1)).session() as sess:
        assert sess.data_position == (0, 8)  # past batch 7, as the rollback moved it
        await sess.train(line.step, data, epochs=2)
    assert sess.outcome is asv.Outcome.DONE and sess.data_position == (2, 0)
    assert len(named(events, "step.diverged")) == 1
