"""ProgressService: one live line on a terminal for people watching a long run."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

import anyio

from asupervisor import ManagedSession, logger

from ._checks import optional_positive_int, positive


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "no checkpoint yet"
    if seconds < 120:
        return f"checkpoint {seconds:.0f}s ago"
    return f"checkpoint {seconds / 60:.0f}m ago"


class ProgressService:
    """Redraws ``step N/total | R steps/s | values | checkpoint Ts ago`` every
    ``interval_secs``, on ``stream`` (default stderr), only if it is a terminal:
    logs and pipes stay free of carriage returns."""

    name = "progress"

    def __init__(
        self,
        interval_secs: float = 0.5,
        *,
        stream: TextIO | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.interval_secs = positive("interval_secs", interval_secs)
        self.total_steps = optional_positive_int("total_steps", total_steps)
        self.stream = stream

    def line(self, sess: ManagedSession, rate: float) -> str:
        step = f"step {sess.global_step}"
        if self.total_steps is not None:
            step += f"/{self.total_steps}"
        last = sess.last_save
        since = None
        if last is not None and last[1] is not None:
            since = time.monotonic() - last[1]
        values = "  ".join(f"{k} {v:.4g}" for k, v in sess.last_scalars.items())
        parts = [step, f"{rate:.1f} steps/s", values, _ago(since)]
        return " | ".join(p for p in parts if p)

    async def run(self, sess: ManagedSession) -> None:
        stream = self.stream or sys.stderr
        if not stream.isatty():
            return
        drawn = threading.RLock()  # events are logged from other threads too

        def erase() -> Callable[[], None]:
            """Before a log line is printed: clear ours, so the two never share a line,
            and draw it again only once that line is written (the lock is released then)."""
            drawn.acquire()
            try:
                stream.write("\r\x1b[K")
                stream.flush()
            except BaseException:
                drawn.release()
                raise
            return drawn.release

        remove = logger.before_emit(erase)
        last_step, last_time = sess.global_step, anyio.current_time()
        rate = 0.0
        stopping = False
        try:
            while not stopping:
                stopping = await sess.sleep_until_stop(self.interval_secs)
                now, step = anyio.current_time(), sess.global_step
                if now > last_time:
                    rate = (step - last_step) / (now - last_time)
                last_step, last_time = step, now
                with drawn:  # \r and "erase to end of line": the line is redrawn in place
                    stream.write("\r" + self.line(sess, rate) + "\x1b[K")
                    stream.flush()
        finally:
            remove()
        stream.write("\n")
        stream.flush()
