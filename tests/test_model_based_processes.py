"""The same search across real processes: a trainer started, run a while, then SIGKILLed or
sent SIGTERM at random moments, again and again on one logdir; after each, what is on
disk is checked against what must hold (tests/faults/trainer.py is the trainer).

``ASV_FUZZ=1`` (``make fuzz``) runs a long search; the suite runs a short one.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest
import tensorflow as tf
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.faults.harness import Trainer, checkpoint_problems

FUZZ = os.environ.get("ASV_FUZZ") == "1"

pytestmark = pytest.mark.slow


def newest_complete(logdir: str) -> int | None:
    """The first checkpoint a restart tries whose files read back whole (it restores it)."""
    from asupervisor._logdir.catalog import Catalog
    from asupervisor._logdir.files import checkpoint_problem
    from asupervisor._logdir.store import Store

    store = Store(logdir)
    catalog = Catalog(store, "model.ckpt", writer=False)
    catalog.load()
    for path in map(store.path, catalog.candidates(committed_only=False)):
        if checkpoint_problem(store, path) is None:
            reader = tf.train.load_checkpoint(path)
            return int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))
    return None


class Processes(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.logdir = tempfile.mkdtemp(prefix="asv-procs-")
        self.run: Trainer | None = None
        self.step = 0  # the last step a run reported (its state, at least, was trained)

    @precondition(lambda self: self.run is None)
    @rule(save_steps=st.sampled_from([1, 3, 7]), background=st.booleans())
    def start(self, save_steps: int, background: bool) -> None:
        expected = newest_complete(self.logdir)
        args = ["--save-steps", str(save_steps), "--megabytes", "0.5"]
        self.run = Trainer(self.logdir, *args, *(["--async"] if background else []))
        restored = self.run.wait_restored()
        assert restored == (expected or 0), (restored, expected)  # the newest whole one
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
        self.run = None
        newest = newest_complete(self.logdir)
        # Lost at most what the saves had not reached: never a step not yet trained.
        assert newest is None or newest <= max(run.last_step, 0) + 1

    @precondition(lambda self: self.run is not None)
    @rule()
    def sigterm(self) -> None:
        run = self.run
        assert run is not None
        run.proc.send_signal(signal.SIGTERM)
        code = run.proc.wait(120)
        run.wait_for(lambda: run.stopped is not None, timeout=10)
        self.run = None
        assert run.stopped is not None and run.stopped[1] == "signal", run.stderr_text()[-2000:]
        assert code == 42, (code, run.stderr_text()[-2000:])  # preempted: saved, not done
        assert newest_complete(self.logdir) == run.stopped[0]  # the final checkpoint

    @invariant()
    def every_checkpoint_reads_back_whole_at_one_step_boundary(self) -> None:
        if self.run is not None:
            return  # a save may be in flight: checked when no process runs
        _, problems = checkpoint_problems(self.logdir)
        assert problems == [], problems

    def teardown(self) -> None:
        if self.run is not None:
            self.run.kill()
        shutil.rmtree(self.logdir, ignore_errors=True)


Processes.TestCase.settings = settings(
    max_examples=30 if FUZZ else 2,
    stateful_step_count=20 if FUZZ else 6,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=not FUZZ,
)
TestProcesses = Processes.TestCase
