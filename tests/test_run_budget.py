"""The restart budget of `asupervisor run`, alone: no process, no clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from asupervisor._outcome import Outcome, worst
from asupervisor._run.budget import GiveUp, Restart, RestartBudget
from asupervisor._run.statuses import outcome_of


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
