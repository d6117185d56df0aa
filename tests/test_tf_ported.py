"""TF's own tests of Supervisor, MonitoredSession, the session-run hooks and
CheckpointManager, ported to the public API: each names the TF test it ports.

Where TF's test mocks ``time.time``, the port runs on the real clock and drives TF's own
timer (``tf.compat.v1.train.SecondOrStepTimer``) beside the session, at the same step
boundaries: what TF would have done at the moments the steps really ended is the
expectation, so a loaded machine changes both alike. Where the figures depend on when
each step ended, the session's timers and TF's read a fake clock the test moves
(``StepClock``), as TF's test does.
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from typing import Any

import anyio
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import asupervisor as asv

pytestmark = pytest.mark.anyio


class TfSaverTimer(asv.Hook):
    """TF's CheckpointSaverHook's decisions, taken by TF's own timer at each step's end;
    and the saves the session made."""

    def __init__(self, save_secs: float) -> None:
        self.timer = tf.compat.v1.train.SecondOrStepTimer(every_secs=save_secs)
        self.tf_saves: list[int] = []
        self.saves: list[int] = []

    def after_create_session(self, session: asv.ManagedSession) -> None:
        step = session.global_step
        self.tf_saves.append(step)  # CheckpointSaverHook.after_create_session saves
        self.timer.update_last_triggered_step(step)

    def after_run(self, ctx: asv.RunContext, result: Any) -> None:
        step = ctx.session.global_step
        if self.timer.should_trigger_for_step(step):
            self.timer.update_last_triggered_step(step)
            self.tf_saves.append(step)

    def after_save(self, session: asv.ManagedSession, step: int, path: str) -> None:
        self.saves.append(step)


async def test_save_secs_saves_periodically(logdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """basic_session_run_hooks_test.CheckpointSaverHookTest.test_save_secs_saves_periodically,
    its clock halved: steps at 0, 0.25, 1.25, 1.3, 1.35 and 2.75 s with save_secs=1 save
    at [0, 3, 6], where the step that ends past the deadline is saved.

    As in TF's test, the clock is a fake one that only the test moves (the session's and
    TF's timer read it): a slow machine changes nothing."""
    from tensorflow.python.training import basic_session_run_hooks

    from asupervisor._checkpointing import writer
    from asupervisor._training import steps

    clock = StepClock(1000.0)
    for module in (steps, writer, basic_session_run_hooks):
        monkeypatch.setattr(module, "time", clock)
    v = tf.Variable(0.0)
    hook = TfSaverTimer(save_secs=1.0)
    sv = asv.Supervisor(
        logdir,
        checkpoint={"v": v},
        save_model_secs=1.0,
        save_summaries_secs=0,
        hooks=[hook],
        handle_signals=False,
    )
    async with sv.session() as sess:
        for at in (0, 0.25, 1.25, 1.3, 1.35, 2.75):
            clock.now = 1000.0 + at
            await sess.run(v.assign_add, 1.0)
    assert (hook.saves, hook.tf_saves) == ([0, 3, 6], [0, 3, 6])


# -- helpers -----------------------------------------------------------------------


class StepClock:
    """``time`` for the modules whose timers a test drives: ``time()`` and ``monotonic()``
    read ``now``, which only the test moves; the rest is the real module."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def quiet(logdir: str | None, checkpoint: Any = None, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_secs", 0)
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("handle_signals", False)
    return asv.Supervisor(logdir, checkpoint=checkpoint, **kwargs)


def kept(logdir: str, prefix: str = "model.ckpt") -> list[int]:
    """The checkpoints on disk by number (of ``<prefix>-<n>``), in order."""
    found = (re.fullmatch(re.escape(prefix) + r"-(\d+)\.index", n) for n in os.listdir(logdir))
    return sorted(int(m[1]) for m in found if m)


def points(path: str, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(path, size_guidance={"tensors": 0})
    acc.Reload()
    if tag not in acc.Tags()["tensors"]:
        return []
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def events_file(logdir: str) -> str:
    (path,) = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    return path


class Calls(asv.Hook):
    """What a hook was called with, in order."""

    def __init__(self, stop_after_save_at: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.stop_after_save_at = stop_after_save_at

    def after_create_session(self, session: asv.ManagedSession) -> None:
        self.calls.append(("after_create_session", session.global_step))

    def before_run(self, ctx: asv.RunContext) -> None:
        self.calls.append(("before_run", ctx.step))

    def after_run(self, ctx: asv.RunContext, result: Any) -> None:
        self.calls.append(("after_run", ctx.session.global_step))

    def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
        self.calls.append(("after_save", step))
        return step == self.stop_after_save_at

    def end(self, session: asv.ManagedSession) -> None:
        self.calls.append(("end", session.global_step))

    def of(self, name: str) -> list[int]:
        return [step for called, step in self.calls if called == name]


# -- basic_session_run_hooks_test: StopAtStepTest -------------------------------------


def test_raise_in_both_last_step_and_num_steps() -> None:
    """StopAtStepTest.test_raise_in_both_last_step_and_num_steps"""
    with pytest.raises(ValueError):
        asv.hooks.StopAtStepHook(num_steps=10, last_step=20)
    with pytest.raises(ValueError):
        asv.hooks.StopAtStepHook()


async def stops_when_set_to(logdir: str, hook: asv.Hook, start: int, steps: list[int]) -> None:
    """The global step set to each of ``steps`` in turn: the session stops at the last."""
    step = tf.Variable(start, dtype=tf.int64)
    sv = quiet(logdir, {"step": step}, global_step=step, hooks=[hook])
    async with sv.session() as sess:
        for value in steps:
            assert not sess.should_stop()
            await sess.run(step.assign, value)
        assert sess.should_stop() and sess.stop_reason == "step_limit"


async def test_stop_based_on_last_step(logdir: str) -> None:
    """StopAtStepTest.test_stop_based_on_last_step: the global step set to 5, 9, 10."""
    await stops_when_set_to(logdir, asv.hooks.StopAtStepHook(last_step=10), 0, [5, 9, 10])


async def test_stop_based_on_num_steps(logdir: str) -> None:
    """StopAtStepTest.test_stop_based_on_num_steps: from the step the session began at."""
    await stops_when_set_to(logdir, asv.hooks.StopAtStepHook(num_steps=10), 5, [13, 14, 15])


async def test_stop_based_with_multiple_steps(logdir: str) -> None:
    """StopAtStepTest.test_stop_based_with_multiple_steps: a step past the last one."""
    step = tf.Variable(0, dtype=tf.int64)
    sv = quiet(logdir, {"step": step}, global_step=step,
               hooks=[asv.hooks.StopAtStepHook(last_step=10)])  # fmt: skip
    async with sv.session() as sess:
        while not sess.should_stop():
            await sess.run(step.assign_add, 4)
    assert int(step.numpy()) == 12


# -- basic_session_run_hooks_test: CheckpointSaverHookTest -----------------------------


@pytest.mark.xfail(
    strict=True,
    reason="a Supervisor takes save_model_secs and save_model_steps together (docs/API.md)",
)
def test_raise_in_both_secs_and_steps(logdir: str) -> None:
    """CheckpointSaverHookTest.test_raise_in_both_secs_and_steps"""
    with pytest.raises(ValueError):
        asv.Supervisor(logdir, save_model_secs=10, save_model_steps=20)


async def test_save_checkpoint_before_first_train_step(logdir: str) -> None:
    """CheckpointSaverHookTest.test_save_checkpoint_before_first_train_step (and
    test_save_secs_saves_in_first_step): the state before any step is saved at creation."""
    v = tf.Variable(3.0)
    async with quiet(logdir, {"v": v}, save_model_secs=2).session() as sess:
        assert kept(logdir) == [0]
        assert (
            tf.train.load_checkpoint(os.path.join(logdir, "model.ckpt-0")).get_tensor(
                "v/.ATTRIBUTES/VARIABLE_VALUE"
            )
            == 3.0
        )
        await sess.run(v.assign_add, 1.0)


async def test_save_steps_saves_periodically(logdir: str) -> None:
    """CheckpointSaverHookTest.test_save_steps_saves_periodically"""
    v = tf.Variable(0.0)
    hook = Calls()
    async with quiet(logdir, {"v": v}, save_model_steps=2, max_to_keep=None,
                     hooks=[hook]).session() as sess:  # fmt: skip
        for _ in range(5):
            await sess.run(v.assign_add, 1.0)
    assert hook.of("after_save") == [0, 2, 4, 5]  # 5: CheckpointSaverHook.end


async def test_save_saves_at_end(logdir: str) -> None:
    """CheckpointSaverHookTest.test_save_saves_at_end"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, save_model_secs=2).session() as sess:
        for _ in range(2):
            await sess.run(v.assign_add, 1.0)
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-2")


async def test_save_secs_calls_listeners_at_begin_and_end(logdir: str) -> None:
    """CheckpointSaverHookTest.test_save_secs_calls_listeners_at_begin_and_end"""
    v = tf.Variable(0.0)
    hook = Calls()
    async with quiet(logdir, {"v": v}, save_model_secs=2, hooks=[hook]).session() as sess:
        for _ in range(2):
            await sess.run(v.assign_add, 1.0)
    assert hook.of("after_save") == [0, 2]


async def test_listener_stops_training_in_after_save(logdir: str) -> None:
    """CheckpointSaverHookTest.test_listener_stops_training_in_after_save"""
    v = tf.Variable(0.0)
    hook = Calls(stop_after_save_at=3)
    async with quiet(logdir, {"v": v}, save_model_steps=3, hooks=[hook]).session() as sess:
        while not sess.should_stop():
            await sess.run(v.assign_add, 1.0)
    assert sess.global_step == 3 and sess.stop_reason == "requested"


# -- basic_session_run_hooks_test: StepCounterHookTest, SummarySaverHookTest -----------


async def test_step_counter_every_n_steps(logdir: str) -> None:
    """StepCounterHookTest.test_step_counter_every_n_steps"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, save_summaries_steps=10).session() as sess:
        for _ in range(30):
            await sess.run(v.assign_add, 1.0)
    rates = points(events_file(logdir), "global_step/sec")
    assert [s for s, _ in rates] == [11, 21] and all(r > 0 for _, r in rates)


async def test_step_counter_every_n_secs(logdir: str) -> None:
    """StepCounterHookTest.test_step_counter_every_n_secs"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, save_summaries_secs=0.1).session() as sess:
        await sess.run(v.assign_add, 1.0)
        for _ in range(2):
            await anyio.sleep(0.2)
            await sess.run(v.assign_add, 1.0)
    rates = points(events_file(logdir), "global_step/sec")
    assert len(rates) >= 2 and all(r > 0 for _, r in rates), rates


async def test_global_step_name(logdir: str) -> None:
    """StepCounterHookTest.test_global_step_name"""
    step = tf.Variable(0, dtype=tf.int64, name="global_step_name")
    sv = quiet(logdir, {"step": step}, global_step=step, save_summaries_steps=2)
    async with sv.session() as sess:
        for _ in range(5):
            await sess.run(step.assign_add, 1)
    assert sv.rate_tag == "global_step_name/sec"
    assert points(events_file(logdir), "global_step_name/sec")


async def test_log_warning_if_global_step_not_increased(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """StepCounterHookTest.test_log_warning_if_global_step_not_increased"""
    step = tf.Variable(0, dtype=tf.int64)
    async with quiet(logdir, {"step": step}, global_step=step).session() as sess:
        for _ in range(20):
            await sess.run(lambda: None)
    assert [e["step"] for e in events if e["event"] == "step.not_advancing"] == [0]


async def summarized_at(logdir: str, every: int, steps: int) -> list[int]:
    """The steps ``summary_fn`` is written at, every ``every`` of ``steps`` steps."""
    v = tf.Variable(0.0)
    sv = quiet(logdir, {"v": v}, save_summaries_steps=every, summary_fn=lambda: {"v": v})
    async with sv.session() as sess:
        for _ in range(steps):
            await sess.run(v.assign_add, 1.0)
    return [s for s, _ in points(events_file(logdir), "v")]


async def test_summary_saver_save_steps(logdir: str) -> None:
    """SummarySaverHookTest.test_save_steps: every 8 of 30 steps, from the first."""
    assert await summarized_at(logdir, 8, 30) == [1, 9, 17, 25]


class TfSummaryTimer(asv.Hook):
    """TF's SummarySaverHook's decisions, by TF's own timer: asked before each step for
    the step it leads to, the summary written after it at the step reached."""

    def __init__(self, save_secs: float) -> None:
        self.timer = tf.compat.v1.train.SecondOrStepTimer(every_secs=save_secs)
        self.next_step: int | None = None
        self.request = False
        self.tf_points: list[int] = []

    def before_run(self, ctx: asv.RunContext) -> None:
        next_step = self.next_step
        self.request = next_step is None or self.timer.should_trigger_for_step(next_step)

    def after_run(self, ctx: asv.RunContext, result: Any) -> None:
        step = ctx.session.global_step
        if self.request:
            self.timer.update_last_triggered_step(step)
            self.tf_points.append(step)
        self.next_step = step + 1


@pytest.mark.xfail(
    strict=True,
    reason="timed summaries are a service's, written at the first step boundary past the "
    "interval, idle ones included; TF's SummarySaverHook writes at the first step that "
    "begins past it, and at the first step (docs/API.md)",
)
async def test_save_secs_saving_once_every_three_steps(logdir: str) -> None:
    """SummarySaverHookTest.test_save_secs_saving_once_every_three_steps, its clock
    scaled: a step every 0.2 s with save_secs=0.5."""
    v = tf.Variable(0.0)
    hook = TfSummaryTimer(save_secs=0.5)
    sv = quiet(logdir, {"v": v}, save_summaries_secs=0.5, summary_fn=lambda: {"v": v},
               hooks=[hook])  # fmt: skip
    async with sv.session() as sess:
        started = time.monotonic()
        for i in range(8):
            await anyio.sleep(max(0.0, started + 0.2 * i - time.monotonic()))
            await sess.run(v.assign_add, 1.0)
    written = [s for s, _ in points(events_file(logdir), "v")]
    assert written == hook.tf_points, (written, hook.tf_points)


# -- monitored_session_test -------------------------------------------------------------


async def test_saving_restoring_checkpoint(logdir: str) -> None:
    """MonitoredTrainingSessionTest.test_saving_restoring_checkpoint"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, save_model_secs=600).session() as sess:
        for _ in range(2):
            await sess.run(v.assign_add, 1.0)
    again = tf.Variable(0.0)
    async with quiet(logdir, {"v": again}, save_model_secs=600).session() as sess:
        assert sess.global_step == 2 and float(again.numpy()) == 2.0


async def test_save_checkpoint_steps(logdir: str) -> None:
    """MonitoredTrainingSessionTest.test_save_checkpoint_steps"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, save_model_steps=100, max_to_keep=None).session() as s:
        for _ in range(101):
            await s.run(v.assign_add, 1.0)
    assert kept(logdir) == [0, 100, 101]  # 101: CheckpointSaverHook.end at the close
    async with quiet(logdir, {"v": v}, save_model_steps=100).session() as sess:
        assert sess.global_step == 101


async def test_summaries_steps(logdir: str) -> None:
    """MonitoredTrainingSessionTest.test_summaries_steps"""
    assert await summarized_at(logdir, 100, 101) == [1, 101]


async def step_until_stopped(logdir: str, v: tf.Variable, hook: asv.Hook) -> int:
    """A session (restored from the last) that steps until its hook stops it: its step."""
    async with quiet(logdir, {"v": v}, save_model_secs=600, hooks=[hook]).session() as sess:
        while not sess.should_stop():
            await sess.run(v.assign_add, 1.0)
    return sess.global_step


async def test_last_step(logdir: str) -> None:
    """MonitoredSessionTest.test_last_step: across a restart from the checkpoint."""
    v = tf.Variable(0.0)
    assert await step_until_stopped(logdir, v, asv.hooks.StopAtStepHook(last_step=3)) == 3
    assert await step_until_stopped(logdir, v, asv.hooks.StopAtStepHook(last_step=5)) == 5
    assert float(v.numpy()) == 5.0


async def test_num_steps(logdir: str) -> None:
    """MonitoredSessionTest.test_num_steps: counted from the restored step."""
    v = tf.Variable(0.0)
    assert await step_until_stopped(logdir, v, asv.hooks.StopAtStepHook(num_steps=3)) == 3
    assert await step_until_stopped(logdir, v, asv.hooks.StopAtStepHook(num_steps=4)) == 7


async def test_recover_and_retry_on_aborted_error(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    """MonitoredSessionTest.test_recover_and_retry_on_aborted_error"""
    v = tf.Variable(0.0)
    failed: list[int] = []

    def step() -> None:
        v.assign_add(1.0)
        if float(v.numpy()) == 3.0 and not failed:
            failed.append(1)
            raise tf.errors.AbortedError(None, None, "abort")

    async with quiet(logdir, {"v": v}, save_model_steps=1).session() as sess:
        for _ in range(4):
            await sess.run(step)
    assert [e["restored_step"] for e in events if e["event"] == "step.recovered"] == [2]
    assert sess.global_step == 4 and float(v.numpy()) == 4.0  # the failed write undone


@pytest.mark.parametrize("error", ["OutOfRangeError", "StopIteration"])
async def test_exit_cleanly_on_end_of_data(logdir: str, error: str) -> None:
    """MonitoredSessionTest.test_exit_cleanly_on_out_of_range_exception and
    test_exit_cleanly_on_stop_iteration_exception"""
    v = tf.Variable(0.0)

    def step() -> None:
        if float(v.numpy()) == 2.0:
            if error == "StopIteration":
                raise StopIteration
            raise tf.errors.OutOfRangeError(None, None, "EOI")
        v.assign_add(1.0)

    async with quiet(logdir, {"v": v}).session() as sess:
        while not sess.should_stop():
            await sess.run(step)
    assert sess.stop_reason == "end_of_data" and sess.outcome is asv.Outcome.DONE


async def test_regular_exception_pass_through_run(logdir: str) -> None:
    """MonitoredSessionTest.test_regular_exception_pass_through_run"""
    failure = RuntimeError("a run error")

    def step() -> None:
        raise failure

    with pytest.raises(RuntimeError) as raised:
        async with quiet(logdir).session() as sess:
            await sess.run(step)
    assert raised.value is failure and sess.should_stop()


async def test_regular_exception_reported_to_coord_pass_through_run(logdir: str) -> None:
    """MonitoredSessionTest.test_regular_exception_reported_to_coord_pass_through_run"""
    sv = quiet(logdir)
    failure = RuntimeError("reported by a thread")
    with pytest.raises(RuntimeError) as raised:
        async with sv.session() as sess:
            thread = threading.Thread(target=sv.coord.request_stop, args=(failure,))
            thread.start()
            thread.join()
            await sess.sleep_until_stop(60)
            await sess.run(lambda: None)  # raises: the session has stopped
    assert raised.value is failure


async def test_stop_cleanly_when_no_exception_in_with_body(logdir: str) -> None:
    """MonitoredSessionTest.test_stop_cleanly_when_no_exception_in_with_body"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}).session() as sess:
        await sess.run(v.assign_add, 1.0)
        assert not sess.should_stop()
    assert sess.should_stop() and sess.outcome is asv.Outcome.DONE


async def test_raises_regular_exceptions_in_with_body(logdir: str) -> None:
    """MonitoredSessionTest.test_raises_regular_exceptions_in_with_body"""
    with pytest.raises(RuntimeError, match="in the body"):
        async with quiet(logdir).session() as sess:
            raise RuntimeError("in the body")
    assert sess.should_stop() and sess.outcome is asv.Outcome.FAILED


async def test_step_request_stop_in_a_loop(logdir: str) -> None:
    """MonitoredSessionTest.test_step_request_stop_in_a_loop: a step asks for the stop
    (ported: a hook's RunContext.request_stop)."""
    v = tf.Variable(0.0)

    class StopAt3(asv.Hook):
        def after_run(self, ctx: asv.RunContext, result: Any) -> None:
            if ctx.session.global_step == 3:
                ctx.request_stop()

    async with quiet(logdir, {"v": v}, hooks=[StopAt3()]).session() as sess:
        while not sess.should_stop():
            await sess.run(v.assign_add, 1.0)
    assert sess.global_step == 3


async def test_hooks_are_called_in_order(logdir: str) -> None:
    """HookedSessionTest.test_calls_hook_begin_end and test_run_with_hooks: after the
    session is created, around each run, at the end."""
    v = tf.Variable(0.0)
    hook = Calls()
    async with quiet(logdir, {"v": v}, hooks=[hook]).session() as sess:
        for _ in range(2):
            await sess.run(v.assign_add, 1.0)
    assert [c for c in hook.calls if c[0] != "after_save"] == [
        ("after_create_session", 0),
        ("before_run", 0), ("after_run", 1),
        ("before_run", 1), ("after_run", 2),
        ("end", 2),
    ]  # fmt: skip


# -- supervisor_test ----------------------------------------------------------------------


async def test_managed_session(logdir: str) -> None:
    """SupervisorTest.testManagedSession"""
    v = tf.Variable(0.0)
    sv = quiet(logdir, {"v": v})
    async with sv.session() as sess:
        for _ in range(10):
            await sess.run(v.assign_add, 1.0)
        assert not sv.should_stop()
    assert sv.should_stop() and float(v.numpy()) == 10.0


async def test_managed_session_user_error(logdir: str) -> None:
    """SupervisorTest.testManagedSessionUserError"""
    sv = quiet(logdir)
    with pytest.raises(RuntimeError, match="failing"):
        async with sv.session():
            raise RuntimeError("failing")
    assert sv.should_stop()


async def test_managed_session_ignore_out_of_range_error(logdir: str) -> None:
    """SupervisorTest.testManagedSessionIgnoreOutOfRangeError"""
    sv = quiet(logdir)
    async with sv.session() as sess:
        raise tf.errors.OutOfRangeError(None, None, "all done")
    assert sv.should_stop() and sess.outcome is asv.Outcome.DONE


async def test_managed_end_of_input(logdir: str) -> None:
    """SupervisorTest.testManagedEndOfInputOneQueue (a tf.data iterator for the queue)"""
    it = iter(tf.data.Dataset.range(5))
    total = tf.Variable(0, dtype=tf.int64)

    def step() -> None:
        total.assign_add(next(it))

    async with quiet(logdir, {"total": total}).session() as sess:
        while not sess.should_stop():
            await sess.run(step)
    assert int(total.numpy()) == 10 and sess.stop_reason == "end_of_data"


async def test_managed_session_do_not_keep_summary_writer(logdir: str) -> None:
    """SupervisorTest.testManagedSessionDoNotKeepSummaryWriter: written and closed."""
    sv = quiet(logdir)
    async with sv.session() as sess:
        sess.summary_computed({"c1": 1.0}, step=1)
        assert sv.summary_writer is not None
    assert sv.summary_writer is None
    assert points(events_file(logdir), "c1") == [(1, 1.0)]


async def test_chief_can_write_events(logdir: str) -> None:
    """SupervisorTest.testChiefCanWriteEvents"""
    async with quiet(logdir).session() as sess:
        sess.summary_computed({"c1": 1.0, "c2": 2.0})
    path = events_file(logdir)
    assert points(path, "c1") == [(0, 1.0)] and points(path, "c2") == [(0, 2.0)]


@pytest.mark.xfail(
    strict=True,
    reason="summary_computed where no summaries are written warns once, not RuntimeError "
    "(a multi-worker script runs the same code on every worker; docs/API.md)",
)
@pytest.mark.parametrize("where", ["non_chief", "no_logdir"])
async def test_cannot_write_events_raises(logdir: str, where: str) -> None:
    """SupervisorTest.testNonChiefCannotWriteEvents, testNoLogdirButWantSummary"""
    sv = quiet(logdir, is_chief=False) if where == "non_chief" else quiet(None)
    async with sv.session() as sess:
        with pytest.raises(RuntimeError):
            sess.summary_computed({"c1": 1.0})


async def test_logdir_but_explicitly_no_summary_writer(logdir: str) -> None:
    """SupervisorTest.testLogdirButExplicitlyNoSummaryWriter"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, summary_writer=None).session() as sess:
        await sess.run(v.assign_add, 1.0)
    assert not glob.glob(os.path.join(logdir, "events.*"))
    assert tf.train.latest_checkpoint(logdir) is None  # save_model_secs=0: none


async def test_no_logdir_but_explicit_summary_writer(tmp_path: Any) -> None:
    """SupervisorTest.testNoLogdirButExplicitSummaryWriter"""
    mine = str(tmp_path / "mine")
    writer = tf.summary.create_file_writer(mine)
    async with quiet(None, summary_writer=writer).session() as sess:
        sess.summary_computed({"c1": 1.0}, step=3)
    writer.flush()
    assert points(events_file(mine), "c1") == [(3, 1.0)]


async def test_no_logdir_succeeds(tmp_path: Any) -> None:
    """SupervisorTest.testNoLogdirSucceeds"""
    v = tf.Variable(0.0)
    sv = quiet(None, {"v": v}, save_model_secs=60)
    async with sv.session() as sess:
        await sess.run(v.assign_add, 1.0)
        assert sess.last_save is None and sv.summary_writer is None
    assert float(v.numpy()) == 1.0


async def test_init_fn(logdir: str) -> None:
    """SupervisorTest.testInitFn (and CheckpointManagerTest.testRestoreOrInitialize)"""
    v = tf.Variable(0.0)
    calls: list[int] = []

    def init_fn() -> None:
        calls.append(1)
        v.assign(7.0)

    async with quiet(logdir, {"v": v}, init_fn=init_fn, save_model_secs=600).session():
        assert float(v.numpy()) == 7.0
    v.assign(0.0)
    async with quiet(logdir, {"v": v}, init_fn=init_fn, save_model_secs=600).session():
        assert float(v.numpy()) == 7.0  # restored, not initialized again
    assert calls == [1]


async def test_default_global_step(logdir: str) -> None:
    """SupervisorTest.testDefaultGlobalStep: checkpoints are numbered by it."""
    v = tf.Variable(0.0)
    sv = quiet(logdir, {"v": v}, save_model_secs=600)
    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(v.assign_add, 1.0)
    assert sv.global_step.dtype == tf.int64 and int(sv.global_step.numpy()) == 3
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-3")


async def test_standard_services_with_global_step(logdir: str) -> None:
    """SupervisorTest.testStandardServicesWithGlobalStep: a summary and a checkpoint, at
    the global step."""
    step = tf.Variable(123, dtype=tf.int64)
    v = tf.Variable(1.0)
    sv = quiet(
        logdir, {"v": v, "step": step}, global_step=step, save_model_secs=600,
        save_summaries_secs=600, summary_fn=lambda: {"v": v},
    )  # fmt: skip
    async with sv.session() as sess:
        await sess.run(step.assign_add, 1)
    assert points(events_file(logdir), "v") == [(124, 1.0)]
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-124")


async def test_prepare_session_after_stop_for_chief(logdir: str) -> None:
    """SupervisorTest.testPrepareSessionAfterStopForChief: one Supervisor, a second session."""
    v = tf.Variable(0.0)
    sv = quiet(logdir, {"v": v}, save_model_secs=600)
    async with sv.session() as sess:
        await sess.run(v.assign_add, 1.0)
    assert sv.should_stop()
    async with sv.session() as sess:
        assert not sv.should_stop() and sess.global_step == 1
        await sess.run(v.assign_add, 1.0)
    assert float(v.numpy()) == 2.0


async def test_stop(logdir: str) -> None:
    """SupervisorTest.testStop: sv.request_stop() ends the session cleanly."""
    sv = quiet(logdir)
    async with sv.session() as sess:
        sv.request_stop()
        assert sv.should_stop() and sess.should_stop()
    assert sess.outcome is asv.Outcome.DONE


# -- checkpoint_management_test ---------------------------------------------------------


async def test_deletion(logdir: str) -> None:
    """CheckpointManagerTest.testDeletion: the newest max_to_keep are kept."""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, save_model_steps=1, max_to_keep=3).session() as sess:
        for _ in range(4):
            await sess.run(v.assign_add, 1.0)
    assert kept(logdir) == [2, 3, 4]
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-4")


async def test_keep_all(logdir: str) -> None:
    """CheckpointManagerTest.testKeepAll"""
    v = tf.Variable(0.0)
    async with quiet(logdir, {"v": v}, save_model_steps=1, max_to_keep=None).session() as sess:
        for _ in range(4):
            await sess.run(v.assign_add, 1.0)
    assert kept(logdir) == [0, 1, 2, 3, 4]


async def test_save_restore_state(logdir: str) -> None:
    """CheckpointManagerTest.testSaveRestoreState: a new manager (session) goes on with
    the checkpoints the last one kept."""
    v = tf.Variable(0.0)
    for _ in range(2):
        sv = quiet(logdir, {"v": v}, save_model_steps=1, max_to_keep=2)
        async with sv.session() as sess:
            for _ in range(3):
                await sess.run(v.assign_add, 1.0)
    assert kept(logdir) == [5, 6]


async def test_continue_from_unmanaged(logdir: str) -> None:
    """CheckpointManagerTest.testContinueFromUnmanaged: ckpt.save() twice, then managed
    saves; the unmanaged checkpoints are restored from, counted, and kept."""
    v = tf.Variable(1.0)
    checkpoint = tf.train.Checkpoint(v=v)
    prefix = os.path.join(logdir, "unusual_prefix")
    checkpoint.save(prefix)
    checkpoint.save(prefix)
    del checkpoint
    again = tf.train.Checkpoint(v=tf.Variable(0.0))
    sv = quiet(logdir, again, save_model_steps=1, max_to_keep=2)
    async with sv.session() as sess:
        assert sess.restore_report.source == "checkpoint" and int(again.save_counter) == 2
        for _ in range(3):
            await sess.run(again.v.assign_add, 1.0)
    assert int(again.save_counter) == 5
    assert kept(logdir) == [2, 3] and kept(logdir, "unusual_prefix") == [1, 2]
