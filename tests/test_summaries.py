"""TensorBoard events, read back with TensorBoard's own reader."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import asupervisor as asv
from tests.board import Board, tensorboard
from tests.conftest import Pair

pytestmark = pytest.mark.asyncio


def read_events(logdir: str) -> tuple[list[str], EventAccumulator]:
    files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    return files, acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


async def test_summary_fn_values_and_step_rate_are_written(logdir: str, pair: Pair) -> None:
    sv = asv.Supervisor(
        logdir,
        checkpoint={"pair": pair},
        save_model_secs=0,
        save_summaries_secs=0.1,
        summary_fn=lambda: {
            "a": pair.a,
            "twice_b": float(pair.b.numpy()) * 2,
            "both": tf.stack([pair.a, pair.b]),
        },
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(40):
            await sess.run(pair.step)
            await anyio.sleep(0.01)
    files, acc = read_events(logdir)
    assert len(files) == 1
    a_values = scalars(acc, "a")
    assert len(a_values) >= 2
    assert all(value == step for step, value in a_values), a_values
    assert a_values[-1] == (40, 40.0)  # the final write after the last step
    assert scalars(acc, "twice_b")[-1] == (40, 80.0)
    rates = scalars(acc, "global_step/sec")
    assert rates and all(rate > 0 for _, rate in rates)
    assert "both" in acc.Tags()["tensors"]  # rank 1: a histogram


async def test_steps_write_summaries_into_the_runs_events_file(logdir: str) -> None:
    sv = asv.Supervisor(logdir, save_model_secs=0, save_summaries_secs=0, handle_signals=False)

    def step() -> None:
        tf.summary.scalar("from_step", 1.5)

    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(step)
        sess.summary_computed({"by_hand": 7}, step=100)
        assert sv.summary_writer is not None
    files, acc = read_events(logdir)
    assert len(files) == 1
    assert [s for s, _ in scalars(acc, "from_step")] == [1, 2, 3]  # the step each leaves
    assert scalars(acc, "by_hand") == [(100, 7.0)]
    assert sv.summary_writer is None  # closed with the session


async def test_each_session_makes_its_own_events_file(logdir: str, pair: Pair) -> None:
    for _ in range(2):
        sv = asv.Supervisor(
            logdir, checkpoint={"pair": pair}, save_summaries_secs=0, handle_signals=False
        )
        async with sv.session() as sess:
            await sess.run(pair.step)
            sess.summary_computed({"x": 1.0})
    files, acc = read_events(logdir)
    assert len(files) == 2
    assert [s for s, _ in scalars(acc, "x")] == [1, 2]


async def test_no_events_without_a_logdir_or_with_writer_none(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    sv = asv.Supervisor(logdir, summary_writer=None, save_model_secs=0, handle_signals=False)
    async with sv.session() as sess:
        sess.summary_computed({"x": 1.0})
    assert glob.glob(os.path.join(logdir, "events.*")) == []
    assert any(e["event"] == "summary.disabled" for e in events)


async def test_a_users_writer_is_used_and_left_open(tmp_path: Any) -> None:
    writer = tf.summary.create_file_writer(str(tmp_path / "mine"))
    sv = asv.Supervisor(None, summary_writer=writer, save_summaries_secs=0, handle_signals=False)
    async with sv.session() as sess:
        sess.summary_computed({"y": 2.0}, step=5)
    with writer.as_default():
        tf.summary.scalar("after", 1.0, step=6)  # still usable
    writer.close()
    _, acc = read_events(str(tmp_path / "mine"))
    assert scalars(acc, "y") == [(5, 2.0)]


async def test_zero_save_summaries_secs_disables_summary_fn_and_the_step_rate(
    logdir: str, pair: Pair
) -> None:
    calls: list[int] = []

    def summary_fn() -> dict[str, Any]:
        calls.append(1)
        return {"a": pair.a}

    sv = asv.Supervisor(
        logdir,
        checkpoint={"pair": pair},
        save_model_secs=0,
        save_summaries_secs=0,
        summary_fn=summary_fn,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(20):
            await sess.run(pair.step)
            await anyio.sleep(0.01)
    _, acc = read_events(logdir)
    assert calls == []
    assert acc.Tags()["tensors"] == []


def stalls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "step.stalled"]


async def test_a_stalled_step_is_warned_about_once(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    sv = asv.Supervisor(logdir, save_model_secs=0, save_summaries_secs=0.1, handle_signals=False)

    def stuck() -> None:  # until it is reported (at most a minute), then three intervals
        started = time.monotonic()
        while not stalls(events) and time.monotonic() - started < 60:
            time.sleep(0.01)
        time.sleep(0.3)

    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(lambda: None)
        await anyio.sleep(0.25)  # a point after step 3: the mean step time is known
        await sess.run(stuck)
    (stalled,) = stalls(events)  # once, not once an interval
    assert stalled["step"] == 3 and stalled["seconds"] >= 0.1


async def test_no_step_is_stalled_while_none_runs(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    # Start-up, the first step (tracing), a call, a save, an idle body: no step is stalled.
    # Each phase lasts four intervals; a step is stalled past one (its mean is small).
    class SlowSave(asv.Hook):
        def after_save(self, session: asv.ManagedSession, step: int, path: str) -> None:
            time.sleep(0.4)

    sv = asv.Supervisor(
        logdir,
        init_fn=lambda: time.sleep(0.4),
        save_model_secs=0,
        save_model_steps=1000,
        save_summaries_secs=0.1,
        hooks=[SlowSave()],
        handle_signals=False,
    )
    async with sv.session() as sess:
        await sess.run(time.sleep, 0.4)  # the first step, as long as a tracing
        for _ in range(3):
            await sess.run(lambda: None)
        await anyio.sleep(0.25)  # a point: the mean step time is known
        await sess.call(time.sleep, 0.4)
        await sess.save_checkpoint()
        await anyio.sleep(0.4)
        await sess.run(lambda: None)
    assert stalls(events) == []


async def test_steps_slower_than_the_interval_are_not_stalled_until_ten_times_the_usual(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    sv = asv.Supervisor(logdir, save_model_secs=0, save_summaries_secs=0.02, handle_signals=False)
    async with sv.session() as sess:
        for _ in range(8):
            await sess.run(time.sleep, 0.05)  # each longer than the interval: their pace
        assert stalls(events) == []

        def stuck() -> None:  # a step that hangs until it is reported (at most a minute)
            started = time.monotonic()
            while not stalls(events) and time.monotonic() - started < 60:
                time.sleep(0.01)

        started = time.monotonic()
        await sess.run(stuck)
        waited = time.monotonic() - started
    (stalled,) = stalls(events)
    assert stalled["step"] == 8 and stalled["seconds"] >= 10 * 0.05, stalled
    assert waited < 60


def points(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


async def test_step_results_are_averaged_over_each_step_interval(logdir: str) -> None:
    v = tf.Variable(0.0)

    def step() -> dict[str, Any]:
        v.assign_add(1.0)
        return {"loss": v.read_value(), "note": "not a number"}

    sv = asv.Supervisor(
        logdir,
        checkpoint={"v": v},
        save_model_secs=0,
        save_summaries_secs=0,
        save_summaries_steps=4,
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(8):
            await sess.run(step)
    _, acc = read_events(logdir)
    # As TF's SummarySaverHook: at the first step, then every 4: means of 1 and of 2..5.
    assert scalars(acc, "loss") == [(1, 1.0), (5, 3.5)]
    assert "note" not in acc.Tags()["tensors"]


async def test_timed_summaries_average_the_steps_since_the_previous_point(logdir: str) -> None:
    v = tf.Variable(0.0)

    @tf.function
    def step() -> tf.Tensor:
        v.assign_add(1.0)
        return v.read_value()  # a bare number: "loss"

    sv = asv.Supervisor(
        logdir, checkpoint={"v": v}, save_model_secs=0, save_summaries_secs=0.05,
        handle_signals=False,
    )  # fmt: skip
    async with sv.session() as sess:
        for _ in range(300):
            await sess.run(step)
            if sess.global_step % 50 == 0:
                await anyio.sleep(0.06)
    _, acc = read_events(logdir)
    written = scalars(acc, "loss")
    assert len(written) >= 2 and written[-1][0] == 300
    previous = 0
    for step_no, value in written:  # the loss of step k is k: the mean of (p, s] is known
        assert value == (previous + 1 + step_no) / 2, (previous, step_no, value)
        previous = step_no


@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
@pytest.mark.parametrize("own_step", [True, False], ids=["supervisor_step", "user_step"])
async def test_in_step_summaries_land_at_the_step_of_summary_fn(
    logdir: str, compiled: bool, own_step: bool
) -> None:
    v = tf.Variable(0.0)
    user_step = tf.Variable(0, dtype=tf.int64)

    def step() -> None:
        v.assign_add(1.0)
        if not own_step:
            user_step.assign_add(1)  # as optimizer.apply_gradients does, before the summary
        tf.summary.scalar("inside", v)

    sv = asv.Supervisor(
        logdir,
        checkpoint={"v": v, "user_step": user_step},
        global_step=None if own_step else user_step,
        save_model_secs=0,
        save_summaries_secs=0,
        save_summaries_steps=1,
        summary_fn=lambda: {"outside": v},
        handle_signals=False,
    )
    fn = tf.function(step) if compiled else step
    async with sv.session() as sess:
        for _ in range(5):
            await sess.run(fn)
    _, acc = read_events(logdir)
    # The state after the step from N to N+1 is labelled N+1 by every source.
    assert scalars(acc, "inside") == [(n, float(n)) for n in range(1, 6)]
    assert scalars(acc, "outside") == [(n, float(n)) for n in range(1, 6)]


def records(path: str) -> list[bytes]:
    return [r.numpy() for r in tf.data.TFRecordDataset(path)]


def past(record: bytes, step: int) -> bool:
    from tensorflow.core.util import event_pb2

    event = event_pb2.Event.FromString(record)
    return event.HasField("summary") and event.step > step


def every_step(logdir: str, v: tf.Variable) -> asv.Supervisor:
    """``v`` drawn at every step, a checkpoint every 5 steps."""
    return asv.Supervisor(
        logdir,
        checkpoint={"v": v},
        save_model_secs=0,
        save_model_steps=5,
        save_summaries_secs=0,
        save_summaries_steps=1,
        summary_fn=lambda: {"v": v},
        handle_signals=False,
    )


async def crash_after_eight_steps(logdir: str, v: tf.Variable) -> None:
    """A session that draws points 1..8 (10, 20, ... 80), saves at 5 and crashes: an error
    leaves no final save, so the next session restores step 5."""
    with pytest.raises(RuntimeError, match="crash"):
        async with every_step(logdir, v).session() as sess:
            for _ in range(8):
                await sess.run(v.assign_add, 10.0)
            raise RuntimeError("crash")


async def test_each_session_start_drops_the_points_a_crashed_session_wrote_after_its_checkpoint(
    logdir: str,
) -> None:
    from tensorboard.backend.event_processing import plugin_event_accumulator

    v = tf.Variable(0.0)
    await crash_after_eight_steps(logdir, v)
    async with every_step(logdir, v).session() as sess:
        assert sess.restore_report.step == 5
        for _ in range(3):
            await sess.run(v.assign_add, 1.0)  # points 6..8 again, with other values
    # TensorBoard's own loader (the one its server uses), not the legacy accumulator.
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    assert points(acc, "v") == [
        (1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0), (5, 50.0), (6, 51.0), (7, 52.0), (8, 53.0)
    ]  # fmt: skip


async def test_a_session_started_in_the_second_of_the_one_before_is_read_after_it(
    logdir: str,
) -> None:
    # TensorBoard reads a directory's events files in the order of their names (second,
    # host, pid, counter: text). The crashed session's file is given a name of the current
    # second that sorts after any of this process's: the next session's file must sort
    # after it all the same, or its points are dropped as the crashed session's.
    from tensorboard.backend.event_processing import plugin_event_accumulator

    v = tf.Variable(0.0)
    await crash_after_eight_steps(logdir, v)
    (crashed,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    while time.time() % 1 > 0.2:  # early in a second: the next session starts within it
        await anyio.sleep(0.01)
    now = int(time.time())
    os.rename(crashed, os.path.join(logdir, f"events.out.tfevents.{now}.zzzz.99999999.9.v2"))
    async with every_step(logdir, v).session() as sess:
        for _ in range(3):
            await sess.run(v.assign_add, 1.0)  # points 6..8 again, with other values
    files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    assert "zzzz" in files[0], files  # the new session's file sorts last
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    assert points(acc, "v")[-3:] == [(6, 51.0), (7, 52.0), (8, 53.0)]


class Clock:
    """``time`` for summaries.py: wall and monotonic time that only ``sleep`` moves."""

    def __init__(self, now: float) -> None:
        self.now, self.slept = now, 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        self.now += secs
        self.slept += secs


@pytest.mark.parametrize(
    ("newest", "waits"),
    [(1000, True), (999, False), (1005, False), (None, False)],  # now: 1000.3
)
async def test_a_new_events_file_waits_only_for_one_made_in_the_current_second(
    monkeypatch: pytest.MonkeyPatch, newest: int | None, waits: bool
) -> None:
    from asupervisor._training import summaries

    clock = Clock(1000.3)
    monkeypatch.setattr(summaries, "time", clock)
    names = {"events.out.tfevents.999.a.1.0.v2", "events.out.tfevents.x.y", "other"}
    if newest is not None:
        names.add(f"events.out.tfevents.{newest}.zzzz.99999999.9.v2")
    summaries.wait_to_sort_last(names)
    assert (int(clock.now), clock.slept > 0) == ((1001, True) if waits else (1000, False))
    assert clock.slept < 1


async def test_a_summary_written_between_steps_is_at_the_step_it_reads(logdir: str) -> None:
    # The DCGAN port: epoch-end values written with sess.call after step N are at N.
    v = tf.Variable(0.0)

    @tf.function
    def step() -> None:
        v.assign_add(1.0)

    sv = asv.Supervisor(
        logdir, checkpoint={"v": v}, save_model_secs=0, save_summaries_secs=0, handle_signals=False
    )
    async with sv.session() as sess:
        for _ in range(3):
            for _ in range(10):
                await sess.run(step)
            await sess.call(lambda: tf.summary.scalar("epoch_end", v))
    _, acc = read_events(logdir)
    assert scalars(acc, "epoch_end") == [(10, 10.0), (20, 20.0), (30, 30.0)]


async def test_a_deleted_events_file_under_a_traced_summary_step_is_renewed_in_place(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    v = tf.Variable(0.0)

    @tf.function
    def step() -> None:
        v.assign_add(1.0)
        tf.summary.scalar("in_step", v)

    sv = asv.Supervisor(
        logdir,
        checkpoint={"v": v},
        save_model_secs=0,
        save_summaries_secs=0.05,
        summary_fn=lambda: {"v": v},
        handle_signals=False,
    )
    async with sv.session() as sess:
        for _ in range(5):
            await sess.run(step)
            await anyio.sleep(0.02)
        (first,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
        os.remove(first)
        while not [e for e in events if e["event"] == "summary.file_lost"]:
            await sess.run(step)  # the traced step keeps its writer: no crash
            await anyio.sleep(0.02)
        for _ in range(5):
            await sess.run(step)
    (second,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    acc = EventAccumulator(second, size_guidance={"tensors": 0})
    acc.Reload()
    points = scalars(acc, "in_step")
    assert points and all(step == value for step, value in points), points  # at N+1, not N
    assert points[-1] == (sess.global_step, float(sess.global_step))


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Board]:
    """TensorBoard's server with its default (fast) loader, for this module's tests."""
    root = str(tmp_path_factory.mktemp("board"))
    with tensorboard(root) as url:
        yield Board(root, url)


async def test_tensorboards_default_loader_draws_no_point_a_killed_session_wrote_past_the_restore(
    logdir: str, board: Board
) -> None:
    # TensorBoard's fast loader (its default) ignores SessionLog.START: at the restore,
    # the dead session's file loses its points past step 5, and keeps its name and the
    # rest of its records. A sparse tag (an evaluation) is where a point would stay.
    from tensorboard.backend.event_processing import plugin_event_accumulator

    v = tf.Variable(0.0)
    with pytest.raises(RuntimeError, match="crash"):
        async with every_step(logdir, v).session() as sess:
            for _ in range(8):
                await sess.run(v.assign_add, 10.0)
                if sess.global_step in (3, 7):
                    sess.summary_computed({"sparse": float(sess.global_step)})
            raise RuntimeError("crash")
    (crashed,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    records_before = records(crashed)
    leftover = os.path.join(logdir, ".asv-rewrite.1.events.out.tfevents.1.x.1.0.v2")
    with open(leftover, "wb") as f:  # what a rewrite given up on would have left
        f.write(b"partial")
    async with every_step(logdir, v).session() as sess:
        assert sess.restore_report.step == 5
        for _ in range(3):
            await sess.run(v.assign_add, 1.0)
    assert os.path.exists(crashed)  # the same name: TensorBoard's order of the files
    # The points past step 5 are gone (6..8 of "v" and of the rate, 7 of "sparse"),
    # and nothing else: the file's other records stay as they were, in their order.
    assert records(crashed) == [r for r in records_before if not past(r, 5)]
    assert len(records_before) - len(records(crashed)) == 7
    kept = [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0), (5, 50.0), (6, 51.0), (7, 52.0), (8, 53.0)]
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    assert points(acc, "v") == kept
    assert points(acc, "sparse") == [(3, 3.0)]
    assert not [n for n in os.listdir(logdir) if n.startswith(".asv-rewrite")]
    board.show(logdir, "killed")
    assert board.scalars("killed", "sparse", [(3, 3.0)]) == [(3, 3.0)]
    assert board.scalars("killed", "v", kept) == kept


def written(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


async def steps_until_written(sess: asv.ManagedSession, events: list[dict[str, Any]]) -> int:
    """Steps (``loss`` = the step it ends at) until the summary and step-rate services
    have written a point, then two more; the step of the summary's point."""
    started = time.monotonic()
    events.clear()
    while not written(events, "summary.written") or not written(events, "step_rate.written"):
        assert time.monotonic() - started < 60, "no early point"
        await sess.run(lambda: {"loss": float(sess.global_step + 1)})
        await anyio.sleep(0.01)
    (point,) = written(events, "summary.written")
    for _ in range(2):
        await sess.run(lambda: {"loss": float(sess.global_step + 1)})
    return int(point["step"])


async def test_a_run_shorter_than_the_interval_has_its_first_points_early_and_at_its_end(
    logdir: str, events: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default interval (two minutes) is longer than these sessions: each has a point
    # of the steps' means and of the rate soon after its first step, and one at its end.
    # The first after a restore is the mean of the steps since it, never one step's.
    from asupervisor.services import _first

    monkeypatch.setattr(_first, "FIRST_POINT_SECS", 0.2)
    sv = asv.Supervisor(logdir, checkpoint={}, save_model_secs=0, handle_signals=False)
    assert sv.save_summaries_secs == 120
    ends = []
    for _ in range(2):
        async with sv.session() as sess:
            start = sess.global_step
            early = await steps_until_written(sess, events)
            assert early >= start + 2
            ends.append((start, early, sess.global_step))
    _, acc = read_events(logdir)
    (s0, e0, end0), (s1, e1, end1) = ends
    assert s0 == 0
    assert s1 == end0  # the first session's final save
    mean = lambda a, b: (a + b) / 2  # noqa: E731 (the mean of the steps a..b's losses)
    expected = [(e0, mean(1, e0)), (end0, mean(e0 + 1, end0))]
    expected += [(e1, mean(s1 + 1, e1)), (end1, mean(e1 + 1, end1))]
    assert points(acc, "loss") == expected
    rates = [step for step, _ in points(acc, "global_step/sec")]
    assert len(rates) == 4 and rates[0] < end0 == rates[1] and s1 < rates[2] < end1 == rates[3]


async def test_the_first_step_rate_counts_from_a_save_after_the_first_step() -> None:
    # A restarted run's first timed save comes soon after its first step: the first
    # rate counts the steps after that save over the time since it, not the save.
    from types import SimpleNamespace

    from asupervisor.services.step_counter import after_save

    now_loop, now_mono = anyio.current_time(), time.monotonic()
    first = (10, now_loop - 5.0)  # the first step ended 5 s ago (on the loop's clock)
    saved = SimpleNamespace(last_save=(11, now_mono - 1.0), global_step=20)
    step, at = after_save(saved, first)  # type: ignore[arg-type]
    assert step == 11 and abs(at - (now_loop - 1.0)) < 0.5
    for last_save in [None, (11, None), (9, now_mono - 6.0), (20, now_mono - 1.0)]:
        # none, a restored one, one before the first step, one with no step since
        other = SimpleNamespace(last_save=last_save, global_step=20)
        assert after_save(other, first) == first  # type: ignore[arg-type]


async def test_tensorboard_shows_each_restart_its_lost_steps_and_the_goodput_at_the_restored_step(
    logdir: str, board: Board
) -> None:
    # A crash at step 8 (restored: 5), a clean end at 8 (restored: 8): the run's faults
    # are scalars at the step each session began from, and its history a text table. A
    # start after a clean end is a person's new start, not a restart (a new run segment).
    v = tf.Variable(0.0)
    await crash_after_eight_steps(logdir, v)
    for steps in (3, 2):
        async with every_step(logdir, v).session() as sess:
            for _ in range(steps):
                await sess.run(v.assign_add, 1.0)
    board.show(logdir, "faults")
    restarts = [(0, 0.0), (5, 1.0), (8, 1.0)]
    assert board.scalars("faults", "run/restarts", restarts) == restarts
    lost = [(5, 3.0)]  # 8 reached, 5 restored; the new start at 8 lost nothing
    assert board.scalars("faults", "run/steps_lost", lost) == lost
    goodput = board.scalars("faults", "run/goodput", lambda got: len(got) == 2)
    assert [step for step, _ in goodput] == [5, 8] and all(0 <= g <= 1 for _, g in goodput)
    texts = board.texts("faults", "run/history", lambda got: len(got) == 3)
    assert [step for step, _ in texts] == [0, 5, 8]
    table = texts[-1][1]
    assert "<table>" in table and "failed" in table and "done (0)" in table
    assert "1 restart, goodput" in table


async def test_a_killed_sessions_lost_steps_are_those_its_points_were_drawn_to(
    tmp_path: Any,
) -> None:
    # A killed session records no end, nor its step: the points it drew past the
    # restored step say how far it had come (at least).
    from asupervisor._logdir import ledger
    from asupervisor._logdir.store import Store
    from asupervisor._training.run_story import run_story

    store = Store(str(tmp_path))
    started = "2026-01-01T00:00:00+00:00"
    ledger.append(store, {"session": "a", "started": started, "restored_step": 0})
    ledger.append(store, {"session": "a", "first_step_at": "2026-01-01T00:00:10+00:00"})
    values = run_story(store, "b", 5, "checkpoint", drawn_to=9)
    assert values["run/restarts"] == 1.0 and values["run/steps_lost"] == 4.0
    assert values["run/rollbacks"] == 0.0
    assert "killed (no end recorded)" in values["run/history"]
    assert "| 2 | now | 5 | | running | | ≥ 4 |" in values["run/history"]


async def test_the_history_table_holds_new_starts_after_clean_ends_beside_restarts(
    tmp_path: Any,
) -> None:
    # Two runs that ended done, one after the other on one logdir, then one that failed
    # and its restart: the new starts lost nothing (a person's, each a run segment of its
    # own), the restart lost what the failed one trained past its restore. (The table
    # once read the restarts by the sessions' places and failed past the first new start.)
    from asupervisor._logdir import ledger
    from asupervisor._logdir.store import Store
    from asupervisor._training.run_story import run_story

    store = Store(str(tmp_path))
    t = "2026-01-01T00:00:{:02d}+00:00".format
    ended = [("a", 0, "done", 0, 10), ("b", 10, "done", 0, 20), ("c", 20, "failed", 1, 27)]
    for i, (session, restored, outcome, status, step) in enumerate(ended):
        ledger.append(store, {"session": session, "started": t(10 * i), "restored_step": restored})
        ledger.append(store, {"session": session, "first_step_at": t(10 * i + 1)})
        ledger.append(
            store,
            {"session": session, "ended": t(10 * i + 5), "outcome": outcome,
             "exit_status": status, "step": step},
        )  # fmt: skip
    values = run_story(store, "d", 25, "checkpoint", drawn_to=None)
    assert values["run/restarts"] == 1.0 and values["run/steps_lost"] == 2.0
    rows = [line for line in values["run/history"].splitlines() if line.startswith("| ")]
    lost = [row.split("|")[-2].strip() for row in rows[1:]]
    assert lost == ["", "", "", "2"], rows  # the last cell of each session's row
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["1", "2", "3", "4"], rows


KILLED_AT_EIGHT = """
import asyncio, sys
import tensorflow as tf
import asupervisor as asv

v = tf.Variable(0.0)
sv = asv.Supervisor(
    sys.argv[1], checkpoint={"v": v}, save_model_secs=0, save_model_steps=5,
    save_summaries_secs=0, save_summaries_steps=1, summary_fn=lambda: {"v": v},
    handle_signals=False,
)

async def main():
    async with sv.session() as sess:
        for _ in range(8):
            await sess.run(v.assign_add, 10.0)
            if sess.global_step == 7:
                sess.summary_computed({"sparse": 7.0})
        sv.summary_writer.flush()  # on disk, as TF's writer flushes every 10 events
        print("ready", flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_after_a_sigkill_tensorboard_draws_the_kept_history_and_the_restart(
    logdir: str, board: Board
) -> None:
    # A real SIGKILL at step 8 (checkpoint: 5): the process records no end. TensorBoard's
    # default loader draws no point of it past 5, and the restart is on the curves, its
    # lost steps those the killed session's points were drawn to (3).
    import subprocess
    import sys

    from tests import forked

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = forked.Popen(
        [sys.executable, "-c", KILLED_AT_EIGHT, logdir], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.kill()
    proc.wait(60)
    v = tf.Variable(0.0)
    async with every_step(logdir, v).session() as sess:
        assert sess.restore_report.step == 5
        for _ in range(3):
            await sess.run(v.assign_add, 1.0)
    board.show(logdir, "sigkill")
    kept = [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0), (5, 50.0), (6, 51.0), (7, 52.0), (8, 53.0)]
    assert board.scalars("sigkill", "v", kept) == kept
    # Loaded with the files "v" needed: the killed session's point at 7 is not among them.
    assert board.scalars("sigkill", "sparse", []) == []
    assert board.scalars("sigkill", "run/restarts", [(0, 0.0), (5, 1.0)]) == [(0, 0.0), (5, 1.0)]
    assert board.scalars("sigkill", "run/steps_lost", [(5, 3.0)]) == [(5, 3.0)]
    (_, table), *_ = board.texts("sigkill", "run/history", lambda got: len(got) == 2)[::-1]
    assert "killed (no end recorded)" in table and "≥ 3" in table  # at least 3 steps lost


async def test_an_events_file_a_writer_of_this_process_may_still_hold_is_not_rewritten(
    logdir: str,
) -> None:
    # A writer of the user's, open in the logdir across the restart: its file keeps its
    # points past the restore (what it writes next must land in a file TensorBoard reads).
    from tensorboard.backend.event_processing import plugin_event_accumulator

    os.makedirs(logdir)
    mine = tf.summary.create_file_writer(logdir)
    with mine.as_default():
        tf.summary.scalar("mine", 7.0, step=7)
    mine.flush()
    (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    v = tf.Variable(0.0)
    await crash_after_eight_steps(logdir, v)
    async with every_step(logdir, v).session() as sess:
        assert sess.restore_report.step == 5
        await sess.run(v.assign_add, 1.0)
    with mine.as_default():
        tf.summary.scalar("mine", 9.0, step=9)
    mine.close()
    assert [e.step for e in tf.compat.v1.train.summary_iterator(path) if e.summary.value] == [7, 9]
    # The session's own crashed file was rewritten all the same.
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    assert points(acc, "v") == [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0), (5, 50.0), (6, 51.0)]
    crashed = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))[1]
    assert max(e.step for e in tf.compat.v1.train.summary_iterator(crashed) if e.summary.value) == 5


async def test_a_rewrite_given_up_on_leaves_the_file_as_it_was(logdir: str) -> None:
    # A stop during the start-up gives the rewrite up: the file in hand stays whole.
    from asupervisor._training.past_points import drop_past_in

    v = tf.Variable(0.0)
    await crash_after_eight_steps(logdir, v)
    (crashed,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    before = records(crashed)
    looks = []

    def check() -> None:  # the third look: the rewrite has begun (the scan found 6..8)
        looks.append(1)
        if len(looks) > 2:
            raise RuntimeError("given up on")

    with pytest.raises(RuntimeError, match="given up on"):
        drop_past_in(logdir, [os.path.basename(crashed)], 5, 30.0, check)
    assert records(crashed) == before
    assert len(looks) >= 3 and not [n for n in os.listdir(logdir) if "asv-rewrite" in n]
