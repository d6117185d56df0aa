"""Hooks run on the training thread around every step, in order."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

import asupervisor as asv
from asupervisor.hooks import LoggingHook, NanLossHook, StopAtStepHook
from tests.conftest import Pair, named

pytestmark = pytest.mark.asyncio


class Recorder(asv.Hook):
    def __init__(self, tag: str, calls: list[tuple[str, str, Any]]) -> None:
        self.tag, self.calls = tag, calls
        self.threads: set[int] = set()

    def _note(self, what: str, detail: Any = None) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append((self.tag, what, detail))

    def begin(self, supervisor: asv.Supervisor) -> None:
        self._note("begin")

    def after_create_session(self, session: asv.ManagedSession) -> None:
        self._note("after_create_session", session.global_step)

    def before_run(self, ctx: asv.RunContext) -> None:
        self._note("before_run", ctx.step)

    def after_run(self, ctx: asv.RunContext, result: Any) -> None:
        self._note("after_run", (ctx.step, ctx.session.global_step, result))

    def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
        self._note("after_save", step)
        return False

    def end(self, session: asv.ManagedSession) -> None:
        self._note("end", session.global_step)


async def test_hooks_run_in_order_on_the_training_thread(logdir: str) -> None:
    calls: list[tuple[str, str, Any]] = []
    first, second = Recorder("1", calls), Recorder("2", calls)
    sv = asv.Supervisor(logdir, hooks=[first, second], save_summaries_secs=0, handle_signals=False)
    async with sv.session() as sess:
        await sess.run(lambda x: x * 2, 21)
    assert calls == [
        ("1", "begin", None),
        ("2", "begin", None),
        ("1", "after_create_session", 0),
        ("2", "after_create_session", 0),
        ("1", "after_save", 0),
        ("2", "after_save", 0),
        ("1", "before_run", 0),
        ("2", "before_run", 0),
        ("1", "after_run", (0, 1, 42)),
        ("2", "after_run", (0, 1, 42)),
        ("1", "end", 1),
        ("2", "end", 1),
        ("1", "after_save", 1),
        ("2", "after_save", 1),
    ]
    assert len(first.threads | second.threads) == 1
    assert threading.get_ident() not in first.threads


async def test_end_is_not_called_after_an_error() -> None:
    calls: list[tuple[str, str, Any]] = []
    sv = asv.Supervisor(None, hooks=[Recorder("r", calls)], handle_signals=False)
    with pytest.raises(ZeroDivisionError):
        async with sv.session() as sess:
            await sess.run(lambda: 1 / 0)
    assert "end" not in [what for _, what, _ in calls]


async def test_after_save_returning_true_requests_a_stop(logdir: str, pair: Pair) -> None:
    class StopAfterSave(asv.Hook):
        def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
            return step >= 3

    sv = asv.Supervisor(
        logdir,
        checkpoint={"p": pair},
        save_model_steps=3,
        hooks=[StopAfterSave()],
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        while not sess.should_stop():
            await sess.run(pair.step)
    assert sess.global_step == 3


async def test_stop_at_step_hook_stops_at_exactly_last_step(logdir: str, pair: Pair) -> None:
    sv = asv.Supervisor(
        logdir,
        checkpoint={"p": pair},
        hooks=[StopAtStepHook(last_step=5)],
        save_summaries_secs=0,
        handle_signals=False,
    )
    async with sv.session() as sess:
        while not sess.should_stop():
            await sess.run(pair.step)
    assert sess.global_step == 5 and sess.stop_reason == "step_limit"
    num = StopAtStepHook(num_steps=4)
    again = asv.Supervisor(
        logdir, checkpoint={"p": pair}, hooks=[num], save_summaries_secs=0, handle_signals=False
    )
    async with again.session() as sess:
        assert num.last_step == 9
        while not sess.should_stop():
            await sess.run(pair.step)
    assert sess.global_step == 9


async def test_nan_loss_hook_raises_or_stops() -> None:
    losses = iter([1.0, 0.5, math.nan, 0.1])
    sv = asv.Supervisor(None, hooks=[NanLossHook()], handle_signals=False)
    with pytest.raises(asv.NanLossError, match="step 3"):
        async with sv.session() as sess:
            while True:
                await sess.run(lambda: {"loss": next(losses)})
    soft = asv.Supervisor(None, hooks=[NanLossHook(fail_on_nan=False)], handle_signals=False)
    async with soft.session() as sess:
        for loss in (1.0, math.nan, 2.0):
            if sess.should_stop():
                break
            await sess.run(lambda v=loss: v)
    assert sess.stop_reason == "nan" and sess.global_step == 2


async def test_logging_hook_logs_every_n_steps(events: list[dict[str, Any]]) -> None:
    sv = asv.Supervisor(None, hooks=[LoggingHook(every_n_steps=3)], handle_signals=False)
    async with sv.session() as sess:
        for i in range(7):
            await sess.run(lambda v=i: {"loss": float(v)})
    logged = named(events, "step.logged")
    assert [(e["step"], e["loss"]) for e in logged] == [(1, 0.0), (4, 3.0), (7, 6.0)]


async def test_stop_at_step_traces_across_restarts(logdir: str) -> None:
    """last_step=5 stops at 5; a restart with last_step=8 stops at 8;
    num_steps=4 after a restore at 3 stops at 7."""

    async def train(hook: StopAtStepHook, directory: str) -> int:
        pair = Pair()
        sv = asv.Supervisor(
            directory,
            checkpoint={"p": pair},
            hooks=[hook],
            save_summaries_secs=0,
            handle_signals=False,
        )
        async with sv.session() as sess:
            while not sess.should_stop():
                await sess.run(pair.step)
        assert sess.stop_reason == "step_limit"
        return sess.global_step

    assert await train(StopAtStepHook(last_step=5), logdir) == 5
    assert await train(StopAtStepHook(last_step=8), logdir) == 8
    other = logdir + "-b"
    assert await train(StopAtStepHook(last_step=3), other) == 3
    assert await train(StopAtStepHook(num_steps=4), other) == 7
    assert await train(StopAtStepHook(last_step=7), other) == 7  # already there: no step
