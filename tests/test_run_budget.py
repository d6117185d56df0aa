"""The restart budget of `asupervisor run`: alone (no process, no clock), then across real
processes, where a seeded search (tests/search.py) kills tiny children at random times
after their commits and checks each judgement of the runner against a model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asupervisor._outcome import Outcome, worst
from asupervisor._run.budget import GiveUp, Restart, RestartBudget
from asupervisor._run.statuses import outcome_of
from tests.search import FUZZ, search_budget, search_settings, seeded, traced

ROOT = Path(__file__).parents[1]


@dataclass(frozen=True)
class Ended:
    status: int = 1
    progressed: bool = False
    stop_requested: bool = False
    interrupted: bool = False

    @property
    def outcome(self) -> Outcome:
        return outcome_of(self.status)


def test_failures_without_progress_back_off_doubling_and_give_up_as_a_crash_loop() -> None:
    budget = RestartBudget(max_failures=4, backoff_secs=1.0, max_backoff_secs=3.0)
    decisions = [budget.after(Ended(status)) for status in (1, 137, 124, 1)]
    assert decisions == [
        Restart(1.0, 1, progressed=False),
        Restart(2.0, 2, progressed=False),
        Restart(3.0, 3, progressed=False),  # doubling, up to the longest wait
        GiveUp(1, crash_loop=True),  # the last failure's own status
    ]


def test_an_attempt_that_committed_costs_nothing_and_refills_the_budget() -> None:
    budget = RestartBudget(max_failures=2, backoff_secs=5.0, max_backoff_secs=60.0)
    assert budget.after(Ended(1)) == Restart(5.0, 1, progressed=False)
    assert budget.after(Ended(137, progressed=True)) == Restart(0.0, 0, progressed=True)
    assert budget.failures == 0
    assert budget.after(Ended(1)) == Restart(5.0, 1, progressed=False)  # counted anew
    assert budget.after(Ended(124)) == GiveUp(124, crash_loop=True)


@pytest.mark.parametrize("status", [0, 42, 78, 126, 127, 130])
def test_endings_no_restart_changes_are_passed_on(status: int) -> None:
    budget = RestartBudget(max_failures=3, backoff_secs=1.0, max_backoff_secs=1.0)
    assert budget.after(Ended(status, progressed=True)) == GiveUp(status)
    assert budget.failures == 0


def test_a_stop_is_never_followed_by_a_restart_and_a_hard_stop_is_130() -> None:
    budget = RestartBudget(max_failures=3, backoff_secs=1.0, max_backoff_secs=1.0)
    assert budget.after(Ended(1, stop_requested=True)) == GiveUp(1)
    assert budget.after(Ended(137, stop_requested=True, interrupted=True)) == GiveUp(130)
    assert budget.failures == 0  # neither is a failure of the run's own


def test_one_failure_allowed_gives_up_at_the_first() -> None:
    assert RestartBudget(1, 1.0, 1.0).after(Ended(1)) == GiveUp(1, crash_loop=True)
    with pytest.raises(ValueError, match="max_failures"):
        RestartBudget(0, 1.0, 1.0)


def test_the_worst_of_several_endings() -> None:
    assert worst([Outcome.DONE, Outcome.FAILED, Outcome.STUCK]) is Outcome.STUCK
    assert worst([Outcome.PREEMPTED, Outcome.DONE]) is Outcome.PREEMPTED
    assert worst([Outcome.FAILED, Outcome.FAILED_PERMANENTLY]) is Outcome.FAILED_PERMANENTLY
    assert worst([Outcome.INTERRUPTED, Outcome.FAILED]) is Outcome.FAILED


# -- the budget across real processes: kills at random times after commits --------------

# A chief as the runner sees it: it says where it commits, then does what the search
# orders for its attempt: commits (the library's own catalog writes the history, with
# this run and attempt), tells them on its channel after a while or never (a session
# tells its commits with its next beat), and fails, or waits for the search's SIGKILL.
KILLED_AFTER_COMMITS = """
import json, os, sys, time
from asupervisor._logdir.catalog import Catalog
from asupervisor._logdir.history import Provenance
from asupervisor._logdir.records import Record
from asupervisor._logdir.store import Store

control, logdir = sys.argv[1], sys.argv[2]
attempt, channel = int(os.environ["ASUPERVISOR_ATTEMPT"]), int(os.environ["ASUPERVISOR_CHANNEL"])
session = f"s{attempt}"

def tell(**report):
    os.write(channel, (json.dumps(report) + "\\n").encode())

def mark(name, text=""):
    with open(os.path.join(control, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(control, name + ".tmp"), os.path.join(control, name))

tell(kind="session", session=session, pid=os.getpid(), chief=True, stop_grace_secs=1.0,
     logdir=logdir)
mark(f"up-{attempt}", str(os.getpid()))
order = os.path.join(control, f"order-{attempt}")
while not os.path.exists(order):
    time.sleep(0.002)
with open(order) as f:
    order = json.load(f)
catalog = Catalog(Store(logdir), "model.ckpt", writer=True,
                  provenance=Provenance.of_session(session))
catalog.load()
steps = [order["first_step"] + i for i in range(order["commits"])]
for step in steps:
    catalog.commit(f"model.ckpt-{step}", Record(step, time.time()))
mark(f"committed-{attempt}")
if order["tell_after"] is not None:
    time.sleep(order["tell_after"])
    for step in steps:
        tell(kind="commit", session=session, step=step, at=time.time())
if order["end"] == "fails":
    sys.exit(1)
time.sleep(600)
"""

MAX_FAILURES = 3
BUDGET = search_budget(suite=5, fuzz=600)


class Runner:
    """`asupervisor run` over the child above; its stderr read line by line."""

    def __init__(self, tmp: Path, standby: bool) -> None:
        self.control, self.logdir = tmp / "control", tmp / "run"
        self.control.mkdir()
        self.logdir.mkdir()
        script = tmp / "child.py"
        script.write_text(KILLED_AFTER_COMMITS)
        warm = ["--standby", "--preload", "asupervisor._logdir.catalog"] if standby else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asupervisor", "run", *warm, "--max-failures",
             str(MAX_FAILURES), "--backoff", "0.01", "--max-backoff", "0.01", "--",
             sys.executable, str(script), str(self.control), str(self.logdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip())
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # the end
            self._changed.notify_all()

    def line(self, prefix: str, timeout: float = 60) -> str:
        """The first line that starts with ``prefix`` (or the run's end)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [x for x in self.lines if x.startswith(prefix) or "run.ended" in x]
                if found:
                    return found[0]
                assert time.monotonic() < deadline, "\n".join(self.lines)
                self._changed.wait(0.5)

    def wait_for(self, name: str, timeout: float = 60) -> str:
        path = self.control / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.002)
        return path.read_text()

    def order(self, attempt: int, **order: object) -> None:
        temp = self.control / f"order-{attempt}.tmp"
        temp.write_text(json.dumps(order))
        temp.rename(self.control / f"order-{attempt}")

    def end(self) -> None:
        self.proc.kill()  # its children and its standby die with it (PR_SET_PDEATHSIG)
        self.proc.wait(60)
        self._reader.join(30)


@traced
class KilledAfterCommits(RuleBasedStateMachine):
    """Attempts that commit (or not), tell it on the channel late or never, and end
    (fail, or a SIGKILL at a random time after the commits): the runner's judgement of
    each must be the model's: progress when the history records a commit of it."""

    budget = BUDGET

    def __init__(self) -> None:
        BUDGET.admit()
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="asv-budget-"))
        self.runs = 0
        self.run: Runner | None = None
        self.attempt = 0
        self.failures = 0  # in a row without progress: the model's budget
        self.step = 0

    @precondition(lambda self: self.run is None)
    @rule(standby=st.sampled_from([True, False]))  # the first of each is tried first
    def start(self, standby: bool) -> None:
        self.runs += 1
        place = self.tmp / str(self.runs)
        place.mkdir()
        self.run, self.attempt, self.failures = Runner(place, standby), 1, 0

    @precondition(lambda self: self.run is not None)
    @rule(
        commits=st.sampled_from([1, 2, 0]),
        tell_after=st.sampled_from([None, None, 0.0, 0.01, 0.05]),
        end=st.sampled_from(["killed", "killed", "fails"]),
        kill_after=st.sampled_from([0.0, 0.002, 0.01, 0.03]),
    )
    def an_attempt(
        self, commits: int, tell_after: float | None, end: str, kill_after: float
    ) -> None:
        run, attempt = self.run, self.attempt
        assert run is not None
        pid = int(run.wait_for(f"up-{attempt}"))
        order = {"commits": commits, "first_step": self.step + 1, "tell_after": tell_after}
        run.order(attempt, **order, end=end)
        run.wait_for(f"committed-{attempt}")
        self.step += commits
        if end == "killed":
            time.sleep(kill_after)
            os.kill(pid, signal.SIGKILL)
        # The model's judgement: progress when it committed, whatever the channel said.
        if commits:
            self.failures = 0
        else:
            self.failures += 1
        said = run.line(f"asupervisor run: run.restarting attempt={attempt + 1} ")
        if self.failures == MAX_FAILURES:
            run.proc.wait(60)
            assert "crash loop" in "\n".join(run.lines), "\n".join(run.lines)
            run.end()
            self.run = None
            return
        progress = "'yes (costs nothing)'" if commits else "no"
        expected = f"progress={progress} failures_without_progress={self.failures}/3 "
        assert expected in said, "\n".join(run.lines)
        if commits:
            assert f"committed={self.step} " in said and "in_secs=0.0" in said, said
        self.attempt += 1

    @invariant()
    def within_the_budget(self) -> None:
        BUDGET.check()

    def teardown(self) -> None:
        BUDGET.ended()
        if self.run is not None:
            self.run.end()
        shutil.rmtree(self.tmp, ignore_errors=True)


def test_no_attempt_killed_at_a_random_time_after_its_commits_is_misjudged() -> None:
    with BUDGET.reporting():
        run_state_machine_as_test(
            seeded(KilledAfterCommits),
            settings=search_settings(examples=200 if FUZZ else 20, steps=12 if FUZZ else 6),
        )
