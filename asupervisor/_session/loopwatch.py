"""Notice an event loop that something blocks, and say what holds it.

Services, the session's body and the stop path all run on the event loop; code that
blocks it (``time.sleep``, a long computation, blocking I/O in a service) holds them
all, the stop included, and the library cannot interrupt it. A thread of its own asks
the loop a question every ``PING_SECS`` (one at a time); when an answer is ``STALL_SECS``
late, and the watch has looked ``STALL_LOOKS`` times meanwhile, it logs
``loop.stalled`` with the service whose code holds the loop (read from the loop
thread's stack) and where, and ``loop.resumed`` with how long it lasted once the loop
answers again.

The watch thread also holds the stop to its bound when the loop cannot: once a stop has
been asked for (``stop_asked_at``) and its grace has passed with the loop still held
(``STALL_SECS`` without an answer), it decides, once, that the loop is stuck and hands
the end of the process to ``held`` (``held.py``: the final save on the idle training
thread, the session's end on record, then the process ends): the loop's thread cannot
be interrupted, and nothing else would ever act.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType

from .._log import log
from .._training.thread import LoopCaller
from .services import supervise

PING_SECS = 0.25
STALL_SECS = 2.0
STALL_LOOKS = 4


# Given the holder (``service:<name>`` or the body), its innermost line and the loop
# thread's whole stack: ends the process (never returns, but in a test's stand-in).
Held = Callable[[str, str, str], None]


class LoopWatch:
    def __init__(
        self,
        caller: LoopCaller,
        *,
        grace_secs: float = 0.0,
        stop_asked_at: Callable[[], float | None] = lambda: None,
        held: Held | None = None,
    ) -> None:
        self._caller = caller
        self._grace = grace_secs
        self._stop_asked_at = stop_asked_at
        self._held = held
        self._loop_thread = threading.get_ident()  # made on the loop: the loop's thread
        self._answered = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="asupervisor-loopwatch", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _answer(self) -> None:
        self._answered = time.monotonic()

    def _watch(self) -> None:
        # One question at a time, timed from when it was asked: a loop is late only on a
        # question it has not answered. Timed from the last answer instead, a watch that
        # was itself not run for a while (a loaded machine, a stopped process) found a
        # free loop "late" by all the time it had asked nothing, and past a stop's grace
        # ended a healthy process. And it must have looked ``STALL_LOOKS`` times while the
        # question waited: a process not run at all is not a loop held by its code.
        stalled_since: float | None = None
        asked = time.monotonic()
        looks = 0
        self._caller(self._answer)
        while not self._stop.wait(PING_SECS):
            if self._answered >= asked:
                if stalled_since is not None:
                    log.warning("loop.resumed", seconds=round(self._answered - stalled_since, 2))
                    stalled_since = None
                asked = time.monotonic()
                looks = 0
                self._caller(self._answer)
                continue
            looks += 1
            late = time.monotonic() - asked
            if late < STALL_SECS or looks < STALL_LOOKS:
                continue
            if stalled_since is None:
                stalled_since = asked
                held_by, where = holder(sys._current_frames().get(self._loop_thread))
                log.warning(
                    "loop.stalled",
                    seconds=round(late, 2),
                    held_by=held_by,
                    where=where,
                    hint="code on the event loop blocks it (time.sleep, blocking I/O or a "
                    "long computation in a service or the body); nothing else runs, a stop "
                    "included, until it returns: run such code with anyio.to_thread",
                )
            if self._past_grace():
                self._end_held()
                return

    def _past_grace(self) -> bool:
        """A stop was asked for and its grace has passed (the loop is held: asked then)."""
        asked = self._stop_asked_at()
        return (
            self._held is not None and asked is not None and time.monotonic() >= asked + self._grace
        )

    def _end_held(self) -> None:
        """The one decision that the loop is stuck: what holds it, and the end handed on."""
        assert self._held is not None
        frame = sys._current_frames().get(self._loop_thread)
        held_by, where = holder(frame)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "unknown"
        del frame  # no cycle through the loop thread's frames
        self._held(held_by, where, stack)


def holder(frame: FrameType | None) -> tuple[str, str]:
    """Which service a stack of the loop thread belongs to (``service:<name>``, else
    ``the session body or another task``), and its innermost line."""
    if frame is None:
        return "unknown", "unknown"
    innermost = traceback.extract_stack(frame, limit=1)
    where = f"{innermost[-1].filename}:{innermost[-1].lineno} in {innermost[-1].name}"
    current: FrameType | None = frame
    while current is not None:
        if current.f_code is supervise.__code__:
            reg = current.f_locals.get("reg")
            return f"service:{getattr(reg, 'name', '?')}", where
        current = current.f_back
    return "the session body or another task", where
