"""What TF1's Supervisor and CheckpointManager did, the supervisor does too (or says why not)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from tests.conftest import Pair, named

pytestmark = pytest.mark.anyio


def quiet(logdir: str | None, pair: Pair, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_secs", 0)
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("handle_signals", False)
    return asv.Supervisor(logdir, checkpoint={"p": pair}, **kwargs)


async def test_the_coordinator_taken_before_the_session_is_the_sessions(
    logdir: str, pair: Pair
) -> None:
    sv = quiet(logdir, pair)
    coord = sv.coord  # TF1's usual pattern: threads get the coordinator up front
    first = RuntimeError("First")

    def worker() -> None:
        while not coord.should_stop():
            if float(pair.a.numpy()) >= 3:
                coord.request_stop(first)
            time.sleep(0.005)

    thread = threading.Thread(target=worker)
    with pytest.raises(RuntimeError) as raised:
        async with sv.session() as sess:
            thread.start()
            while not sess.should_stop():
                await sess.run(pair.step)
                await anyio.sleep(0.001)
    thread.join(10)
    assert raised.value is first and sess.stop_reason == "exception"
    assert sv.coord is coord


async def test_a_loop_given_the_coordinator_stops_the_session(logdir: str, pair: Pair) -> None:
    sv = quiet(logdir, pair)
    calls: list[int] = []

    def target(coord: asv.Coordinator) -> None:
        calls.append(1)
        if len(calls) == 5:
            coord.request_stop()

    sv.loop(0.01, target, sv.coord)
    async with sv.session() as sess:
        with anyio.fail_after(60):
            while not sess.should_stop():
                await sess.run(pair.step)
                await anyio.sleep(0.001)
    assert len(calls) >= 5 and sess.stop_reason == "requested"


async def test_a_loop_with_no_interval_calls_back_to_back_until_the_stop(
    logdir: str, pair: Pair
) -> None:
    sv = quiet(logdir, pair)
    calls: list[int] = []

    async def target() -> None:
        calls.append(1)
        if len(calls) == 50:
            sv.coord.request_stop()

    sv.loop(0, target)  # TF's LooperThread: 0 is back to back
    async with sv.session() as sess:
        with anyio.fail_after(60):
            await sess.sleep_until_stop(60)
    assert len(calls) == 50


async def test_timed_saves_count_from_the_last_save_of_any_kind(logdir: str, pair: Pair) -> None:
    # As TF's CheckpointSaverHook: a timed save comes `save_model_secs` after the last save,
    # never sooner; here an explicit save in between moves the next timed one on.
    saves: list[tuple[int, float]] = []

    class When(asv.Hook):
        def after_save(self, session: asv.ManagedSession, step: int, path: str) -> None:
            saves.append((step, time.monotonic()))

    interval = 0.6
    sv = quiet(logdir, pair, save_model_secs=interval, hooks=[When()])
    async with sv.session() as sess:
        started = time.monotonic()
        explicit_at = None
        with anyio.fail_after(120):  # until two timed saves came, however loaded the machine
            while explicit_at is None or len(saves) < 4:
                await sess.run(pair.step)
                await anyio.sleep(0.02)
                if explicit_at is None and time.monotonic() - started > interval / 2:
                    await sess.save_checkpoint()
                    explicit_at = sess.global_step
            await sess.run(pair.step)  # the final save is of a step of its own
        final = sess.global_step
    steps = [s for s, _ in saves]
    assert steps[0] == 0 and explicit_at in steps and steps[-1] == final
    timed = [i for i, s in enumerate(steps) if s not in (0, explicit_at, final)]
    assert len(timed) >= 2, saves
    # Each timed save comes at least the interval after the save before it (the explicit
    # one included): late under load, perhaps, but never early.
    gaps = [saves[i][1] - saves[i - 1][1] for i in timed]
    assert min(gaps) >= interval * 0.98, (saves, gaps)


async def test_keeping_one_checkpoint_every_n_hours_across_sessions_is_what_tf_keeps(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    hours = 1.0
    # (session, step) -> the clock at the save, in hours: three sessions, one manager each.
    schedule = [[0.0, 0.4, 1.1, 1.3], [2.2, 2.5], [3.3, 3.6, 4.7]]
    step = 0
    for times in schedule:
        pair, v = Pair(), tf.Variable(0.0)
        manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(v=v), theirs, max_to_keep=1, keep_checkpoint_every_n_hours=hours
        )
        sv = quiet(
            ours, pair, save_model_steps=1, max_to_keep=1, keep_checkpoint_every_n_hours=hours
        )
        async with sv.session() as sess:
            for i, at in enumerate(times):
                clock[0] = 1_000_000.0 + at * 3600
                if i or sess.restore_report.source == "checkpoint":
                    await sess.run(pair.step)  # saved by the step schedule
                step = sess.global_step
                manager.save(checkpoint_number=step)
    kept_ours = sorted(
        int(n.split("-")[1].split(".")[0]) for n in os.listdir(ours) if n.endswith(".index")
    )
    kept_theirs = sorted(
        int(n.split("-")[1].split(".")[0]) for n in os.listdir(theirs) if n.endswith(".index")
    )
    assert kept_ours == kept_theirs and len(kept_ours) > 1, (kept_ours, kept_theirs)


async def test_a_summary_asked_for_where_none_is_written_warns_once(
    logdir: str, pair: Pair, events: list[dict[str, Any]]
) -> None:
    # TF1 raised RuntimeError here; a multi-worker script runs the same code on every
    # worker, and only the chief writes summaries: a warning, once, instead.
    sv = quiet(logdir, pair, summary_writer=None)
    async with sv.session() as sess:
        for _ in range(3):
            sess.summary_computed({"x": 1.0})
    assert len(named(events, "summary.disabled")) == 1
