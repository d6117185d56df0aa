"""The one stop flag of a session, and what ends the data.

The stop path's phases and its grace are ``StopPath``'s (``stoppath.py``); this is the
flag every part stops by.

Whoever asks for a stop, and from whatever thread, goes through ``StopFlag.set``:
the first stop fixes the reason, the first error wins, later errors are logged.
Errors reach the flag already classified (``None`` for a clean stop): where an
error came from decides what it means (``SessionRuntime.job_failed``).
Once the session's ending is decided the flag is sealed: ``set`` takes nothing more
(it returns ``False``, and whoever reported an error raises it or logs it) until the
flag is cleared for the next session.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from .._log import log
from .._outcome import StopReason
from .._training.thread import LoopCaller, loop_caller

ExcInfo = tuple[type[BaseException], BaseException, Any]


def end_of_data_types() -> tuple[type[BaseException], ...]:
    """What user code raises when its data ran out (TF1's clean-stop types)."""
    import tensorflow as tf  # imported late: `asupervisor inspect --help` must stay fast

    return (tf.errors.OutOfRangeError, StopIteration, StopAsyncIteration)


def as_exception(exc: BaseException | ExcInfo | None) -> BaseException | None:
    if exc is None or isinstance(exc, BaseException):
        return exc
    if isinstance(exc, tuple) and len(exc) == 3 and isinstance(exc[1], BaseException):
        return exc[1]
    raise TypeError(f"exc must be an exception or an exc_info tuple, not {exc!r}")


def end_of_data_error(exc: BaseException) -> BaseException:
    """What the waiter of a job gets when the data ran out: the job's own error, or for a
    ``StopIteration`` (which cannot cross into a coroutine: PEP 479) TF's end-of-data
    error, with the ``StopIteration`` as its cause."""
    if not isinstance(exc, (StopIteration, StopAsyncIteration)):
        return exc
    import tensorflow as tf

    error: BaseException = tf.errors.OutOfRangeError(
        None, None, f"End of sequence: the job raised {type(exc).__name__}"
    )
    error.__cause__ = exc
    return error


def describe_error(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


class StopFlag:
    """Thread-safe: whether a stop was asked for, why, when, and the first error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stopped = False
        self.error: BaseException | None = None
        self.reason: StopReason | str | None = None
        self.stopped_at: float | None = None
        self._waiters: list[tuple[LoopCaller, anyio.Event]] = []
        self._on_error: tuple[LoopCaller, Callable[[], object]] | None = None
        self._sealed = False  # the session's ending is decided: nothing more is taken

    def set(self, error: BaseException | None, reason: StopReason | str) -> bool:
        """Stop with ``reason``; ``error`` (``None`` for a clean stop) is re-raised when the
        session ends. An error's reason is ``EXCEPTION`` unless a more specific one
        (``TIMEOUT``, ``NAN``) is given. ``False`` once the flag is sealed: nothing will
        re-raise ``error`` then, and the caller must not lose it."""
        with self._lock:
            if self._sealed:
                return False
            first_stop = not self.stopped
            first_error = error is not None and self.error is None
            dropped = error is not None and not first_error and error is not self.error
            self.stopped = True
            if first_stop:
                self.stopped_at = time.monotonic()
            if first_error:
                self.error = error
                self.reason = StopReason.EXCEPTION if reason is StopReason.REQUESTED else reason
            elif first_stop:
                self.reason = reason
            waiters, self._waiters = self._waiters, []
            on_error = self._on_error if first_error else None
        # Wake everyone before logging: a log call can fail (a closed pipe).
        for call, event in waiters:
            call(event.set)
        if on_error is not None:
            call, cancel = on_error
            call(cancel)
        with contextlib.suppress(Exception):
            if first_stop or first_error:
                log.info("stop.requested", reason=str(self.reason), error=describe_error(error))
            if dropped:
                log.warning(
                    "stop.error_dropped",
                    error=describe_error(error),
                    first=describe_error(self.error),
                )
        return True

    def seal(self) -> tuple[BaseException | None, StopReason | str | None]:
        """The session's ending is being decided from what the flag holds now (returned:
        the first error and the reason); from here on ``set`` takes nothing."""
        with self._lock:
            self._sealed = True
            return self.error, self.reason

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until a stop is requested; ``False`` if ``timeout`` seconds passed first.

        Always a checkpoint of the loop, even when the stop is already there: a service
        that swallows its cancellation and calls this again is cancelled again, instead
        of spinning on a loop that never gets the thread back."""
        await anyio.lowlevel.checkpoint()
        event = anyio.Event()
        entry = (loop_caller(), event)
        with self._lock:
            if self.stopped:
                return True
            self._waiters.append(entry)
        try:
            with anyio.move_on_after(timeout):
                await event.wait()
            return event.is_set()
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def clear(self) -> None:
        with self._lock:
            self._sealed = False
            self.stopped = False
            self.stopped_at = None
            self.error = None
            self.reason = None

    def bind(self, call: LoopCaller, cancel_body: Callable[[], object]) -> None:
        """While a session runs, an error cancels its body at once."""
        with self._lock:
            self._on_error = (call, cancel_body)
            error = self.error
        if error is not None:
            call(cancel_body)

    def unbind(self) -> None:
        with self._lock:
            self._on_error = None
