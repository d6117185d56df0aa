"""SIGTERM and SIGINT (or the session's own ``stop_signals``): a graceful stop first; a
second SIGINT stops at once.

Python runs signal handlers on the main thread between two bytecodes, which
here means inside the event loop, possibly while it holds a lock. So a handler
only hands a callback to the loop (``call_soon_threadsafe`` and trio's
``run_sync_soon`` are safe to call from a signal handler) and returns.

Sessions that overlap in one process share one installed handler: the handlers
the process had before the *first* session are saved once and put back when the
*last* one ends, whatever order they end in (a stack, not a chain of saves that
the first to end would unwind under the others). A handler the application installs
over ours in between is a level of its own: a listener installed after it puts it
back when the last of that level leaves. A signal goes to every session that is
listening for it; each signal is counted on its own (sessions may listen for
different ones: SLURM's requeue signal is usually SIGUSR1).

A *fallback* listener (``asv.run``'s, for the program's whole run) hears a signal only
when no session listens for it: before a session, between two, after the last.

A second SIGINT is the user's "now", whatever the phase: SIGINTs are counted for the
process while any listener is installed (for ``asv.run``'s whole program, its fallback
listener being one), not per session, so one that comes after a session's stop began,
after its ending was decided or after it ended is a second one all the same.

A SIGTERM (or a first SIGINT) that reaches a session while it is already stopping
belongs to that session's ending (the stop it asks for is under way). Once the
session's listener is gone it is raised again only for a handler of the application's
own; never for a default, which would kill or interrupt a process whose session has
just saved.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from .._training.thread import LoopCaller

SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the default stop signals
# Signals a process cannot catch, or whose default meaning a training run must keep
# (a crash, a stopped job): never a graceful stop.
_REFUSED = {
    signal.SIGKILL,
    signal.SIGSTOP,
    signal.SIGSEGV,
    signal.SIGBUS,
    signal.SIGFPE,
    signal.SIGILL,
    signal.SIGABRT,
    signal.SIGCHLD,
}

_lock = threading.RLock()
_listeners: list[SignalListener] = []
# For each signal, the levels of our dispatcher: the handler in force before it was
# installed over it, and the listeners installed while that level is the top one.
_levels: dict[int, list[tuple[Any, list[SignalListener]]]] = {}
# SIGINTs that came while any listener was installed; back to 0 when the last one goes.
_sigints = 0


class SignalListener:
    """One session's part in the process's signal handling."""

    def __init__(
        self,
        caller: LoopCaller,
        graceful: Callable[[str], None],
        immediate: Callable[[str], None],
        signals: tuple[signal.Signals, ...] = SIGNALS,
        *,
        fallback: bool = False,
    ) -> None:
        self._caller = caller
        self._graceful = graceful
        self._immediate = immediate
        self.signals = signals
        self.fallback = fallback  # hears a signal only when no other listener does
        self.received: list[str] = []
        self.installed = False
        # A second SIGINT reached this listener (set in the signal handler itself, so
        # that one whose callback the loop has not run yet is known all the same).
        self.interrupted = False
        # When the first signal reached it (monotonic), set in the handler: the stop it
        # asks for may wait in the loop's queue behind code that holds the loop.
        self.first_at: float | None = None

    def install(self) -> bool:
        """Listen; ``False`` (and nothing done) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        with _lock:
            for sig in self.signals:
                levels = _levels.setdefault(sig, [])
                current = signal.getsignal(sig)
                if levels and current is _dispatch:
                    levels[-1][1].append(self)
                else:  # the first listener, or the application's handler is over ours
                    levels.append((current, [self]))
                # Set again even when Python says it is ours: native code can replace a
                # handler without Python knowing (TensorFlow's preemption notifier does,
                # for SIGTERM, once a multi-worker job's coordination service starts).
                signal.signal(sig, _dispatch)
            _listeners.append(self)
        self.installed = True
        return True

    def restore(self) -> None:
        """Stop listening; the last listener to go puts the process's handlers back."""
        global _sigints
        if not self.installed:
            return
        self.installed = False
        with _lock:
            if self in _listeners:
                _listeners.remove(self)
            for sig in self.signals:
                levels = _levels.get(sig, [])
                for _, members in levels:
                    if self in members:
                        members.remove(self)
                while levels and not levels[-1][1]:  # the top level is empty: undo it
                    handler, _ = levels.pop()
                    if signal.getsignal(sig) is _dispatch:  # not one installed over ours
                        signal.signal(sig, handler)
                if not levels:
                    _levels.pop(sig, None)
            if not _listeners:
                _sigints = 0

    def deliver(self, signum: int, second_interrupt: bool = False) -> None:
        """In the signal handler: ``second_interrupt`` is a SIGINT that had one before it
        (``_dispatch`` counts them for the process)."""
        name = signal.Signals(signum).name
        self.received.append(name)
        if self.first_at is None:
            self.first_at = time.monotonic()
        if second_interrupt:
            self.interrupted = True
        action = self._immediate if second_interrupt else self._graceful
        self._caller(lambda: action(name))


def _dispatch(signum: int, frame: FrameType | None) -> None:
    global _sigints
    with _lock:
        listeners = [listener for listener in _listeners if signum in listener.signals]
        if signum == signal.SIGINT:
            _sigints += 1
        second_interrupt = signum == signal.SIGINT and _sigints >= 2
    sessions = [listener for listener in listeners if not listener.fallback]
    for listener in sessions or listeners:
        listener.deliver(signum, second_interrupt)


def interrupts() -> int:
    """How many SIGINTs came while a listener was installed (since the first of those
    installed now; ``asv.run``'s program listens for its whole run)."""
    return _sigints


def hand_on(signums: list[int]) -> None:
    """After a session's listener is gone: raise again the stop signals that came while
    it stopped, for a handler of the application's own now in force. Nothing is raised
    for a default (SIG_DFL would kill the process that has just saved, Python's and the
    event loop's SIGINT handlers would interrupt it), an ignored signal, or this
    module's dispatcher (whoever listens there heard the signal when it came): the
    session's ending has kept it."""
    for signum in signums:
        if _applications(signal.getsignal(signum)):
            signal.raise_signal(signum)


def _applications(handler: Any) -> bool:
    """Whether ``handler`` is a function the application installed."""
    if not callable(handler) or handler in (signal.default_int_handler, _dispatch):
        return False
    function = getattr(handler, "func", handler)  # a functools.partial: asyncio's own
    module = getattr(function, "__module__", None) or ""
    return module.split(".")[0] not in ("asyncio", "trio", "anyio")


def check_stop_signals(value: Any) -> tuple[signal.Signals, ...]:
    """``stop_signals``: signals (``signal.SIGUSR1``), their numbers or names (``"SIGUSR1"``,
    ``"USR1"``), at least one; a ``ValueError`` naming the argument otherwise."""
    if isinstance(value, (str, int)) or not isinstance(value, (tuple, list, set, frozenset)):
        raise ValueError(
            f"stop_signals must be a tuple of signals (signal.SIGTERM, 'SIGUSR1', ...), "
            f"not {value!r}"
        )
    found: list[signal.Signals] = []
    for item in value:
        sig = _as_signal(item)
        if sig is None:
            raise ValueError(f"stop_signals: {item!r} is not a signal of this platform")
        if sig in _REFUSED:
            raise ValueError(
                f"stop_signals: {sig.name} cannot ask for a graceful stop (it cannot be "
                "caught, or it means a crash or a child process)"
            )
        if sig not in found:
            found.append(sig)
    if not found:
        raise ValueError("stop_signals must name at least one signal (or handle_signals=False)")
    return tuple(found)


def _as_signal(item: Any) -> signal.Signals | None:
    if isinstance(item, bool):
        return None
    if isinstance(item, str):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        return signal.Signals.__members__.get(name)
    if isinstance(item, int):
        try:
            return signal.Signals(item)
        except ValueError:
            return None
    return None
