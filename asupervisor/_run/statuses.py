"""Exit statuses as ``asupervisor run`` reads them: a shell's number (128+N for a death by
signal N), what it means (``Outcome``, from ``_outcome``'s table), and how to show it."""

from __future__ import annotations

import signal
from collections.abc import Iterable

from .._outcome import Outcome, worst

_BY_STATUS = {outcome.exit_status: outcome for outcome in Outcome}  # _outcome's table
CANNOT_RUN = (126, 127)  # the shell's "not executable" and "not found"
# Worth another attempt. A store out of reach too: an outage passes, and credentials that
# are missing end the run by the crash-loop budget (no attempt commits anything). A worker
# that lost its peer: the group is started again, and the loss counts as its failure.
RESTARTED = frozenset({Outcome.FAILED, Outcome.STUCK, Outcome.UNREACHABLE, Outcome.LOST_PEER})


def outcome_of(status: int) -> Outcome:
    """What a child's exit status (the shell's: 128+N for a signal) says."""
    if status in CANNOT_RUN:
        return Outcome.FAILED_PERMANENTLY  # a command that is not there will not appear
    return _BY_STATUS.get(status, Outcome.FAILED)


def shell_status(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell shows it: a death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_status(status: int) -> str:
    if status > 128 and status - 128 in {s.value for s in signal.Signals}:
        return f"{status} ({signal.Signals(status - 128).name})"
    return f"{status} ({outcome_of(status).value})"


def worst_outcome(statuses: Iterable[int]) -> Outcome:
    """The outcome of a job whose processes ended with ``statuses`` (``_outcome.worst``)."""
    return worst(outcome_of(status) for status in statuses)
