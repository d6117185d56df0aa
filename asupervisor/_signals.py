"""SIGTERM and SIGINT: a graceful stop first; a second SIGINT stops at once.

Python runs signal handlers on the main thread between two bytecodes, which
here means inside the event loop, possibly while it holds a lock. So a handler
only hands a callback to the loop (``call_soon_threadsafe`` and trio's
``run_sync_soon`` are safe to call from a signal handler) and returns.

Sessions that overlap in one process share one installed handler: the handlers
the process had before the *first* session are saved once and put back when the
*last* one ends, whatever order they end in (a stack, not a chain of saves that
the first to end would unwind under the others). A signal goes to every session
that is listening.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from ._worker import LoopCaller

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_lock = threading.RLock()
_listeners: list[SignalListener] = []
_previous: dict[int, Any] = {}


class SignalListener:
    """One session's part in the process's signal handling."""

    def __init__(
        self,
        caller: LoopCaller,
        graceful: Callable[[str], None],
        immediate: Callable[[str], None],
    ) -> None:
        self._caller = caller
        self._graceful = graceful
        self._immediate = immediate
        self.received: list[str] = []
        self.installed = False

    def install(self) -> bool:
        """Listen; ``False`` (and nothing done) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        with _lock:
            if not _listeners:
                for sig in SIGNALS:
                    _previous[sig] = signal.getsignal(sig)
                    signal.signal(sig, _dispatch)
            _listeners.append(self)
        self.installed = True
        return True

    def restore(self) -> None:
        """Stop listening; the last listener to go puts the process's handlers back."""
        if not self.installed:
            return
        self.installed = False
        with _lock:
            if self in _listeners:
                _listeners.remove(self)
            if not _listeners:
                for sig, previous in _previous.items():
                    signal.signal(sig, previous)
                _previous.clear()

    def deliver(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        second_interrupt = signum == signal.SIGINT and self.received.count("SIGINT") >= 2
        action = self._immediate if second_interrupt else self._graceful
        self._caller(lambda: action(name))


def _dispatch(signum: int, frame: FrameType | None) -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener.deliver(signum)


def redeliver(signums: list[int]) -> None:
    """Raise signals again after the session's listener is gone, so that the
    handlers now in force see them (a signal that came during shutdown is not lost)."""
    for signum in signums:
        signal.raise_signal(signum)
