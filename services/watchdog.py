"""WatchdogService: a step that runs too long is reported, with every thread's stack."""

from __future__ import annotations

import linecache
import sys
import threading
import time
import traceback
from types import FrameType

from asupervisor import ManagedSession, StepTimeout, logger

from ._checks import positive

# Reading a frame's source line reads its file: that is I/O on the event loop, seconds
# of it on a loaded machine (a traceback of every thread reads dozens of files), and a
# stop waits behind it. Files are read for about this long (a read under way finishes),
# where each thread is first; lines of files already read cost nothing and are kept.
LINES_BUDGET_SECS = 0.2
TRAINING_THREAD = "asupervisor-training"

Where = tuple[str, int | None, str]  # file, line, function


def thread_stacks(budget_secs: float = LINES_BUDGET_SECS) -> dict[str, str]:
    """Every thread's current stack, by thread name: what a hung step is doing, as
    ``traceback.format_stack`` prints it; a source line is left out where its file could
    not be read within ``budget_secs`` (the innermost frames first, the training
    threads' before others)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = {
        f"{names.get(ident, 'unknown')} ({ident})": _walk(frame)
        for ident, frame in sys._current_frames().items()
    }
    sources = _read_lines(frames, time.monotonic() + budget_secs)
    return {name: _format(stack, sources) for name, stack in frames.items()}


def _walk(frame: FrameType | None) -> list[Where]:
    """A thread's frames, outermost first (as a traceback prints them); no file read."""
    stack: list[Where] = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return stack[::-1]


def _read_lines(frames: dict[str, list[Where]], deadline: float) -> dict[Where, str]:
    """The source lines read by ``deadline`` (at least one), level by level from the
    innermost frame of every thread: where each thread is matters most."""
    first = sorted(frames, key=lambda name: not name.startswith(TRAINING_THREAD))
    depth = max((len(stack) for stack in frames.values()), default=0)
    lines: dict[Where, str] = {}
    for level in range(1, depth + 1):
        for name in first:
            stack = frames[name]
            if level > len(stack) or stack[-level] in lines:
                continue
            filename, lineno, _ = where = stack[-level]
            late = bool(lines) and time.monotonic() >= deadline
            if lineno is None or (late and not _in_memory(filename)):
                continue  # past the budget, only what needs no read
            lines[where] = linecache.getline(filename, lineno)
    return lines


def _in_memory(filename: str) -> bool:
    """``linecache`` holds the file's lines (a 1-tuple entry is a loader still to call)."""
    return len(linecache.cache.get(filename, ())) > 1


def _format(stack: list[Where], lines: dict[Where, str]) -> str:
    # A line given ("" where none was read) keeps format() from reading the file itself.
    frames = [
        traceback.FrameSummary(*where, lookup_line=False, line=lines.get(where, ""))
        for where in stack
    ]
    return "".join(traceback.StackSummary.from_list(frames).format())


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
            # A call of K steps (train's steps_per_loop) has K steps' time.
            if elapsed > self.timeout_secs * sess.steps_in_call():
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
