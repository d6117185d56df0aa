"""SIGTERM and SIGINT: a graceful stop first; a second SIGINT stops at once.

Python runs signal handlers on the main thread between two bytecodes, which
here means inside the event loop, possibly while it holds a lock. So a handler
only hands a callback to the loop (``call_soon_threadsafe`` and trio's
``run_sync_soon`` are safe to call from a signal handler) and returns.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from ._log import log
from ._worker import LoopCaller

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalHandlers:
    """Installs the session's handlers and puts the user's back afterwards."""

    def __init__(
        self,
        caller: LoopCaller,
        graceful: Callable[[str], None],
        immediate: Callable[[str], None],
    ) -> None:
        self._caller = caller
        self._graceful = graceful
        self._immediate = immediate
        self._previous: dict[int, Any] = {}
        self.received: list[str] = []

    def install(self) -> bool:
        """Install the handlers; ``False`` (and nothing done) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            log.info("signals.not_handled", reason="the session is not in the main thread")
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        second_interrupt = signum == signal.SIGINT and self.received.count("SIGINT") >= 2
        action = self._immediate if second_interrupt else self._graceful
        self._caller(lambda: action(name))
