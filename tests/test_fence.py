"""The fence: work a session gave up on, or that comes after it, changes nothing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from tests.conftest import Pair, pair_supervisor

pytestmark = pytest.mark.anyio


class Record(asv.Hook):
    def __init__(self) -> None:
        self.created: list[int] = []
        self.ended: list[int] = []

    def after_create_session(self, session: asv.ManagedSession) -> None:
        self.created.append(session.global_step)

    def end(self, session: asv.ManagedSession) -> None:
        self.ended.append(session.global_step)


async def test_a_start_up_interrupted_during_init_fn_acts_no_further(logdir: str) -> None:
    v = tf.Variable(0.0)
    started, finished = threading.Event(), threading.Event()

    def init_fn() -> None:
        started.set()
        time.sleep(1.0)  # slow pre-trained weights
        v.assign(42.0)
        finished.set()

    hook = Record()
    sv = asv.Supervisor(
        logdir, checkpoint={"v": v}, init_fn=init_fn, hooks=[hook], handle_signals=False
    )
    stopper = threading.Thread(target=lambda: started.wait(10) and sv.coord.request_stop())
    stopper.start()
    async with sv.session() as sess:
        assert sess.restore_report.source == "interrupted"
        # Queued behind the start-up job: it runs once init_fn has returned.
        source = await sess.call(lambda: sess.restore_report.source)
    stopper.join()
    assert finished.is_set() and source == "interrupted"
    assert sess.restore_report.source == "interrupted"
    assert hook.created == [] and hook.ended == []  # no hook ran for the fenced start-up
    assert tf.train.latest_checkpoint(logdir) is None  # and nothing was saved
    assert not [n for n in os.listdir(logdir) if n.startswith("model.ckpt")]


async def test_work_given_to_a_closed_session_is_refused_with_a_public_error(
    logdir: str, pair: Pair
) -> None:
    sv = asv.Supervisor(logdir, checkpoint={"p": pair}, handle_signals=False)
    async with sv.session() as sess:
        await sess.run(pair.step)
    with anyio.fail_after(120):  # never a wait for a thread that has ended
        with pytest.raises(asv.SessionClosed):
            async with sess.between_steps():
                pass
        with pytest.raises(asv.SessionClosed) as raised:
            await sess.call(pair.step)
    assert isinstance(raised.value, asv.SupervisorError)
    with pytest.raises(asv.SessionStopped):
        await sess.run(pair.step)


async def test_a_hold_asked_for_as_the_session_closes_is_released_not_left_waiting(
    logdir: str, pair: Pair
) -> None:
    sv = asv.Supervisor(logdir, checkpoint={"p": pair}, handle_signals=False)
    outcomes: list[str] = []

    async def hold(sess: asv.ManagedSession) -> None:
        try:
            async with sess.between_steps():
                outcomes.append("held")
        except asv.SessionClosed:
            outcomes.append("closed")

    async with anyio.create_task_group() as tg:
        async with sv.session() as sess:
            await sess.run(pair.step)
        with anyio.fail_after(120):
            await hold(sess)
        tg.cancel_scope.cancel()
    assert outcomes == ["closed"]


def test_session_closed_is_what_a_fenced_job_meets() -> None:
    err: Any = asv.SessionClosed("x")
    assert isinstance(err, RuntimeError) and isinstance(err, asv.SupervisorError)


async def test_a_restore_given_up_on_writes_nothing_into_the_logdir_after_the_session_ends(
    logdir: str,
) -> None:
    """A stop during the restore ends the session before it trains; the restore it gave
    up on goes on by itself on the training thread, and writes nothing into the logdir
    (no history, no state file) once the session has ended and released the lock."""
    from asupervisor._checkpointing import restorer

    pair = Pair()
    async with pair_supervisor(logdir, pair).session() as sess:
        for _ in range(4):
            await sess.run(pair.step)  # 0, 2, 4
    data = Path(logdir, "model.ckpt-4.data-00000-of-00001")
    data.write_bytes(data.read_bytes()[:7])  # damaged: the restore falls back (and records it)
    reading, release, finished = threading.Event(), threading.Event(), threading.Event()
    real_problem, real_newest = restorer.checkpoint_problem, restorer.Restorer.restore_newest

    def slow(store: Any, prefix: str, names: Any = None) -> str | None:
        if prefix.endswith("model.ckpt-2"):
            reading.set()
            release.wait(60)
        return real_problem(store, prefix, names)

    def newest(self: Any) -> Any:
        try:
            return real_newest(self)
        finally:
            finished.set()

    history = Path(logdir, ".asupervisor.history")
    state = Path(logdir, "checkpoint")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(restorer, "checkpoint_problem", slow)
        patch.setattr(restorer.Restorer, "restore_newest", newest)
        sv = pair_supervisor(logdir, Pair(), stop_grace_secs=0.5)
        async with anyio.create_task_group() as tg:

            async def stop_while_restoring() -> None:
                while not reading.is_set():
                    await anyio.sleep(0.01)
                sv.request_stop()

            tg.start_soon(stop_while_restoring)
            async with sv.session() as sess:
                assert sess.restore_report.source == "interrupted"
        before = history.read_bytes(), state.read_bytes()
        release.set()
        assert await anyio.to_thread.run_sync(finished.wait, 60)
    assert (history.read_bytes(), state.read_bytes()) == before
