"""The model-based searches' seed and time budget (tests/test_model_based*.py).

A search is random, seeded, and bounded by time: new sequences are tried until its budget
is spent. The seed is ``ASV_SEED`` (tests/conftest.py draws one when it is not set, and
prints it in the report's header and at the end), so ``ASV_SEED=<n>`` runs the same
sequences again; ``ASV_FUZZ=1`` (``make fuzz``) gives each search a long budget
(``ASV_FUZZ_SECS=<s>`` sets it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, seed, settings
from hypothesis.errors import Flaky, HypothesisException
from hypothesis.stateful import RULE_MARKER

SEED_VARIABLE = "ASV_SEED"
FUZZ = os.environ.get("ASV_FUZZ") == "1"
FUZZ_SECS = float(os.environ.get("ASV_FUZZ_SECS") or 0)


def search_seed() -> int:
    """This run's seed (tests/conftest.py sets the variable before any test runs)."""
    return int(os.environ.get(SEED_VARIABLE) or 0)


def replay_line() -> str:
    return (
        f"model-based search: {SEED_VARIABLE}={search_seed()} "
        f"(run with {SEED_VARIABLE}={search_seed()} to try the same sequences again; "
        "ASV_FUZZ=1 for a long search)"
    )


class BudgetSpent(KeyboardInterrupt):
    """The search's time is up, at the start of a sequence. Hypothesis ends a search
    where it is on a KeyboardInterrupt, without recording the sequence it was on;
    ``Budget.reporting`` takes it. Any other way of turning a sequence away
    (``reject()``, another exception) leaves Hypothesis' record of what it drew
    inconsistent: FlakyStrategyDefinition."""


CUT_SECS = 1.5  # a sequence still running this long past its search's budget is cut short


class Budget:
    """A search's time. Until it is spent, every new sequence runs; then the search
    ends at the start of the next one, or at the next step of a sequence still running
    ``CUT_SECS`` past it (a loaded machine does not stretch the search). Once a sequence
    has failed, the budget no longer applies: the search shrinks the failure to its
    minimal sequence however long that takes, and replays it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: float | None = None
        self.failed = False
        self.admitted = 0
        self.first_failure: str | None = None  # its steps and its error, as they came
        self.steps: list[str] = []  # the running sequence's steps (``traced``)

    def admit(self) -> None:
        """At the start of a sequence (the machine's ``__init__``)."""
        now = time.monotonic()
        if self.started is None:
            self.started = now
        if not self.failed and now - self.started > self.seconds:
            raise BudgetSpent
        self.admitted += 1
        self.steps = []

    def check(self) -> None:
        """After each step of a sequence (an invariant of the machine)."""
        if self.started is None or self.failed:
            return
        if time.monotonic() - self.started > self.seconds + CUT_SECS:
            raise BudgetSpent

    def ended(self) -> None:
        """At the end of a sequence (the machine's ``teardown``, which runs in the
        runner's ``finally``): a real failure on its way out turns the budget off."""
        exc = sys.exc_info()[1]
        if isinstance(exc, Exception) and not isinstance(exc, HypothesisException):
            self.failed = True
            if self.first_failure is None:
                steps = "".join(f"{step}\n" for step in self.steps)
                self.first_failure = steps + "".join(traceback.format_exception(exc))

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Around the search: it ends when its time is spent; a failure that did not
        come again the same way (timing) ends Hypothesis' search as flaky, without the
        sequence: it is added here."""
        try:
            yield
        except BudgetSpent:
            took = 0.0 if self.started is None else time.monotonic() - self.started
            print(
                f"the search ran {self.admitted} sequences in its {self.seconds:g} s "
                f"({took:.1f} s from its first)"
            )
        except Flaky as exc:
            if self.first_failure is not None:
                exc.add_note("The first failing sequence, as it ran:\n" + self.first_failure)
            raise
        else:  # every example ran within the budget
            print(f"the search ran all its {self.admitted} sequences")


def traced(machine: Any) -> Any:
    """Each rule the machine runs is written down first (Hypothesis shows the steps of
    its final replay only, which a failure that depends on timing may not reach): the
    machine's ``budget`` keeps the steps of the running sequence."""
    for name in dir(machine):
        rule = getattr(getattr(machine, name), RULE_MARKER, None)
        if rule is not None:
            rule.function = _tracing(rule.function)
    return machine


def _tracing(fn: Any) -> Any:
    @functools.wraps(fn)
    def run(self: Any, **arguments: Any) -> Any:
        shown = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
        self.budget.steps.append(f"state.{fn.__name__}({shown})")
        return fn(self, **arguments)

    return run


def search_budget(*, suite: float, fuzz: float) -> Budget:
    """A search's time: ``suite`` seconds in the suite, ``fuzz`` (or ``ASV_FUZZ_SECS``)
    in a long search."""
    return Budget((FUZZ_SECS or fuzz) if FUZZ else suite)


def search_settings(*, examples: int, steps: int) -> settings:
    """Random (not derandomized), no example database: a seed alone replays a search."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def seeded(machine: Any) -> Any:
    return seed(search_seed())(machine)
