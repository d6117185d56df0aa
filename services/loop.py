"""LoopService: call a function at once, then every ``interval_secs``, until stop."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import anyio

from asupervisor import ManagedSession

from ._checks import non_negative


class LoopService:
    """Calls ``target(*args, **kwargs)`` at a fixed rate, like TF's ``LooperThread``.

    A coroutine function is awaited on the event loop; a plain function runs in
    a worker thread so that it never blocks the loop. A call that overruns the
    interval is followed by the next one at once, without a burst to catch up.
    ``interval_secs=0`` calls it back to back (as TF's ``LooperThread`` with 0).
    """

    def __init__(
        self,
        interval_secs: float,
        target: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.interval_secs = non_negative("interval_secs", interval_secs)
        if not callable(target):
            raise ValueError(f"target must be callable, not {target!r}")
        self.target = target
        self.args = args
        self.kwargs = kwargs or {}
        self.name = f"loop:{getattr(target, '__qualname__', repr(target))}"

    async def _call(self) -> None:
        if inspect.iscoroutinefunction(self.target):
            await self.target(*self.args, **self.kwargs)
        else:
            call = functools.partial(self.target, *self.args, **self.kwargs)
            # Abandoned on cancel: a stuck target must not hold the session past its grace.
            await anyio.to_thread.run_sync(call, abandon_on_cancel=True)

    async def run(self, sess: ManagedSession) -> None:
        due = anyio.current_time()
        while not sess.should_stop():
            await self._call()
            now = anyio.current_time()
            due = max(due + self.interval_secs, now)
            if await sess.sleep_until_stop(due - now):
                return
