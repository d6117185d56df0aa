"""A search for broken promises: a real session driven through random sequences of what
users do, checked after each step against a plain reference model (hypothesis' stateful
testing). The minimal sequences it found are plain regression tests in the area files.

The event loop runs in the main thread (signals are real); the machine runs in a worker
thread and reaches the loop through anyio's portal. Each session's ``async with`` is held
open by a task of its own, the *body*, which leaves when the machine says so (cleanly or
with an error), as a training script's body would. Both anyio backends.

``ASV_FUZZ=1`` (``make fuzz``) runs a long search; the suite runs a short one.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import re
import shutil
import signal
import tempfile
import threading
from typing import Any

import anyio
import anyio.from_thread
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tensorboard.backend.event_processing import plugin_event_accumulator

import asupervisor as asv

BATCHES = 5  # per epoch, for train(epochs=)
FUZZ = os.environ.get("ASV_FUZZ") == "1"
SEARCH = settings(
    max_examples=200 if FUZZ else 8,
    stateful_step_count=40 if FUZZ else 14,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=not FUZZ,  # the suite's search is the same every run
)
END_SECS = 60  # a session that takes longer than this to end is stuck: a finding


class Flaky(Exception):
    pass


class Body:
    """One session's ``async with`` block, held open in a task of the loop."""

    def __init__(self, sv: asv.Supervisor) -> None:
        self.sv = sv
        self.end = anyio.Event()
        self.done = anyio.Event()
        self.raise_in_body: BaseException | None = None
        self.error: BaseException | None = None
        self.sess: asv.ManagedSession | None = None

    async def run(self, *, task_status: Any) -> None:
        try:
            async with self.sv.session() as sess:
                self.sess = sess
                task_status.started(sess)
                await self.end.wait()
                if self.raise_in_body is not None:
                    raise self.raise_in_body
        except BaseException as exc:  # what the session ended with: checked by the machine
            self.error = exc
            if self.sess is None:
                task_status.started(None)
        finally:
            self.done.set()


class Hooked(asv.Hook):
    """Armed by the machine: asks for a stop, or fails, after the next step."""

    def __init__(self) -> None:
        self.action: str | None = None
        self.error = RuntimeError("a hook failed")

    def after_run(self, ctx: asv.RunContext, result: Any) -> None:
        action, self.action = self.action, None
        if action == "stop":
            ctx.session.request_stop()
        elif action == "fail":
            raise self.error


class Sessions(RuleBasedStateMachine):
    """Sessions on one logdir, one after the other, and a reference of what must hold."""

    tg: Any = None  # the loop's task group, set by the test

    def __init__(self) -> None:
        super().__init__()
        self.logdir = tempfile.mkdtemp(prefix="asv-model-")
        self.v = tf.Variable(0.0)  # the state: one step adds one, so it equals the step
        self.hook = Hooked()
        self.body: Body | None = None
        self.sess: asv.ManagedSession | None = None
        # The reference model.
        self.step = 0
        self.position = (0, 0)
        self.positions = {0: (0, 0)}  # the position after each step (for restores)
        self.stopped = False
        self.checkpointing = False
        self.saved: int | None = None  # the newest step known to be saved
        self.outcome: asv.Outcome | None = None  # how the last session ended
        self.sessions = 0

    # -- helpers ---------------------------------------------------------------------

    def call(self, fn: Any, *args: Any) -> Any:
        return anyio.from_thread.run(fn, *args)

    def step_fn(self) -> None:
        self.v.assign_add(1.0)
        tf.summary.scalar("in_step", self.v)  # labelled with the step it leads to

    def stepped(self, count: int, position: tuple[int, int] | None = None) -> None:
        for _ in range(count):
            self.step += 1
            self.positions[self.step] = position or self.position

    def newest_on_disk(self) -> int | None:
        latest = tf.train.latest_checkpoint(self.logdir)
        if latest is None:
            return None
        reader = tf.train.load_checkpoint(latest)
        return int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))

    def end_session(self, error: BaseException | None = None) -> BaseException | None:
        """The body leaves (with ``error``); the session's own error, if it raised one."""
        body = self.body
        assert body is not None
        body.raise_in_body = error
        anyio.from_thread.run_sync(body.end.set)
        self.call(_wait, body.done, END_SECS)  # bounded, or it is stuck: a finding
        self.outcome = None if body.sess is None else body.sess.outcome
        self.body = self.sess = None
        return body.error

    def check_clean_end(self, error: BaseException | None, outcome: asv.Outcome) -> None:
        assert error is None, repr(error)
        assert self.outcome == outcome, (self.outcome, outcome)
        if self.checkpointing:
            assert self.newest_on_disk() == self.step  # the final checkpoint
            self.saved = self.step

    # -- rules -----------------------------------------------------------------------

    @precondition(lambda self: self.body is None)
    @rule(
        save_steps=st.sampled_from([None, 1, 3]),
        save_secs=st.sampled_from([0, 0.05]),
        background=st.booleans(),
        grace=st.sampled_from([2.0, 10.0]),
    )
    def open_session(
        self, save_steps: int | None, save_secs: float, background: bool, grace: float
    ) -> None:
        self.v = tf.Variable(0.0)  # a new process would have new objects: a restart has too
        sv = asv.Supervisor(
            self.logdir,
            checkpoint={"v": self.v},
            save_model_secs=save_secs,
            save_model_steps=save_steps,
            async_checkpoint=background,
            save_summaries_secs=0.05,
            summary_fn=lambda: {"v": self.v},
            stop_grace_secs=grace,
            hooks=[self.hook],
            max_to_keep=3,
        )
        newest = self.newest_on_disk()  # before the session's own first save
        self.body = Body(sv)
        self.sess = self.call(Sessions.tg.start, self.body.run)
        assert self.sess is not None, repr(self.body.error)
        self.sessions += 1
        self.checkpointing = save_secs > 0 or save_steps is not None
        restored = self.sess.restore_report
        if newest is None:
            assert restored.source in ("fresh", "init_fn") and restored.step == 0
            self.step, self.position = 0, (0, 0)
        else:  # the newest checkpoint, whatever ended the last session
            assert restored.source == "checkpoint" and restored.step == newest
            self.step, self.position = newest, self.positions[newest]
        if self.checkpointing:
            self.saved = self.step
        self.stopped = False
        self.hook.action = None

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(count=st.integers(1, 3))
    def run_steps(self, count: int) -> None:
        assert self.sess is not None
        for _ in range(count):
            self.call(self.sess.run, self.step_fn)
            self.stepped(1)

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(count=st.integers(1, 6))
    def train(self, count: int) -> None:
        assert self.sess is not None
        ran = self.call(self.sess.train, lambda _: self.step_fn(), range(count))
        assert ran == count
        self.stepped(count)

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(epochs=st.integers(1, 4))
    def train_epochs(self, epochs: int) -> None:
        assert self.sess is not None
        data = tf.data.Dataset.range(BATCHES)
        train = functools.partial(self.sess.train, epochs=epochs)
        ran = self.call(train, lambda _: self.step_fn(), data)
        epoch, batch = self.position
        if batch == BATCHES:
            epoch, batch = epoch + 1, 0  # the same place
        expected = max(0, (epochs - epoch) * BATCHES - batch) if epoch < epochs else 0
        assert ran == expected, (ran, expected, self.position)
        for _ in range(expected):
            batch += 1
            self.stepped(1, (epoch, batch))
            if batch == BATCHES:
                epoch, batch = epoch + 1, 0
                self.positions[self.step] = (epoch, batch)
        self.position = (epoch, batch)

    @precondition(lambda self: self.body is not None)
    @rule()
    def call_between_steps(self) -> None:
        assert self.sess is not None
        assert self.call(self.sess.call, lambda: float(self.v.numpy())) == self.step

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule()
    def save_now(self) -> None:
        assert self.sess is not None
        path = self.call(self.sess.save_checkpoint)
        assert path is not None and re.search(rf"model\.ckpt-{self.step}(_\d+)?$", path), path
        assert self.newest_on_disk() == self.step
        self.saved = self.step

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(source=st.sampled_from(["body", "hook", "service", "thread", "signal", "end_of_data"]))
    def stop(self, source: str) -> None:
        sess = self.sess
        assert sess is not None
        outcome = asv.Outcome.DONE
        if source == "hook":
            self.hook.action = "stop"
            self.call(sess.run, self.step_fn)
            self.stepped(1)
        elif source == "service":

            async def stopper(s: asv.ManagedSession) -> None:
                s.request_stop(reason="service_done")

            anyio.from_thread.run_sync(sess.start_service, stopper)
        elif source == "thread":
            coord = sess.supervisor.coord
            threading.Thread(target=coord.request_stop).start()
        elif source == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
            outcome = asv.Outcome.PREEMPTED
        elif source == "end_of_data":
            with pytest.raises(tf.errors.OutOfRangeError):
                self.call(sess.run, next, iter([]))
        if source != "body":
            self.call(_until, sess.should_stop, END_SECS)
            with pytest.raises(asv.SessionStopped):
                self.call(sess.run, self.step_fn)
        error = self.end_session()
        self.check_clean_end(error, outcome)

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(where=st.sampled_from(["step", "hook", "service"]))
    def fail(self, where: str) -> None:
        sess = self.sess
        assert sess is not None
        boom = RuntimeError(f"failed in a {where}")
        if where == "step":

            def failing() -> None:
                raise boom

            with pytest.raises(RuntimeError) as raised:
                self.call(sess.run, failing)
            assert raised.value is boom
            error = self.end_session(boom)  # the body lets it through, as a script would
        elif where == "hook":
            self.hook.action, self.hook.error = "fail", boom
            with pytest.raises(RuntimeError) as raised:
                self.call(sess.run, self.step_fn)
            assert raised.value is boom
            self.stepped(1)  # the step ran; its hook failed after it
            error = self.end_session(boom)
        else:

            async def failing_service(s: asv.ManagedSession) -> None:
                raise boom

            anyio.from_thread.run_sync(sess.start_service, failing_service)
            self.call(_wait, self.body.done, END_SECS)  # the session ends by itself
            error = self.end_session()
        assert error is boom, repr(error)
        assert self.outcome is asv.Outcome.FAILED
        newest = self.newest_on_disk()  # no final save after an error
        assert newest is None or newest <= self.step
        if self.checkpointing and newest is not None and newest < self.step:
            notes = getattr(error, "__notes__", [])
            lost = f"{self.step - newest} step(s) since the last checkpoint (step {newest})"
            assert any(lost in note for note in notes), (notes, lost)

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule()
    def recoverable_error(self) -> None:
        sess = self.sess
        assert sess is not None
        failed: list[int] = []

        def flaky() -> None:
            if not failed:
                failed.append(1)
                raise tf.errors.UnavailableError(None, None, "a flaky device")
            self.step_fn()

        if self.saved is None and self.newest_on_disk() is None:
            with pytest.raises(tf.errors.UnavailableError):  # nothing to recover from
                self.call(sess.run, flaky)
            self.end_session(RuntimeError("no checkpoint to recover from"))
            return
        before, known = self.step, self.saved or 0
        self.call(sess.run, flaky)
        restored = sess.global_step - 1  # the failed step ran again after the restore
        # The newest good checkpoint: no older than one known to be saved, and on disk.
        assert known <= restored <= before, (known, restored, before)
        assert glob.glob(os.path.join(self.logdir, f"model.ckpt-{restored}*.index"))
        self.step, self.position = restored, self.positions[restored]
        self.stepped(1)

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def the_session_and_the_reference_agree(self) -> None:
        if self.sess is None:
            return
        assert self.sess.global_step == self.step
        assert float(self.v.numpy()) == self.step  # one step boundary: state = step
        assert same_place(self.sess.data_position, self.position)

    @invariant()
    def every_checkpoint_holds_one_step_boundary(self) -> None:
        state = tf.train.get_checkpoint_state(self.logdir)  # committed: not a write in flight
        for path in [] if state is None else state.all_model_checkpoint_paths:
            reader = tf.train.load_checkpoint(path)
            step = int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))
            assert reader.get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE") == step
            assert step <= self.step or self.body is None

    def teardown(self) -> None:
        try:
            if self.body is not None:
                self.end_session()
            self.check_events()
        finally:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def check_events(self) -> None:
        """As TensorBoard reads the logdir (points a crashed session wrote past the
        checkpoint the next one resumed from are dropped): every tag's steps rise, and a
        point's value is its step."""
        if not glob.glob(os.path.join(self.logdir, "events.out.tfevents.*")):
            return
        # TensorBoard's own loader (its server's), which drops a crashed session's points.
        acc = plugin_event_accumulator.EventAccumulator(self.logdir, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in ("v", "in_step"):
            if tag not in acc.Tags()["tensors"]:
                continue
            points = [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            steps = [s for s, _ in points]
            assert steps == sorted(steps), (tag, points)
            assert all(math.isclose(s, value) for s, value in points), (tag, points)


def same_place(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """After an epoch's last batch, (e, BATCHES) and (e + 1, 0) are the same place: a
    checkpoint taken at that step holds the first, the position goes on to the second."""

    def normal(p: tuple[int, int]) -> tuple[int, int]:
        return (p[0] + 1, 0) if p[1] == BATCHES else p

    return normal(a) == normal(b)


async def _wait(event: anyio.Event, seconds: float) -> None:
    with anyio.fail_after(seconds):
        await event.wait()


async def _until(condition: Any, seconds: float) -> None:
    with anyio.fail_after(seconds):
        while not condition():
            await anyio.sleep(0.005)


@pytest.fixture
def quiet_sigterm() -> Any:
    """A SIGTERM the machine sends after a session has closed (it redelivers one that
    came while it stopped) must not end the test process."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sessions_keep_their_promises_under_random_sequences(
    backend: str, quiet_sigterm: Any
) -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            Sessions.tg = tg
            await anyio.to_thread.run_sync(
                lambda: run_state_machine_as_test(Sessions, settings=SEARCH)
            )
            tg.cancel_scope.cancel()

    anyio.run(main, backend=backend)
