"""WatchdogService: a step that runs too long is reported, with every thread's stack."""

from __future__ import annotations

import linecache
import sys
import threading
import time
from types import FrameType

from asupervisor import ManagedSession, StepTimeout, logger

from ._checks import positive

# Reading a frame's source line reads its file: that is I/O on the event loop, seconds
# of it on a loaded machine (a traceback of every thread reads dozens of files), and a
# stop waits behind it. Lines are read for this long at most, where each thread is first.
LINES_BUDGET_SECS = 0.2
TRAINING_THREAD = "asupervisor-training"


def thread_stacks(budget_secs: float = LINES_BUDGET_SECS) -> dict[str, str]:
    """Every thread's current stack, by thread name: what a hung step is doing. Each
    frame's file, line and function; its source line where it could be read within
    ``budget_secs`` (the innermost frames first, the training threads' before others)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = {
        f"{names.get(ident, 'unknown')} ({ident})": _walk(frame)
        for ident, frame in sys._current_frames().items()
    }
    sources = _read_lines(frames, time.monotonic() + budget_secs)
    return {
        name: "".join(_format(where, sources.get(where[:2], "")) for where in stack)
        for name, stack in frames.items()
    }


Where = tuple[str, int, str]  # file, line, function


def _walk(frame: FrameType | None) -> list[Where]:
    """A thread's frames, outermost first (as a traceback prints them)."""
    stack: list[Where] = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno or 0, frame.f_code.co_name))
        frame = frame.f_back
    return stack[::-1]


def _read_lines(frames: dict[str, list[Where]], deadline: float) -> dict[tuple[str, int], str]:
    first = sorted(frames, key=lambda name: not name.startswith(TRAINING_THREAD))
    depth = max((len(stack) for stack in frames.values()), default=0)
    lines: dict[tuple[str, int], str] = {}
    for level in range(1, depth + 1):  # innermost first, across threads
        for name in first:
            stack = frames[name]
            if level > len(stack):
                continue
            filename, lineno, _ = stack[-level]
            if (filename, lineno) in lines:
                continue
            if lines and time.monotonic() > deadline:
                return lines
            lines[filename, lineno] = linecache.getline(filename, lineno).strip()
    return lines


def _format(where: Where, line: str) -> str:
    filename, lineno, function = where
    text = f'  File "{filename}", line {lineno}, in {function}\n'
    return text + (f"    {line}\n" if line else "")


class WatchdogService:
    """Stops training with ``StepTimeout`` (reason ``timeout``) when one job on the
    training thread (a step with its hooks, a save, a call) runs longer than
    ``timeout_secs``, after logging every thread's stack."""

    name = "watchdog"

    def __init__(self, timeout_secs: float) -> None:
        self.timeout_secs = positive("timeout_secs", timeout_secs)
        # Check often enough that a timeout is seen within a quarter of it (at most 1 s late).
        self.check_every = min(self.timeout_secs / 4, 1.0)

    async def run(self, sess: ManagedSession) -> None:
        while not await sess.sleep_until_stop(self.check_every):
            running = sess.job_in_flight()
            if running is None:
                continue
            name, since = running
            elapsed = time.monotonic() - since
            if elapsed > self.timeout_secs:
                logger.error(
                    "step.timeout",
                    step=sess.global_step,
                    job=name,
                    seconds=round(elapsed, 2),
                    timeout_secs=self.timeout_secs,
                    stacks=thread_stacks(),
                )
                error = StepTimeout(
                    f"step {name!r} has run {elapsed:.1f} s, longer than "
                    f"step_timeout_secs={self.timeout_secs}"
                )
                sess.request_stop(error, reason="timeout")
                return
