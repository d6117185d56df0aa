"""The stop path: one owner per session, fenced threads, grace from draining, no silent loss.

Each test pins one scenario that was reproduced against the earlier runtime
(issue 11). Timings are bound by what happened, not by wall-clock figures.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import tensorflow as tf

import asupervisor as asv
from asupervisor.hooks import StopAtStepHook
from tests import forked
from tests.conftest import Pair, named

pytestmark = pytest.mark.anyio


def make(logdir: str | None, pair: Pair, **kwargs: Any) -> asv.Supervisor:
    kwargs.setdefault("save_model_secs", 0)
    kwargs.setdefault("save_model_steps", 1000)
    kwargs.setdefault("save_summaries_secs", 0)
    kwargs.setdefault("handle_signals", False)
    # Generous: a final save on a loaded machine can take a while; tests of the grace set it.
    kwargs.setdefault("stop_grace_secs", 30)
    return asv.Supervisor(logdir, checkpoint={"p": pair}, **kwargs)


def saved_step(path: str) -> int:
    return int(tf.train.load_checkpoint(path).get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))


class CountingHook(asv.Hook):
    def __init__(self) -> None:
        self.after_runs = 0
        self.saves: list[int] = []

    def after_run(self, ctx: asv.RunContext, result: Any) -> None:
        self.after_runs += 1

    def after_save(self, session: asv.ManagedSession, step: int, path: str) -> bool:
        self.saves.append(step)
        return False


async def test_an_abandoned_step_acts_no_more_when_it_finally_returns(logdir: str) -> None:
    pair, hook = Pair(), CountingHook()
    sv = make(logdir, pair, hooks=[hook], save_model_steps=1, stop_grace_secs=0.3)
    release, threads = threading.Event(), []

    def stuck(sess: asv.ManagedSession) -> None:
        threads.append(threading.current_thread())
        sess.request_stop()  # the stop comes while this step runs, and it outlives the grace
        release.wait()
        pair.step()

    with pytest.raises(asv.GracePeriodExpired, match="stuck"):
        async with sv.session() as sess:
            await sess.run(pair.step)
            await sess.run(stuck, sess)
    runs_before, saves_before = hook.after_runs, list(hook.saves)
    release.set()
    threads[0].join(30)
    assert not threads[0].is_alive()
    # It returned, but ran no hook, wrote no checkpoint, and asked the next session nothing.
    assert hook.after_runs == runs_before and hook.saves == saves_before
    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(pair.step)
        assert not sess.should_stop()
    assert sess.stop_reason == "requested"
    latest = tf.train.latest_checkpoint(logdir)
    assert latest.endswith(f"model.ckpt-{sess.global_step}")
    for name in os.listdir(logdir):
        if name.endswith(".index"):
            prefix = os.path.join(logdir, name[: -len(".index")])
            assert saved_step(prefix) == int(prefix.rsplit("-", 1)[1])  # no mislabelled file


async def test_an_idle_thread_is_never_stuck_and_the_final_save_happens(logdir: str) -> None:
    pair = Pair()
    sv = make(logdir, pair, hooks=[StopAtStepHook(last_step=5)], stop_grace_secs=1.5)
    async with sv.session() as sess:
        while not sess.should_stop():
            await sess.run(pair.step)
        await sess.call(time.sleep, 2.0)  # a final evaluation, longer than the grace
        await anyio.sleep(1.6)
    assert sess.stop_reason == "step_limit"
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-5")


async def test_a_grace_of_zero_does_not_wait_and_does_not_fail(logdir: str) -> None:
    pair = Pair()
    sv = make(logdir, pair, stop_grace_secs=0)
    async with sv.session() as sess:
        for _ in range(3):
            await sess.run(pair.step)
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-3")


async def test_a_hung_hook_is_bounded_by_the_watchdog_and_the_grace(logdir: str) -> None:
    pair, finished = Pair(), threading.Event()

    class Hangs(asv.Hook):
        def after_run(self, ctx: asv.RunContext, result: Any) -> None:
            if ctx.step == 2:
                time.sleep(8)
                finished.set()

    sv = make(logdir, pair, hooks=[Hangs()], step_timeout_secs=0.5, stop_grace_secs=0.3)
    with pytest.raises(asv.StepTimeout):
        async with sv.session() as sess:
            while True:
                await sess.run(pair.step)
    assert not finished.is_set(), "the session waited for the hung hook to return"


async def test_a_step_past_the_watchdogs_timeout_is_not_given_the_grace(logdir: str) -> None:
    # The step was judged stuck by its deadline: waiting stop_grace_secs for it again would
    # make a hang cost the deadline and the grace. Here the grace (60 s) outlasts the step
    # (8 s): a session that waited would see it end.
    pair, finished = Pair(), threading.Event()

    def slow() -> None:
        time.sleep(8)
        finished.set()

    sv = make(logdir, pair, step_timeout_secs=0.5, stop_grace_secs=60)
    with pytest.raises(asv.StepTimeout):
        async with sv.session() as sess:
            await sess.run(pair.step)
            await sess.run(slow)
    assert not finished.is_set(), "the session waited for a step past its deadline"
    assert sess.outcome is asv.Outcome.STUCK


async def test_a_step_that_crosses_its_deadline_after_the_stop_has_the_grace(logdir: str) -> None:
    # The deadline judges the step as it was when the stop came: one stopped at 0.3 s of a
    # 2 s step is no hang, though the 1 s deadline passes while it finishes.
    pair, finished = Pair(), threading.Event()

    def slow() -> None:
        time.sleep(2)
        finished.set()

    async def stop_soon(sess: asv.ManagedSession) -> None:
        await anyio.sleep(0.3)
        sess.request_stop()

    def quick() -> None:  # a first step: plain Python, no tracing inside the 1 s deadline
        pass

    sv = make(logdir, pair, step_timeout_secs=1, stop_grace_secs=60)
    async with sv.session() as sess:
        await sess.run(quick)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_soon, sess)
            await sess.run(slow)
    assert finished.is_set() and sess.outcome is asv.Outcome.DONE
    assert saved_step(tf.train.latest_checkpoint(logdir)) == 2  # the final save


def test_the_step_deadline_is_the_watchdogs_if_it_runs_and_the_runners_if_it_watches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asupervisor._session.runtime import step_deadline

    sv = asv.Supervisor(None, step_timeout_secs=7, heartbeat_secs=2, handle_signals=False)
    monkeypatch.setenv("ASUPERVISOR_STUCK_AFTER", "5")
    assert step_deadline(sv, watchdog=True, watched=True) == 6  # three beats at least
    assert step_deadline(sv, watchdog=True, watched=False) == 7  # inherited: no one watches
    assert step_deadline(sv, watchdog=False, watched=False) is None  # no watchdog runs
    # heartbeat_secs=0: no file, and the channel's beats every 2 s, as the runner judges them.
    off = asv.Supervisor(None, heartbeat_secs=0, handle_signals=False)
    monkeypatch.setenv("ASUPERVISOR_STUCK_AFTER", "1")
    assert step_deadline(off, watchdog=False, watched=True) == 6
    for bad in ("", "0", "-1", "nan", "soon"):
        monkeypatch.setenv("ASUPERVISOR_STUCK_AFTER", bad)
        assert step_deadline(sv, watchdog=False, watched=True) is None, bad


async def test_steps_after_a_stop_are_refused_and_the_session_ends_cleanly(logdir: str) -> None:
    pair = Pair()
    sv = make(logdir, pair, hooks=[StopAtStepHook(last_step=3)])
    refused: list[str] = []
    async with sv.session() as sess:
        try:
            for _ in range(10):  # a loop that never asks should_stop()
                await sess.run(pair.step)
        except asv.SessionStopped as exc:
            refused.append(str(exc))
            raise
    assert refused and "step_limit" in refused[0]
    assert float(pair.a.numpy()) == 3.0 and sess.global_step == 3
    assert tf.train.latest_checkpoint(logdir).endswith("model.ckpt-3")


async def test_state_is_saved_when_the_global_step_never_moves(
    logdir: str, events: list[dict[str, Any]]
) -> None:
    pair = Pair()
    forgotten = tf.Variable(0, dtype=tf.int64)  # the user forgot to advance it
    sv = make(logdir, pair, global_step=forgotten)
    async with sv.session() as sess:
        for _ in range(50):
            await sess.run(pair.step)
    assert len(named(events, "step.not_advancing")) == 1
    latest = tf.train.latest_checkpoint(logdir)
    # Beside the first checkpoint of step 0, never over it (a crash mid-rewrite would tear it).
    assert latest.endswith("model.ckpt-0_1")
    reader = tf.train.load_checkpoint(latest)
    assert reader.get_tensor("p/a/.ATTRIBUTES/VARIABLE_VALUE") == 50.0  # the trained state
    first = tf.train.load_checkpoint(os.path.join(logdir, "model.ckpt-0"))
    assert first.get_tensor("p/a/.ATTRIBUTES/VARIABLE_VALUE") == 0.0  # untouched


async def test_a_supervisor_leaves_the_users_checkpoint_unchanged(logdir: str) -> None:
    pair = Pair()
    ckpt = tf.train.Checkpoint(p=pair)
    for attempt in range(2):  # a retry loop, or a notebook cell run twice
        sv = asv.Supervisor(
            logdir, checkpoint=ckpt, save_model_secs=0, save_model_steps=100, handle_signals=False
        )
        async with sv.session() as sess:
            await sess.run(pair.step)
        assert sess.restore_report.step == attempt
    assert not hasattr(ckpt, "global_step")


async def test_settings_cannot_change_behind_validations_back(logdir: str) -> None:
    sv = make(logdir, Pair())
    with pytest.raises(AttributeError, match="fixed at construction"):
        sv.stop_grace_secs = -1  # type: ignore[misc]


async def test_overlapping_sessions_restore_signal_handlers_exactly(logdir: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed only in the main thread")
    original = signal.getsignal(signal.SIGTERM)
    first, second = Pair(), Pair()
    a = make(logdir + "-a", first, handle_signals=True)
    b = make(logdir + "-b", second, handle_signals=True)
    a_done = anyio.Event()

    async def run_a() -> None:
        async with a.session() as sess:
            for _ in range(3):
                await sess.run(first.step)
        a_done.set()

    async with anyio.create_task_group() as tg:
        async with b.session() as sess:
            tg.start_soon(run_a)
            await a_done.wait()  # a ended first, under b
            os.kill(os.getpid(), signal.SIGTERM)
            while not sess.should_stop():
                await sess.run(second.step)
                await anyio.sleep(0.01)
    assert sess.stop_reason == "signal"
    assert signal.getsignal(signal.SIGTERM) == original


async def test_a_waiting_non_chief_stops_on_sigterm(logdir: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed only in the main thread")
    sv = make(logdir, Pair(), is_chief=False, handle_signals=True, recovery_wait_secs=600)
    started = time.monotonic()

    async def terminate() -> None:
        await anyio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    async with anyio.create_task_group() as tg:
        tg.start_soon(terminate)
        async with sv.session(wait_for_checkpoint=True, max_wait_secs=600) as sess:
            assert sess.should_stop()
    # The first poll waits 600 s; the stop came long before it would have ended (a wide
    # bound: a loaded machine delays the stop by seconds, not minutes).
    assert time.monotonic() - started < 300
    assert sess.stop_reason == "signal" and sess.restore_report.source == "interrupted"


async def test_the_loop_never_stalls_while_a_session_closes_with_a_write_in_flight(
    logdir: str,
) -> None:
    big = tf.Module()
    big.w = [tf.Variable(tf.random.normal((12_500_000,))) for _ in range(4)]  # 200 MB
    sv = asv.Supervisor(
        logdir,
        checkpoint={"big": big},
        async_checkpoint=True,
        save_model_secs=0,
        save_model_steps=1,
        save_summaries_secs=0,
        handle_signals=False,
    )
    gaps: list[tuple[float, float]] = []  # (start of a heartbeat's sleep, how long it took)
    closing: list[float] = []
    stop = anyio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            began = time.perf_counter()
            await anyio.sleep(0.005)
            gaps.append((began, time.perf_counter() - began))

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        with pytest.raises(RuntimeError, match="body fails"):
            async with sv.session() as sess:
                # One step: the step-based save after it starts a 200 MB background write.
                await sess.run(lambda: big.w[0].assign_add(tf.ones_like(big.w[0])))
                closing.append(time.perf_counter())
                raise RuntimeError("body fails with the write in flight")
        closing.append(time.perf_counter())
        stop.set()
    start, end = closing
    during = [gap for began, gap in gaps if start <= began <= end]
    assert during, "no heartbeat while the session closed"
    # Joining the writer on the loop would stall it for the rest of the write: the
    # whole close. Off the loop, no beat takes more than a small part of it.
    assert max(during) < max(0.5 * (end - start), 0.1), (max(during), end - start)


def test_a_failed_lock_write_leaves_nothing_held(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import resource, signal, sys
        from asupervisor._logdir.lock import LogdirLock

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        lock = LogdirLock(sys.argv[1])
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        try:
            lock.acquire()
        except OSError as exc:
            print("failed", exc.errno)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        LogdirLock(sys.argv[1]).acquire()  # not LogdirLockedError against ourselves
        print("taken")
        """
    )
    done = forked.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["failed", "27", "taken"], done.stderr  # 27: EFBIG


def test_a_symlink_in_the_locks_place_is_refused_not_followed(tmp_path: Path) -> None:
    from asupervisor._logdir.lock import LogdirLock

    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / LogdirLock.NAME).symlink_to(victim)
    with pytest.raises(OSError, match="symlink"):
        LogdirLock(str(tmp_path)).acquire()
    assert victim.read_text() == "precious"


class SlowToDestroy:
    """Data whose iterator's destructor blocks until ``released`` is set, as a tf.data
    iterator's does while it waits for its background threads (seen: 2-5 s)."""

    def __init__(self, released: threading.Event) -> None:
        self.released = released
        self.destroyed_on: list[str] = []

    def __iter__(self) -> Any:
        return _SlowIterator(self)


class _SlowIterator:
    def __init__(self, data: SlowToDestroy) -> None:
        self.data = data

    def __next__(self) -> tuple[()]:
        return ()

    def __del__(self) -> None:
        self.data.destroyed_on.append(threading.current_thread().name)
        self.data.released.wait()


@pytest.mark.parametrize("epochs", [None, 2])
async def test_the_final_save_does_not_wait_for_the_datas_iterator_to_be_destroyed(
    logdir: str, pair: Pair, epochs: int | None
) -> None:
    released = threading.Event()
    valve = threading.Timer(30, released.set)  # old code: the session waits for this
    valve.start()
    data = SlowToDestroy(released)
    sv = make(logdir, pair, hooks=[StopAtStepHook(last_step=5)], stop_grace_secs=120)
    try:
        async with sv.session() as sess:
            await sess.train(pair.step, data, epochs=epochs)
        destroyed_early = released.is_set()
    finally:
        released.set()
        valve.cancel()
    assert not destroyed_early, "the session waited for the iterator's destructor"
    assert saved_step(tf.train.latest_checkpoint(logdir)) == 5
    with anyio.move_on_after(60):  # the releaser thread runs it when it gets the CPU
        while not data.destroyed_on:
            await anyio.sleep(0.05)
    assert data.destroyed_on and "asupervisor-training" not in data.destroyed_on


async def test_a_signal_to_a_body_that_trains_in_its_own_task_group_is_a_clean_stop(
    logdir: str, pair: Pair
) -> None:
    async def train(sess: asv.ManagedSession) -> None:
        while True:  # ends with SessionStopped, inside the body's own task group
            await sess.run(pair.step)
            if sess.global_step == 5:
                signal.raise_signal(signal.SIGTERM)
            await anyio.sleep(0)

    async with make(logdir, pair, handle_signals=True, stop_grace_secs=60).session() as sess:
        async with anyio.create_task_group() as tg:
            tg.start_soon(train, sess)
    assert sess.stop_reason == "signal" and sess.outcome is asv.Outcome.PREEMPTED
    latest = tf.train.latest_checkpoint(logdir)
    assert latest.endswith(f"model.ckpt-{sess.global_step}") and sess.global_step >= 5


class Departure(BaseException):
    """Not an Exception: what a service may raise to leave in a hurry."""


@pytest.mark.parametrize("raised", [Departure("gone"), GeneratorExit(), SystemExit(3)])
async def test_a_service_that_raises_a_base_exception_ends_the_session_with_that_object(
    logdir: str, pair: Pair, raised: BaseException
) -> None:
    sv = make(logdir, pair, stop_grace_secs=60)  # the first step's tracing may be slow

    @sv.service
    async def leaves(sess: asv.ManagedSession) -> None:
        await anyio.sleep(0.05)
        raise raised

    with pytest.raises(type(raised)) as caught:
        async with sv.session() as sess:
            while True:
                await sess.run(pair.step)
                await anyio.sleep(0.001)
    assert caught.value is raised  # the object itself, not wrapped in a group


async def test_a_hung_step_stops_within_one_grace_services_included(
    events: list[dict[str, Any]],
) -> None:
    """The grace is one deadline: a step that outlives it leaves none of it to the services
    (here one waits on the training thread behind the hung step, as the summary and
    step-counter services do), and the session ends at once."""
    grace = 3.0
    sv = asv.Supervisor(None, stop_grace_secs=grace, save_summaries_secs=0, handle_signals=False)
    finished = threading.Event()

    @sv.service
    async def behind_the_step(sess: asv.ManagedSession) -> None:
        while True:
            await sess.call(lambda: None)  # queued behind the hung step
            await anyio.sleep(0.01)

    def hangs(sess: asv.ManagedSession) -> None:
        sess.request_stop()  # the stop comes while this step runs
        time.sleep(grace + 2)  # longer than one grace, shorter than two
        finished.set()

    with pytest.raises(asv.GracePeriodExpired):
        async with sv.session() as sess:
            await sess.run(hangs, sess)
    # Bound by what happened: the session ended (its services cancelled) while the step
    # that outlived the grace was still running.
    assert not finished.is_set(), "the services were given a second grace"
    (stuck,) = named(events, "session.step_stuck")
    assert stuck["job"].endswith("<locals>.hangs")
