"""The same search across real processes: a trainer (tests/faults/trainer.py) started, run
a while, SIGKILLed, sent SIGTERM, told to stop, made to diverge, and met by a second
writer, at random, again and again on one logdir. After each step what is on disk is
checked against a plain reference, read through the library's own history reader and
TensorFlow's: every committed checkpoint reads back whole at one step boundary, a restart
restores the newest complete checkpoint, the history's head is the final checkpoint of a
clean end, the exit status and the ledger's end line say how each run ended, and a second
writer fails permanently (78) without touching the first one's checkpoints or history.

Seeded and bounded by time like tests/test_model_based.py (``ASV_SEED``, ``ASV_FUZZ=1``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

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

from asupervisor._logdir import ledger
from asupervisor._logdir.history import History, index_names, read_history
from asupervisor._logdir.store import Store
from asupervisor._logdir.verify import verify_checkpoint
from tests import forked
from tests.faults.harness import ROOT, TRAINER, Trainer, checkpoint_problems
from tests.search import FUZZ, search_budget, search_settings, seeded, traced

pytestmark = pytest.mark.slow

BUDGET = search_budget(suite=6, fuzz=1800)
END_SECS = 120  # a trainer that takes longer than this to end is stuck: a finding


def history(logdir: str) -> History:
    return read_history(Store(logdir))


def step_of(prefix: str) -> int:
    reader = tf.train.load_checkpoint(prefix)
    return int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))


def newest_complete(logdir: str) -> int | None:
    """What a restart must restore: a checkpoint a kill left uncommitted (its files on
    disk, newer than the head, read back whole: it is kept, not lost), else the head,
    else the newest commit on the head's line that reads back whole."""
    store = Store(logdir)
    line = history(logdir).line()
    known = {c.name for c in history(logdir).commits}
    head = line[0] if line else None
    uncommitted = [
        n
        for n in index_names(store) - known
        if n.startswith("model.ckpt-") and verify_checkpoint(store.path(n)) is None
    ]
    newer = [step_of(store.path(n)) for n in uncommitted]
    newer = [s for s in newer if head is None or head.step is None or s > head.step]
    if newer:
        return max(newer)
    for commit in line:
        if verify_checkpoint(store.path(commit.name)) is None:
            return commit.step
    return None


def end_line(logdir: str, pid: int) -> ledger.SessionRecord | None:
    """The ledger's record of the session process ``pid`` ran (its start and end lines)."""
    found = [s for s in ledger.sessions(ledger.read(Store(logdir))) if s.pid == pid]
    return found[-1] if found else None


@traced
class Processes(RuleBasedStateMachine):
    budget = BUDGET

    def __init__(self) -> None:
        BUDGET.admit()
        super().__init__()
        self.logdir = tempfile.mkdtemp(prefix="asv-procs-")
        self.run: Trainer | None = None
        self.step = 0  # the last step a run reported (its state, at least, was trained)
        self.max_rollbacks = 0  # the running trainer's policy (0: none)
        self.rollbacks = 0  # divergences rolled back in this logdir's history
        self.clean_end = True  # the last run ended by itself (not killed)

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: self.run is None)
    @rule(
        save_steps=st.sampled_from([1, 3, 7]),
        background=st.booleans(),
        max_rollbacks=st.sampled_from([0, 1, 2]),
    )
    def start(self, save_steps: int, background: bool, max_rollbacks: int) -> None:
        expected = newest_complete(self.logdir)
        args = ["--save-steps", str(save_steps), "--megabytes", "0.5", "--commands"]
        args += ["--rollback", str(max_rollbacks), *(["--async"] if background else [])]
        self.run = Trainer(self.logdir, *args)
        self.max_rollbacks = max_rollbacks
        restored = self.run.wait_restored()
        assert restored == (expected or 0), (restored, expected)  # the newest whole one
        if expected is not None:  # restored, and (adopted if it was not) on the head's line
            assert restored in [c.step for c in history(self.logdir).line()]
        self.step = restored

    @precondition(lambda self: self.run is not None)
    @rule(steps=st.integers(1, 12))
    def train_a_while(self, steps: int) -> None:
        run = self.run
        assert run is not None
        target = max(self.step, run.last_step) + steps
        run.wait_for(lambda: run.last_step >= target)
        self.step = run.last_step

    @precondition(lambda self: self.run is not None)
    @rule()
    def sigkill(self) -> None:
        run = self.run
        assert run is not None
        run.kill()
        self.run, self.clean_end = None, False
        newest = newest_complete(self.logdir)
        # Lost at most what the saves had not reached: never a step not yet trained (a
        # step's save comes before its line; a restarted run may not have printed one).
        assert run.restored is not None
        assert newest is None or newest <= max(run.last_step, run.restored) + 1
        record = end_line(self.logdir, run.proc.pid)
        assert record is None or record.ended is None  # killed: no end line

    @precondition(lambda self: self.run is not None)
    @rule(how=st.sampled_from(["sigterm", "told"]))
    def stop(self, how: str) -> None:
        """A clean stop: preempted by SIGTERM (42), or a user's stop (0); either way the
        final checkpoint is the history's head, and the ledger's end line says so."""
        run = self.run
        assert run is not None
        if how == "sigterm":
            run.proc.send_signal(signal.SIGTERM)
        else:
            run.send("stop")
        code = run.proc.wait(END_SECS)
        run.wait_for(lambda: run.stopped is not None, timeout=10)
        self.run, self.clean_end = None, True
        assert run.stopped is not None, run.stderr_text()[-2000:]
        step, reason = run.stopped
        status, outcome = (42, "preempted") if how == "sigterm" else (0, "done")
        assert reason == ("signal" if how == "sigterm" else "told"), run.stopped
        assert code == status, (code, run.stderr_text()[-2000:])
        self.check_clean_end(run, step, status, outcome)

    @precondition(lambda self: self.run is not None and self.max_rollbacks > 0)
    @rule()
    def diverge(self) -> None:
        """The next step's loss is NaN: the run rolls back to the newest healthy commit
        on the head's line and goes on, from a new branch; once the logdir's history has
        ``max_rollbacks`` of them, it fails permanently (78), the history untouched."""
        run = self.run
        assert run is not None
        before = history(self.logdir)
        run.send("nan")
        run.wait_for(lambda: run.after_nan is not None or run.proc.poll() is not None)
        at = run.diverged
        if self.rollbacks >= self.max_rollbacks:
            code = run.proc.wait(END_SECS)
            self.run, self.clean_end = None, True
            assert code == 78, (code, run.stderr_text()[-2000:])
            assert "DivergedError" in run.stderr_text(), run.stderr_text()[-2000:]
            after = history(self.logdir)
            assert len(after.divergences()) == self.rollbacks
            record = end_line(self.logdir, run.proc.pid)
            assert record is not None and record.exit_status == 78, record
            assert record.outcome == "failed_permanently", record
            return
        assert at is not None and run.after_nan is not None
        self.rollbacks += 1
        after = history(self.logdir)
        assert len(after.divergences()) == self.rollbacks
        back = after.divergences()[-1]
        target = after.commit(back.to)
        assert back.at_step == at and target is not None and target.step is not None
        assert target.healthy is not False and target.step <= at
        # Every commit was healthy and at or before the step that diverged (lookback 0):
        # the newest one, the head, is where it went back to, and nothing was abandoned.
        assert back.to == back.left, back
        assert not [c for c in after.commits if c.abandoned_by == back.number]
        assert target.seq >= max((c.seq for c in before.line()), default=0)
        assert run.after_nan == target.step  # where the run went on from
        self.step = target.step

    @precondition(lambda self: self.run is not None)
    @rule(how=st.sampled_from(["trainer", "trainer", "trainer", "asupervisor run"]))
    def second_writer(self, how: str) -> None:
        """A second writer on the logdir of a running one fails at once and for good
        (LogdirLockedError, 78; `asupervisor run` passes it on instead of restarting
        forever), and the first one's checkpoints and history are left as they were."""
        first = self.run
        assert first is not None
        before = history(self.logdir).next_seq
        if how == "trainer":
            second = Trainer(self.logdir, "--save-steps", "1")
            code = second.proc.wait(END_SECS)
            errors = second.stderr_text()
            pid = second.proc.pid
        else:
            done = subprocess.run(
                [
                    sys.executable, "-m", "asupervisor", "run", "--logdir", self.logdir,
                    "--backoff", "0", "--", sys.executable, str(TRAINER), self.logdir,
                ],
                capture_output=True, text=True, timeout=END_SECS,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            code, errors = done.returncode, done.stderr
            (started,) = [line for line in errors.splitlines() if "child.started" in line]
            pid = int(started.split("pid=")[1].split()[0])  # one start: no restart
        assert code == 78, (code, errors[-3000:])
        assert "LogdirLockedError" in errors, errors[-3000:]
        assert first.proc.poll() is None, first.stderr_text()[-2000:]  # the first goes on
        saved = first.last_saved
        first.wait_for(lambda: first.last_saved > saved)  # and still commits
        assert end_line(self.logdir, pid) is None  # it wrote no ledger line
        since = [c for c in history(self.logdir).commits if c.seq >= before]
        assert len({c.session for c in since}) == 1, since  # only the first one committed
        self.step = max(self.step, first.last_step)

    # -- what must hold ------------------------------------------------------------------

    @invariant()
    def within_the_budget(self) -> None:
        BUDGET.check()

    def check_clean_end(self, run: Trainer, step: int, status: int, outcome: str) -> None:
        after = history(self.logdir)
        head = after.head_commit()
        assert head is not None and head.step == step, (head, step)  # the final checkpoint
        assert newest_complete(self.logdir) == step
        record = end_line(self.logdir, run.proc.pid)
        assert record is not None and record.ended is not None, record
        assert (record.exit_status, record.outcome, record.step) == (status, outcome, step)
        assert record.unsaved_steps == 0, record
        self.step = step

    @invariant()
    def every_checkpoint_reads_back_whole_at_one_step_boundary(self) -> None:
        if self.run is not None:
            return  # a save may be in flight: checked when no process runs
        _, problems = checkpoint_problems(self.logdir)
        assert problems == [], problems

    @invariant()
    def the_history_counts_the_rollbacks_and_its_head_is_on_disk(self) -> None:
        if self.run is not None:
            return
        now = history(self.logdir)
        assert len(now.divergences()) == self.rollbacks
        head = now.head_commit()
        if head is not None and self.clean_end:
            assert head.on_disk and verify_checkpoint(Store(self.logdir).path(head.name)) is None
            state = tf.train.get_checkpoint_state(self.logdir)  # TF's reader agrees
            assert state is not None and Path(state.model_checkpoint_path).name == head.name

    def teardown(self) -> None:
        BUDGET.ended()
        if self.run is not None:
            self.run.kill()
        shutil.rmtree(self.logdir, ignore_errors=True)


def test_real_processes_keep_their_promises_under_random_sequences() -> None:
    forked.start_server()
    with BUDGET.reporting():
        run_state_machine_as_test(
            seeded(Processes),
            settings=search_settings(examples=400 if FUZZ else 40, steps=20 if FUZZ else 8),
        )
