"""A search for broken promises: a real session driven through random sequences of what
users do, checked after each step against a plain reference model (hypothesis' stateful
testing). The minimal sequences it found are plain regression tests in the area files.

What it does: sessions one after the other on one logdir, with random settings; steps,
``train``, ``train(epochs=)``, Keras ``fit``; explicit saves; stops from every source; errors
in a step, a hook, a service; recoverable errors; NaN losses under a rollback policy; a
step that outlives the grace; services that do not end when asked (slow, swallowing their
cancellation, blocking the loop); a disk that fills (a small tmpfs). What it checks: after
each step, the session against the reference (the step, the state, the data position);
after every stop, that the session ended within its grace plus what the docs allow past
it, and that its exit status (``asv.exit_status(sess.outcome)``, and the ledger's end line)
is the one the reference predicts from what the sequence did; between sessions, every
committed checkpoint holds one step boundary and the history's head is the newest; at
the end, TensorBoard's reading of the events.

The event loop runs in the main thread (signals are real); the machine runs in a worker
thread and reaches the loop through anyio's portal. Each session's ``async with`` is held
open by a task of its own, the *body*, which leaves when the machine says so (cleanly or
with an error), as a training script's body would. Both anyio backends.

Seeded and bounded by time (tests/search.py): the seed is printed in the report's header
and at its end, ``ASV_SEED=<seed>`` runs the same sequences again, ``ASV_FUZZ=1`` (``make
fuzz``) searches long.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import keras
import numpy as np
import pytest
import tensorflow as tf
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
from asupervisor._logdir import ledger
from asupervisor._logdir.history import History, read_history
from asupervisor._logdir.store import Store
from tests.disk import fill, small_disk
from tests.search import FUZZ, Budget, search_budget, search_settings, seeded, traced

BATCHES = 5  # per epoch, for train(epochs=) and fit
END_SECS = 60  # a session that takes longer than this to end is stuck: a finding
# What the docs promise past the grace (docs/shutdowns.md, "One grace"): the stop is one
# deadline, stop_grace_secs from the body's leaving (or from the stop, for work that was
# in flight then); past it each part of the close gets a moment (0.1 s: the services, the
# events file, the checkpoint writer, the lock, the training thread), and the ledger line
# and the last beat up to 3 s.
PAST_GRACE = 5 * 0.1 + 3.0
HOPS = 0.5  # the machine's own calls between its thread and the loop, on a loaded machine
BLOCK_SECS = 1.0  # how long a service that blocks the loop blocks it (nothing can cut it)
MAX_ROLLBACKS = 2

DONE, PREEMPTED, FAILED, PERMANENT, STUCK = 0, 42, 1, 78, 124  # the docs' exit statuses
ANY_STATUS = (DONE, PREEMPTED, FAILED, PERMANENT, STUCK)


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


class Counts(keras.callbacks.Callback):
    """``fit``'s batches advance the machine's state variable, as steps do."""

    def __init__(self, machine: Sessions) -> None:
        super().__init__()
        self.machine = machine

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.machine.v.assign_add(1.0)


@functools.cache
def keras_model() -> tuple[keras.Model, list[np.ndarray]]:
    """One small model for the whole test (each session restores it, or ``init_fn``
    sets its first weights): Keras traces its train function once."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return model, model.get_weights()


def fit_data(nan_at: int | None) -> Any:
    """``fit``'s data, a function of the epoch; the batch numbered ``nan_at`` (counted
    from the run's first) holds a NaN."""

    def data(epoch: int) -> tf.data.Dataset:
        xs = np.ones((BATCHES, 1), "float32")
        if nan_at is not None and nan_at // BATCHES == epoch:
            xs[nan_at % BATCHES] = np.nan
        return tf.data.Dataset.from_tensor_slices((xs, 2 * xs)).batch(1)

    return data


@dataclass(frozen=True)
class Expect:
    """How the reference says a session ends: its exit status (one of), and the error
    it raises (a type, or ``None`` for a clean end)."""

    statuses: frozenset[int]
    error: type[BaseException] | tuple[type[BaseException], ...] | None = None

    @classmethod
    def of(cls, *statuses: int, error: Any = None) -> Expect:
        return cls(frozenset(statuses), error)


class Misbehaving:
    """A user's service that does not end when the session stops: ``slow`` ends only
    when cancelled, ``swallows`` does not end when cancelled either (until the machine
    lets it go, after the session), ``blocks`` blocks the event loop when the stop comes."""

    def __init__(self, kind: str, released: threading.Event) -> None:
        self.kind, self.released = kind, released
        self.name = f"misbehaving-{kind}"

    async def run(self, sess: asv.ManagedSession) -> None:
        if self.kind == "blocks":
            while not await sess.sleep_until_stop(1):
                pass
            time.sleep(BLOCK_SECS)  # blocks the loop: no library can interrupt it
        elif self.kind == "slow":
            while True:
                await anyio.sleep(0.05)
        else:
            while not self.released.is_set():
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.05)


@traced
class Sessions(RuleBasedStateMachine):
    """Sessions on one logdir, one after the other, and a reference of what must hold."""

    tg: Any = None  # the loop's task group, set by the test
    disk: Path | None = None  # a small tmpfs that the logdirs are on (None: not mounted)
    budget = Budget(0)  # set by the test

    def __init__(self) -> None:
        Sessions.budget.admit()
        super().__init__()
        self.logdir = tempfile.mkdtemp(prefix="asv-model-", dir=Sessions.disk)
        self.v = tf.Variable(0.0)  # the state: one step adds one, so it equals the step
        self.hook = Hooked()
        self.body: Body | None = None
        self.sess: asv.ManagedSession | None = None
        self.released = threading.Event()  # lets misbehaving services and hung steps go
        # The session's settings.
        self.checkpointing = False
        self.grace = 0.0
        self.lookback: int | None = None  # the rollback policy's (None: no policy)
        self.skip = 0
        self.blocking = False  # a service that blocks the loop at the stop runs
        # The reference model.
        self.step = 0
        self.position = (0, 0)
        self.positions = {0: (0, 0)}  # the position each step left, on the current line
        self.stopped = False
        self.known: list[int] = []  # commits on the head's line this session made or restored
        self.ever_committed = False  # a commit may have been made in the logdir
        self.rollbacks = 0  # divergences rolled back, as the logdir's history counts them
        self.outcome: asv.Outcome | None = None  # how the last session ended

    # -- helpers ---------------------------------------------------------------------

    def call(self, fn: Any, *args: Any) -> Any:
        return anyio.from_thread.run(fn, *args)

    def step_fn(self) -> None:
        self.v.assign_add(1.0)
        tf.summary.scalar("in_step", self.v)  # labelled with the step it leads to

    def nan_step(self) -> dict[str, Any]:
        self.step_fn()
        return {"loss": tf.constant(math.nan)}

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

    def history(self) -> History:
        return read_history(Store(self.logdir))

    def saved(self, step: int) -> None:
        """A commit at ``step`` is known to be on the head's line."""
        self.known = [*(k for k in self.known if k <= step), step]

    def went_back(self, step: int) -> None:
        """The session went back to the commit at ``step``: what came after it is gone
        from the head's line (a rollback), or was never there (a restore)."""
        self.known = [k for k in self.known if k <= step]
        if not self.known or self.known[-1] != step:
            self.known.append(step)

    def end_session(
        self,
        expect: Expect,
        error: BaseException | None = None,
        since: float | None = None,
        *,
        full: bool = False,
    ) -> BaseException | None:
        """The body leaves (with ``error``) if it has not; the session must end within its
        grace and what the docs allow past it, counted from ``since`` (the stop), and as
        ``expect`` says. Returns the error it ended with."""
        body = self.body
        assert body is not None
        began = time.monotonic() if since is None else since
        body.raise_in_body = error
        anyio.from_thread.run_sync(body.end.set)
        self.call(_wait, body.done, END_SECS)  # bounded, or it is stuck: a finding
        took = time.monotonic() - began
        self.released.set()  # what misbehaved may go now; the next session has its own
        self.released = threading.Event()
        bound = self.grace + PAST_GRACE + HOPS + (BLOCK_SECS if self.blocking else 0.0)
        assert took <= bound, f"the session took {took:.2f} s to end (grace {self.grace})"
        self.outcome = None if body.sess is None else body.sess.outcome
        self.body = self.sess = None
        self.blocking = False
        assert self.outcome is not None
        status = asv.exit_status(self.outcome)
        assert status in expect.statuses, (self.outcome, expect, repr(body.error))
        if expect.error is None:
            assert body.error is None, repr(body.error)
        else:
            assert isinstance(body.error, expect.error), (repr(body.error), expect)
        records = ledger.sessions(ledger.read(Store(self.logdir)))
        record = records[-1] if records else None
        if not (full and (record is None or record.ended is None)):  # or the disk refused it
            assert record is not None and record.exit_status == status, record
            assert record.outcome == self.outcome.value, record
        return body.error

    def final_checkpoint(self) -> None:
        """After a clean stop: the final checkpoint is the history's head, at the step."""
        if self.checkpointing:
            assert self.newest_on_disk() == self.step  # the final checkpoint
            head = self.history().head_commit()
            assert head is not None and head.step == self.step, head
            self.saved(self.step)

    def lost_note(self, error: BaseException) -> None:
        """An error a session ends with says how many steps were not saved."""
        newest = self.newest_on_disk()
        assert newest is None or newest <= self.step
        if self.checkpointing and newest is not None and newest < self.step:
            text = "\n".join([str(error), *getattr(error, "__notes__", [])])
            lost = f"{self.step - newest} step(s) since the last checkpoint (step {newest})"
            assert lost in text, (text, lost)

    # -- rules -----------------------------------------------------------------------

    @precondition(lambda self: self.body is None)
    @rule(
        save_steps=st.sampled_from([None, 1, 3]),
        save_secs=st.sampled_from([0, 0.05]),
        background=st.booleans(),
        grace=st.sampled_from([2.0, 4.0]),
        lookback=st.sampled_from([None, 0, 2]),
        skip=st.sampled_from([0, 1]),
    )
    def open_session(
        self,
        save_steps: int | None,
        save_secs: float,
        background: bool,
        grace: float,
        lookback: int | None,
        skip: int,
    ) -> None:
        self.v = tf.Variable(0.0)  # a new process would have new objects: a restart has too
        model, weights = keras_model()
        sv = asv.Supervisor(
            self.logdir,
            checkpoint={"v": self.v, "model": model, "opt": model.optimizer},
            init_fn=lambda: model.set_weights(weights),  # a fresh start's weights
            save_model_secs=save_secs,
            save_model_steps=save_steps,
            async_checkpoint=background,
            save_summaries_secs=0.05,
            summary_fn=lambda: {"v": self.v},
            stop_grace_secs=grace,
            hooks=[self.hook],
            max_to_keep=3,
            on_divergence=None
            if lookback is None
            else asv.Rollback(max_rollbacks=MAX_ROLLBACKS, lookback=lookback, skip=skip),
        )
        newest = self.newest_on_disk()  # before the session's own first save
        self.body = Body(sv)
        self.sess = self.call(Sessions.tg.start, self.body.run)
        assert self.sess is not None, repr(self.body.error)
        self.checkpointing = save_secs > 0 or save_steps is not None
        self.ever_committed = self.ever_committed or self.checkpointing
        self.grace, self.lookback, self.skip = grace, lookback, skip
        restored = self.sess.restore_report
        self.known = []
        if newest is None:
            assert restored.source in ("fresh", "init_fn") and restored.step == 0
            self.step, self.position = 0, (0, 0)
            if self.checkpointing:
                self.saved(0)  # right after a fresh start
        else:  # the newest checkpoint, whatever ended the last session
            assert restored.source == "checkpoint" and restored.step == newest
            self.step, self.position = newest, self.positions[newest]
            self.saved(newest)
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

    def batches_left(self, epochs: int) -> int:
        epoch, batch = self.position
        if batch >= BATCHES:
            epoch, batch = epoch + 1, 0  # the same place
        return max(0, (epochs - epoch) * BATCHES - batch) if epoch < epochs else 0

    def advance(self, count: int) -> None:
        """``count`` batches of ``train(epochs=)`` or ``fit``, from the position."""
        epoch, batch = self.position
        if batch >= BATCHES:
            epoch, batch = epoch + 1, 0
        for _ in range(count):
            batch += 1
            self.stepped(1, (epoch, batch))
            if batch == BATCHES:
                epoch, batch = epoch + 1, 0
                self.positions[self.step] = (epoch, batch)
        self.position = (epoch, batch)

    def nan_planned(self, offset: int | None, left: int) -> int | None:
        """Which batch of the call (0: its first) gets a NaN loss: only under a rollback
        policy, and only where the reference can tell what must follow whatever the
        timed saves did: ``DivergedError`` after ``max_rollbacks``, or with no commit in
        the logdir at all; a rollback when this session made or restored a commit far
        enough back (retention keeps a rollback's targets from then on)."""
        if offset is None or self.lookback is None or offset >= left:
            return None
        diverged = self.step + offset + 1
        if self.rollbacks >= MAX_ROLLBACKS or not self.ever_committed:
            return offset
        if any(k <= diverged - self.lookback for k in self.known):
            return offset
        return None

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(
        epochs=st.integers(1, 4),
        how=st.sampled_from(["train", "fit"]),
        nan=st.sampled_from([None, None, 0, 2, 4]),
    )
    def epochs(self, epochs: int, how: str, nan: int | None) -> None:
        """``train(epochs=)`` or Keras ``fit``, from the saved position to the end of
        ``epochs``; a NaN at a batch is rolled back past (or ends the run, DivergedError)."""
        sess = self.sess
        assert sess is not None
        left = self.batches_left(epochs)
        offset = self.nan_planned(nan, left)
        epoch, batch = self.position
        first = epoch * BATCHES + batch  # the number of the first batch it trains
        nan_at = None if offset is None else first + offset
        if how == "train":

            def step(x: tf.Tensor) -> dict[str, Any] | None:
                if nan_at is not None and int(x) == nan_at:
                    return self.nan_step()
                self.step_fn()
                return None

            def data(epoch: int) -> tf.data.Dataset:
                return tf.data.Dataset.range(epoch * BATCHES, (epoch + 1) * BATCHES)

            run = functools.partial(sess.train, step, data, epochs=epochs)
        else:
            model, _ = keras_model()
            run = functools.partial(
                sess.fit, model, fit_data(nan_at), epochs=epochs, callbacks=[Counts(self)],
                verbose=0,
            )  # fmt: skip
        if offset is None or nan_at is None:
            self.call(run)
            self.advance(left)
            return

        def up_to_nan() -> None:
            self.advance(offset + 1)
            self.position = (nan_at // BATCHES, nan_at % BATCHES + 1)  # just past it

        self.diverges(run, up_to_nan, epochs)

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule()
    def diverge_in_a_step(self) -> None:
        """A step of ``sess.run`` whose loss is NaN (the data is the loop's own: the
        position goes back with the state)."""
        sess = self.sess
        assert sess is not None
        if self.nan_planned(0, 1) is not None:
            self.diverges(functools.partial(sess.run, self.nan_step), lambda: self.stepped(1))

    def diverges(self, run: Any, up_to_nan: Any, epochs: int | None = None) -> None:
        """Run ``run``, which diverges (a NaN loss) after ``up_to_nan`` steps: a rollback
        to the newest commit on the head's line at least ``lookback`` steps before that is
        not unhealthy, the data past the batch that diverged (and ``skip`` more), a new
        branch committed, then (``epochs``) on to the end of the epochs; or, after
        ``max_rollbacks``, or with nothing to go back to, ``DivergedError`` (78)."""
        assert self.lookback is not None
        up_to_nan()
        diverged = self.step
        if self.rollbacks >= MAX_ROLLBACKS or not self.ever_committed:
            with pytest.raises(asv.DivergedError) as raised:
                self.call(run)
            error = self.end_session(Expect.of(PERMANENT, error=asv.DivergedError), raised.value)
            assert error is raised.value
            return
        self.call(run)
        history = self.history()
        self.rollbacks += 1
        assert len(history.divergences()) == self.rollbacks
        back = history.divergences()[-1]
        target = history.commit(back.to)
        assert back.at_step == diverged and target is not None and target.step is not None
        # The newest commit on the head's line at least `lookback` before, not unhealthy:
        # each commit the rollback left behind is nearer than that, or unhealthy.
        assert target.step <= diverged - self.lookback and target.healthy is not False
        for c in history.commits:
            if c.abandoned_by == back.number:
                assert c.seq > target.seq, (c, target)
                assert c.healthy is False or c.step is None or c.step > diverged - self.lookback
        restored = target.step
        self.step = restored
        if epochs is not None:  # past the batch that diverged, and `skip` more
            epoch, batch = self.position
            self.position = (epoch, batch + self.skip)
        else:
            self.position = self.positions[restored]
        if self.checkpointing:  # the new branch's first commit holds the moved position
            self.positions[restored] = self.position
            self.saved(restored)
        else:
            self.went_back(restored)
        if epochs is not None:
            self.advance(self.batches_left(epochs))

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
        assert path is not None
        assert self.newest_on_disk() == self.step
        assert os.path.basename(path) == self.history().head_commit().name  # type: ignore[union-attr]
        self.saved(self.step)
        self.ever_committed = True

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(source=st.sampled_from(["body", "hook", "service", "thread", "signal", "end_of_data"]))
    def stop(self, source: str) -> None:
        sess = self.sess
        assert sess is not None
        status = DONE
        began = time.monotonic()
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
            status = PREEMPTED
        elif source == "end_of_data":
            with pytest.raises(tf.errors.OutOfRangeError):
                self.call(sess.run, next, iter([]))
        if source != "body":
            self.call(_until, sess.should_stop, END_SECS)
            with pytest.raises(asv.SessionStopped):
                self.call(sess.run, self.step_fn)
        self.end_session(Expect.of(status), since=began)
        self.final_checkpoint()

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(where=st.sampled_from(["step", "hook", "service"]))
    def fail(self, where: str) -> None:
        sess = self.sess
        assert sess is not None
        boom = RuntimeError(f"failed in a {where}")
        began = time.monotonic()
        if where == "step":

            def failing() -> None:
                raise boom

            with pytest.raises(RuntimeError) as raised:
                self.call(sess.run, failing)
            assert raised.value is boom
            error = self.end_session(Expect.of(FAILED, error=RuntimeError), boom, began)
        elif where == "hook":
            self.hook.action, self.hook.error = "fail", boom
            with pytest.raises(RuntimeError) as raised:
                self.call(sess.run, self.step_fn)
            assert raised.value is boom
            self.stepped(1)  # the step ran; its hook failed after it
            error = self.end_session(Expect.of(FAILED, error=RuntimeError), boom, began)
        else:

            async def failing_service(s: asv.ManagedSession) -> None:
                raise boom

            body = self.body
            assert body is not None
            anyio.from_thread.run_sync(sess.start_service, failing_service)
            self.call(_wait, body.done, END_SECS)  # the session ends by itself
            error = self.end_session(Expect.of(FAILED, error=RuntimeError), since=began)
        assert error is boom, repr(error)
        self.lost_note(boom)

    @precondition(lambda self: self.body is not None and not self.stopped and self.known)
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

        before, known = self.step, self.known[-1]
        self.call(sess.run, flaky)
        restored = sess.global_step - 1  # the failed step ran again after the restore
        # The newest good checkpoint: no older than one known to be saved, and on the
        # head's line (the step that ran again may have been saved since).
        assert known <= restored <= before, (known, restored, before)
        line = self.history().line()
        assert line and line[0].step in (restored, restored + 1), line[:2]
        assert restored in [c.step for c in line], (restored, line)
        self.step, self.position = restored, self.positions[restored]
        self.went_back(restored)
        self.stepped(1)

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(how=st.sampled_from(["body", "signal"]))
    def hang_then_stop(self, how: str) -> None:
        """A step that outlives the grace: the session is over one grace after the stop,
        stuck (124), with no final checkpoint, saying how many steps were not saved."""
        sess = self.sess
        assert sess is not None
        released = self.released
        started = threading.Event()

        def hung() -> None:
            started.set()
            released.wait(END_SECS)  # until the machine lets it go, after the session

        async def step() -> None:
            with contextlib.suppress(Exception):
                await sess.run(hung)

        anyio.from_thread.run_sync(Sessions.tg.start_soon, step)
        assert started.wait(END_SECS)
        began = time.monotonic()
        if how == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        error = self.end_session(Expect.of(STUCK, error=asv.GracePeriodExpired), since=began)
        assert isinstance(error, asv.GracePeriodExpired)
        self.lost_note(error)

    @precondition(lambda self: self.body is not None and not self.stopped)
    @rule(kind=st.sampled_from(["slow", "swallows"]))
    def misbehaving_service(self, kind: str) -> None:
        """A service that does not end when asked: the session still ends within its
        grace."""
        assert self.sess is not None
        service = Misbehaving(kind, self.released)
        anyio.from_thread.run_sync(self.sess.start_service, service)

    @precondition(lambda self: self.body is not None and not self.stopped and not self.blocking)
    @rule()
    def blocking_service(self) -> None:
        """A service that blocks the loop when the stop comes: the session ends within its
        grace plus the block. One a session: the stop wakes every such service in the same
        turn of the loop, so their blocks add up, and a loop held past the grace (2 s
        without an answer) ends the process by design (docs/services.md; pinned in a
        process of its own by test_signals), which would end this test's process."""
        assert self.sess is not None
        service = Misbehaving("blocks", self.released)
        anyio.from_thread.run_sync(self.sess.start_service, service)
        self.blocking = True

    @precondition(lambda self: self.body is not None and Sessions.disk is not None)
    @rule(then=st.sampled_from(["leave", "steps", "signal"]))
    def disk_fills(self, then: str) -> None:
        """The logdir's disk fills: the session fails (1) if it cannot write what it
        must, the final checkpoint first; it never claims a clean end it did not have;
        the checkpoints already committed are untouched."""
        sess = self.sess
        assert sess is not None and Sessions.disk is not None
        filler = Sessions.disk / "filler"
        began = time.monotonic()
        with fill(filler):
            raised: BaseException | None = None
            ran = 0
            if then == "steps":
                for _ in range(3):
                    try:
                        self.call(sess.run, self.step_fn)
                    except Exception as exc:  # the events or a save could not be written
                        raised = exc
                        break
                    ran += 1
            elif then == "signal":
                os.kill(os.getpid(), signal.SIGTERM)
            self.stepped(ran)
            clean = PREEMPTED if then == "signal" else DONE
            if self.checkpointing and ran:
                expect = Expect.of(FAILED, error=Exception)  # the final save cannot be
            else:
                expect = Expect.of(FAILED, clean, error=(Exception, type(None)))
            error = self.end_session(expect, raised, began, full=True)
        if error is not None:
            text = "\n".join([repr(error), repr(error.__cause__), *getattr(error, "__notes__", [])])
            assert isinstance(error, asv.CheckpointSaveError) or "events.out" in text, text
        elif self.checkpointing:
            self.final_checkpoint()

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def within_the_budget(self) -> None:
        Sessions.budget.check()

    @invariant()
    def the_session_and_the_reference_agree(self) -> None:
        if self.sess is None:
            return
        assert self.sess.global_step == self.step
        assert float(self.v.numpy()) == self.step  # one step boundary: state = step
        assert same_place(self.sess.data_position, self.position)

    @invariant()
    def every_checkpoint_holds_one_step_boundary(self) -> None:
        """Every listed checkpoint holds one step boundary; the ones on the head's line
        are at or before the session's step (a rollback's abandoned commits stay listed
        until the next commit sweeps them, and may be past it)."""
        state = tf.train.get_checkpoint_state(self.logdir)  # committed: not a write in flight
        line = {c.name for c in self.history().line()}
        for path in [] if state is None else state.all_model_checkpoint_paths:
            reader = tf.train.load_checkpoint(path)
            step = int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))
            assert reader.get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE") == step
            if os.path.basename(path) in line and self.body is not None:
                assert step <= self.step, (path, self.step, self.history().line())

    @invariant()
    def between_sessions_the_head_is_the_newest_and_the_rollbacks_counted(self) -> None:
        if self.body is not None:
            return
        history = self.history()
        assert len(history.divergences()) == self.rollbacks
        head = history.head_commit()
        latest = tf.train.latest_checkpoint(self.logdir)
        assert (head is None) == (latest is None), (head, latest)
        if head is not None:
            assert latest is not None and os.path.basename(latest) == head.name

    def teardown(self) -> None:
        Sessions.budget.ended()
        try:
            if self.body is not None:
                anything = (BaseException, type(None))  # a sequence cut short, or failed
                self.end_session(Expect.of(*ANY_STATUS, error=anything))
            self.check_events()
        finally:
            self.released.set()
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
        return (p[0] + 1, 0) if p[1] >= BATCHES else p

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


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path | None]:
    """A real file system of 16 MiB that can be filled, or ``None`` where none can be
    mounted (the search then never fills a disk)."""
    with small_disk(tmp_path / "disk") as mounted:
        yield mounted


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sessions_keep_their_promises_under_random_sequences(
    backend: str, quiet_sigterm: Any, disk: Path | None
) -> None:
    budget = search_budget(suite=2, fuzz=600)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            Sessions.tg, Sessions.disk, Sessions.budget = tg, disk, budget
            settings = search_settings(examples=2000 if FUZZ else 100, steps=40 if FUZZ else 14)
            with budget.reporting():
                await anyio.to_thread.run_sync(
                    lambda: run_state_machine_as_test(seeded(Sessions), settings=settings)
                )
            tg.cancel_scope.cancel()

    anyio.run(main, backend=backend)
