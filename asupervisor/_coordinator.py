"""Coordinator: the one stop flag of a session, its reason and its first error.

Anyone may ask for a stop from any thread: a step, a hook, a service, a signal
handler, the user. The first error wins; clean-stop exceptions (end of data)
stop without an error. While a session runs, the coordinator is bound to the
session's cancel scope: the first error cancels the session's body at once,
so a failure anywhere stops everything.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio

from ._log import log
from ._worker import LoopCaller, loop_caller

ExcInfo = tuple[type[BaseException], BaseException, Any]


def _default_clean_stop_types() -> tuple[type[BaseException], ...]:
    import tensorflow as tf  # imported late: `asupervisor inspect --help` must stay fast

    return (tf.errors.OutOfRangeError, StopIteration, StopAsyncIteration)


class Coordinator:
    """A thread-safe stop flag plus the first exception, as ``tf.train.Coordinator``."""

    def __init__(
        self, clean_stop_exception_types: tuple[type[BaseException], ...] | None = None
    ) -> None:
        if clean_stop_exception_types is not None and not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in clean_stop_exception_types
        ):
            raise ValueError("clean_stop_exception_types must be a tuple of exception classes")
        self._clean = clean_stop_exception_types
        self._lock = threading.Lock()
        self._stopped = False
        self._error: BaseException | None = None
        self._reason: str | None = None
        self._stopped_at: float | None = None
        self._waiters: list[tuple[LoopCaller, anyio.Event]] = []
        self._on_error: tuple[LoopCaller, Callable[[], object]] | None = None

    @property
    def clean_stop_exception_types(self) -> tuple[type[BaseException], ...]:
        if self._clean is None:
            self._clean = _default_clean_stop_types()
        return self._clean

    @property
    def reason(self) -> str | None:
        """Why the stop was requested; ``None`` while no stop was requested."""
        return self._reason

    @property
    def stopped_at(self) -> float | None:
        """``time.monotonic()`` when the stop was first requested, else ``None``."""
        return self._stopped_at

    @property
    def error(self) -> BaseException | None:
        """The first non-clean exception reported, or ``None``."""
        return self._error

    def should_stop(self) -> bool:
        return self._stopped

    def request_stop(self, exc: BaseException | ExcInfo | None = None) -> None:
        """Ask everything to stop; ``exc`` (an exception or exc_info) is the cause."""
        self._request(exc, "requested")

    def _request(
        self, exc: BaseException | ExcInfo | None, reason: str, *, failure: bool = False
    ) -> None:
        """Stop with ``reason``; an error's reason is ``"exception"`` unless a more
        specific one (``"timeout"``, ``"nan"``) is given. ``failure=True``: ``exc``
        is an error whatever its type (a service that failed did not reach the end
        of its data)."""
        error = _as_exception(exc)
        if not failure and error is not None and isinstance(error, self.clean_stop_exception_types):
            error, reason = None, "end_of_data"
        with self._lock:
            first_stop = not self._stopped
            first_error = error is not None and self._error is None
            dropped = error is not None and not first_error and error is not self._error
            self._stopped = True
            if first_stop:
                self._stopped_at = time.monotonic()
            if first_error:
                self._error = error
                self._reason = "exception" if reason == "requested" else reason
            elif first_stop:
                self._reason = reason
            waiters, self._waiters = self._waiters, []
            on_error = self._on_error if first_error else None
        if first_stop or first_error:
            log.info("stop.requested", reason=self._reason, error=_describe(error))
        if dropped:
            log.warning("stop.error_dropped", error=_describe(error), first=_describe(self._error))
        for call, event in waiters:
            call(event.set)
        if on_error is not None:
            call, cancel = on_error
            call(cancel)

    async def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Wait until a stop is requested; ``False`` if ``timeout`` seconds passed first."""
        event = anyio.Event()
        entry = (loop_caller(), event)
        with self._lock:
            if self._stopped:
                return True
            self._waiters.append(entry)
        try:
            with anyio.move_on_after(timeout):
                await event.wait()
            return event.is_set()
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def clear_stop(self) -> None:
        """Forget the stop request and the error, so the coordinator can be used again."""
        with self._lock:
            self._stopped = False
            self._stopped_at = None
            self._error = None
            self._reason = None

    @contextlib.contextmanager
    def stop_on_exception(self) -> Iterator[None]:
        """Report an exception raised in the block as a stop request, and suppress it."""
        try:
            yield
        except Exception as exc:
            self.request_stop(exc)

    def raise_requested_exception(self) -> None:
        """Raise the first error reported, if any (the same object, traceback intact)."""
        if self._error is not None:
            raise self._error

    def _bind(self, call: LoopCaller, cancel_body: Callable[[], object]) -> None:
        """Tie the coordinator to a running session: an error cancels its body."""
        with self._lock:
            self._on_error = (call, cancel_body)
        if self._error is not None:
            call(cancel_body)

    def _unbind(self) -> None:
        with self._lock:
            self._on_error = None


def _as_exception(exc: BaseException | ExcInfo | None) -> BaseException | None:
    if exc is None or isinstance(exc, BaseException):
        return exc
    if isinstance(exc, tuple) and len(exc) == 3 and isinstance(exc[1], BaseException):
        return exc[1]
    raise TypeError(f"exc must be an exception or an exc_info tuple, not {exc!r}")


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"
