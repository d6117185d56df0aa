"""The restart budget of ``asupervisor run``: after each attempt, restart (and when) or
give up (with which status). Pure: no process, no clock; its one piece of state is the
count of failures in a row without progress.

What counts as progress is decided here once: the attempt committed a checkpoint (its
own session's save, as the history on disk records it with this run and attempt, or as
its channel told first; never a restore, and never what another process wrote into the
logdir: ``AttemptResult.progressed``). A failure after progress costs nothing and
restarts at once; ``max_failures`` failures in a row without it are a crash loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .._outcome import Outcome
from .statuses import RESTARTED


class Ended(Protocol):
    """What the budget reads of an attempt's end (``AttemptResult``)."""

    @property
    def interrupted(self) -> bool: ...
    @property
    def stop_requested(self) -> bool: ...
    @property
    def outcome(self) -> Outcome: ...
    @property
    def status(self) -> int: ...
    @property
    def progressed(self) -> bool: ...


@dataclass(frozen=True)
class Restart:
    delay: float  # seconds to wait first (0: at once)
    failures: int  # failures in a row without progress, this one included
    progressed: bool  # the attempt committed a checkpoint: it cost nothing


@dataclass(frozen=True)
class GiveUp:
    status: int  # the run's exit status
    crash_loop: bool = False  # the budget is spent (a report says why)


def restartable(attempt: Ended) -> bool:
    """The attempt ended in a way a restart may change, and no stop came: what happens
    next turns on its progress."""
    return not attempt.stop_requested and attempt.outcome in RESTARTED


class RestartBudget:
    def __init__(self, max_failures: int, backoff_secs: float, max_backoff_secs: float) -> None:
        if max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, not {max_failures}")
        self.max_failures = max_failures
        self.backoff_secs = backoff_secs
        self.max_backoff_secs = max(max_backoff_secs, backoff_secs)
        self.failures = 0  # in a row, without progress

    def after(self, attempt: Ended) -> Restart | GiveUp:
        """The decision after ``attempt``; the one place the count changes."""
        if attempt.interrupted:
            return GiveUp(Outcome.INTERRUPTED.exit_status)
        if not restartable(attempt):
            return GiveUp(attempt.status)  # a stop, or an ending no restart changes
        if attempt.progressed:
            self.failures = 0
            return Restart(0.0, 0, progressed=True)
        self.failures += 1
        if self.failures >= self.max_failures:
            return GiveUp(attempt.status, crash_loop=True)
        delay = min(self.backoff_secs * 2 ** (self.failures - 1), self.max_backoff_secs)
        return Restart(delay, self.failures, progressed=False)
