"""A process ends with the exit status of how its training ended (``asv.run``).

Orchestrators read only the exit status: 0 must mean *done*, never *preempted* (a
Kubernetes Job whose pod exits 0 is complete and never restarted). The statuses are
``Outcome.exit_status``; ``run`` turns the last session's outcome, or the error that
escaped the program, into one.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from ._outcome import Outcome, is_permanent

_lock = threading.Lock()
_last: tuple[Outcome, BaseException | None] | None = None  # this process's last session


def ended(outcome: Outcome, error: BaseException | None) -> None:
    """A session of this process ended so (the runtime tells, once per session)."""
    global _last
    with _lock:
        _last = (outcome, error)


def status_of(error: BaseException | None) -> int:
    """The exit status for a program that ended with ``error`` (``None``: it returned)."""
    with _lock:
        last = _last
    if error is None:
        return 0 if last is None else last[0].exit_status
    if isinstance(error, SystemExit):
        code = error.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    if last is not None and (last[1] is error or isinstance(error, KeyboardInterrupt)):
        return last[0].exit_status  # the session's own ending
    if isinstance(error, KeyboardInterrupt):
        return Outcome.INTERRUPTED.exit_status
    return (Outcome.FAILED_PERMANENTLY if is_permanent(error) else Outcome.FAILED).exit_status


def run(main: Callable[..., Awaitable[Any]], *args: Any, backend: str = "asyncio") -> int:
    """Run ``main(*args)`` on an event loop (``anyio.run``) and return the exit status for
    how it ended: the outcome of the last session it ran (``asv.Outcome``), or the status
    of the error that escaped it (printed, as Python would). ``sys.exit(asv.run(main))``.
    """
    import anyio

    try:
        anyio.run(main, *args, backend=backend)
    except BaseException as exc:  # the status says what happened; the traceback, how
        if not isinstance(exc, SystemExit):
            traceback.print_exception(exc)
        return status_of(exc)
    return status_of(None)


def exit_status(outcome: Outcome | None) -> int:
    """``outcome.exit_status``; 0 for ``None`` (no session ended)."""
    return 0 if outcome is None else outcome.exit_status
