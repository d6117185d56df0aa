"""The fence: work a session gave up on, or that comes after it, changes nothing."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from tests.conftest import Pair

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
    with anyio.fail_after(10):  # never a wait for a thread that has ended
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
        with anyio.fail_after(10):
            await hold(sess)
        tg.cancel_scope.cancel()
    assert outcomes == ["closed"]


def test_session_closed_is_what_a_fenced_job_meets() -> None:
    err: Any = asv.SessionClosed("x")
    assert isinstance(err, RuntimeError) and isinstance(err, asv.SupervisorError)
