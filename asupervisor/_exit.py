"""A process ends with the exit status of how its training ended (``asv.run``).

Orchestrators read only the exit status: 0 must mean *done*, never *preempted* (a
Kubernetes Job whose pod exits 0 is complete and never restarted). ``status_of`` is the
one decision of a process's status, from what ended its program: the last session's
``Ending`` (the error the session raised is recognised as its own by identity), an
error of the program's own, or a stop signal that came while no session listened. The
statuses themselves are the table in ``_outcome``.

``run`` also bounds the process: the program is cancelled by a stop signal that comes
outside a session (a preemption), and once ``main`` has ended the process ends within
``EXIT_SECS``, whatever a task that will not end (a service that swallowed its
cancellation) or a thread left behind would hold.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from ._errors import CheckpointMismatchError
from ._outcome import Ending, Outcome, exit_status_of, is_cancellation, outcome_of

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

EXIT_SECS = 2.0  # from the end of main to the end of the process, at most

_lock = threading.Lock()
_last: Ending | None = None  # how this process's last session ended
_signal: str | None = None  # a stop signal the running asv.run program had outside a session


def ended(ending: Ending) -> None:
    """A session of this process ended so (its stop path tells, once per session)."""
    global _last
    with _lock:
        _last = ending


def outside_signal() -> str | None:
    """The stop signal that reached the program ``asv.run`` runs while no session
    listened (it cancels the program: a preemption), if one did."""
    return _signal


def status_of(
    error: BaseException | None,
    ending: Ending | None = None,
    signalled: str | None = None,
    interrupted: bool = False,
) -> int:
    """The exit status of a program that ended with ``error`` (``None``: it returned),
    after ``ending`` (its last session's, if any), ``signalled`` (a stop signal that
    came while no session listened, if one did) and ``interrupted`` (a second SIGINT
    came while it ran).

    A second SIGINT is the user's "now": 130, whatever the phase it came in (while a
    session ran or stopped, after its ending was decided, outside any session) and
    whatever else happened.

    The session's own error (``ending.raised``, also inside the exception group of a task
    group around the session, or the cancellation that ended it, which asyncio re-makes
    on its way out) has the ending's status; another error its own
    outcome's; a program that returned has its last session's, and a stop signal makes
    one that would have been done a preemption (a failure stays a failure)."""
    if interrupted:
        return Outcome.INTERRUPTED.exit_status
    if error is not None:
        raised = None if ending is None else ending.raised
        if ending is not None and raised is not None:
            if _holds(error, raised) or (is_cancellation(error) and is_cancellation(raised)):
                return ending.exit_status
        return exit_status_of(outcome_of(error), error)
    if ending is None or ending.outcome is Outcome.DONE:
        return (Outcome.PREEMPTED if signalled is not None else Outcome.DONE).exit_status
    return ending.exit_status


def _holds(error: BaseException, raised: BaseException) -> bool:
    """Whether ``error`` is ``raised``, or an exception group with it inside."""
    if error is raised:
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(_holds(inner, raised) for inner in error.exceptions)
    return False


def _program_status(error: BaseException | None, interrupted: bool) -> int:
    with _lock:
        ending = _last
    return status_of(error, ending, _signal, interrupted)


def run(main: Callable[..., Awaitable[Any]], *args: Any, backend: str = "asyncio") -> int:
    """Run ``main(*args)`` on an event loop (``anyio.run``) and return the exit status for
    how it ended: the outcome of the last session it ran (``asv.Outcome``), or the status
    of the error that escaped it (printed, as Python would). ``sys.exit(asv.run(main))``.

    For the program's whole run, SIGTERM and SIGINT that come while no session listens
    (before the first session, between two, after the last) cancel ``main`` at its next
    ``await``: the program was preempted (42); a second SIGINT, whenever it comes (in a
    session, as one stops, after it, outside any), ends the program interrupted (130), by
    ``KeyboardInterrupt`` as Python would outside a session. Once ``main`` has ended, the process
    ends within ``EXIT_SECS``: if the event loop, or a thread it left that would hold the
    interpreter's exit, has not ended by then, ``process.exit_forced`` is logged and the
    process exits at once (``os._exit``) with the same status.
    """
    import anyio

    global _last, _signal
    with _lock:
        _last = None
    _signal = None
    program = _Program(main, args)
    program.listen()
    error: BaseException | None = None
    try:
        try:
            anyio.run(program.run, backend=backend)
        except BaseException as exc:  # the status says what happened; the traceback, how
            error = exc
            if not isinstance(exc, SystemExit):
                _print_error(exc)
        program.join_threads(error)
    except KeyboardInterrupt as exc:  # a second SIGINT while the process ends
        error = exc
    finally:
        interrupted = program.over()
    status = _program_status(error, interrupted)
    _signal = None  # the program is over: no later session is preempted by its signal
    return status


class _Program:
    """One ``asv.run``: ``main`` in a cancel scope that a stop signal outside any session
    cancels, and the bound on the process's end once ``main`` has ended."""

    def __init__(self, main: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        from ._session.signals import SignalListener

        self._main, self._args = main, args
        self._call: Callable[[Callable[[], object]], None] | None = None  # the loop's
        self._scope: Any = None  # main's cancel scope
        self._error: BaseException | None = None  # what main raised
        self._now = False  # a second SIGINT came through the loop: main is interrupted
        self._ended_at: float | None = None
        self._over = threading.Event()  # run() is returning: the bound is off
        self._before = set(threading.enumerate())
        # Called in the signal handler itself: it must act before the loop runs, and
        # when the loop no longer does.
        self._listener = SignalListener(_at_once, self._preempted, self._interrupted, fallback=True)

    def listen(self) -> None:
        self._listener.install()  # nothing, off the main thread

    def over(self) -> bool:
        """The program is over: the bound is off and its listener goes. Whether a second
        SIGINT came while it ran (counted while its listener was installed)."""
        self._over.set()
        interrupted = self.interrupted()
        self._listener.restore()
        return interrupted

    def interrupted(self) -> bool:
        """A second SIGINT came while the program ran (whichever listener heard it)."""
        from ._session.signals import interrupts

        return self._listener.installed and interrupts() >= 2

    async def run(self) -> None:
        import anyio

        from ._training.thread import loop_caller

        self._call = loop_caller()
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if _signal is not None:  # it came before the loop ran
                    scope.cancel()
                await self._main(*self._args)
            if self._now:  # a second SIGINT handed to main through the loop
                raise KeyboardInterrupt("a second SIGINT")
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._main_ended()

    # -- stop signals outside a session (in the signal handler) -------------------------

    def _preempted(self, name: str) -> None:
        global _signal
        _signal = name  # a plain assignment: no lock may be taken in a signal handler
        call = self._call
        if call is not None and self._ended_at is None:
            call(lambda: self._cancel(name))

    def _cancel(self, name: str) -> None:
        """On the loop: the program ends at its next ``await``."""
        from ._log import log

        if self._scope is not None:
            self._scope.cancel()
        with contextlib.suppress(Exception):
            log.warning("signal.received", signal=name, action="end the program (preempted)")

    def _interrupted(self, name: str) -> None:
        """A second SIGINT: ``KeyboardInterrupt`` raised where the program is, as Python
        would; but inside trio's own machinery (its scheduler waiting for events), where
        it would abandon the run with no ``finally`` of main run, main gets it at its next
        ``await`` instead, as trio's own handler does."""
        call = self._call
        if call is not None and self._ended_at is None and _in_trio_machinery():
            call(self._interrupt_main)
            return
        signal.default_int_handler(signal.SIGINT, None)  # raises KeyboardInterrupt

    def _interrupt_main(self) -> None:
        """On the loop: main ends at its next ``await``, with ``KeyboardInterrupt``."""
        self._now = True
        if self._scope is not None:
            self._scope.cancel()

    # -- the bound ---------------------------------------------------------------------

    def _main_ended(self) -> None:
        import time

        self._ended_at = time.monotonic()
        threading.Thread(target=self._bound, name="asupervisor-exit", daemon=True).start()

    def _bound(self) -> None:
        """Beside an event loop that does not end after ``main``: end the process."""
        if not self._over.wait(EXIT_SECS):
            self.exit_now(self._error)

    def join_threads(self, error: BaseException | None) -> None:
        """Wait, within the bound, for the event loop's worker threads that the
        interpreter's exit would wait for (anyio's are not daemons): one still running a
        call that was given up on (``abandon_on_cancel``, as every bounded wait of a
        session's close is) would hold the process for good. End the process if one is
        still there. Threads of the application's own are its own: Python waits for them."""
        import time

        if self._ended_at is None:
            return
        deadline = self._ended_at + EXIT_SECS
        for thread in self._held():
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._held():
            self.exit_now(error)

    def _held(self) -> list[threading.Thread]:
        """The event loop's worker threads still running that the exit would wait for."""
        return [
            t
            for t in threading.enumerate()
            if t not in self._before
            and not t.daemon
            and type(t).__module__.startswith("anyio.")
            and t.is_alive()
        ]

    def exit_now(self, error: BaseException | None) -> None:
        """End the process now, with the status it would have ended with."""
        from ._log import log

        status = _program_status(error, self.interrupted())
        with _lock:
            ending = _last
        abandoned = [] if ending is None else [f"service:{n}" for n in ending.abandoned]
        threads = [f"thread:{t.name}" for t in self._held()]
        with contextlib.suppress(Exception):
            log.error(
                "process.exit_forced",
                status=status,
                after_secs=EXIT_SECS,
                left_behind=abandoned + threads,
            )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def end_process(ending: Ending) -> None:
    """End the process now, from a thread beside an event loop that is held and cannot
    return (``_session/held.py``), once the session's end is on record: its ending's
    status, or 130 after a second SIGINT, as ``asv.run`` would have returned."""
    from ._session.signals import interrupts

    status = status_of(None, ending, _signal, interrupts() >= 2)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _print_error(error: BaseException) -> None:
    """What escaped ``main``, as Python would print it; a store that cannot be reached in
    its one line (its traceback is the library's and TF's, and says nothing more)."""
    from ._errors import StoreUnreachableError

    if isinstance(error, StoreUnreachableError):
        print(f"asupervisor.{type(error).__name__}: {error}", file=sys.stderr, flush=True)
    elif isinstance(error, CheckpointMismatchError):
        # Its text is the whole story (each variable that differs, what to do); a
        # traceback would bury it under TF's own.
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
    else:
        traceback.print_exception(error)


def _at_once(action: Callable[[], object]) -> None:
    action()


def _in_trio_machinery() -> bool:
    """In a signal handler: whether the code it interrupted is trio's own (protected from
    ``KeyboardInterrupt``), not a task's."""
    trio = sys.modules.get("trio")
    if trio is None or not trio.lowlevel.in_trio_run():
        return False
    return bool(trio.lowlevel.currently_ki_protected())


def exit_status(outcome: Outcome | None) -> int:
    """``outcome.exit_status``; 0 for ``None`` (no session ended)."""
    return 0 if outcome is None else outcome.exit_status
