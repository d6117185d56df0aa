"""Coordinator: the public face of a stop flag, as ``tf.train.Coordinator``.

Anyone may ask for a stop from any thread: a step, a hook, a service, a signal
handler, the user. The first error wins; errors that say the data ran out stop
without an error. ``sv.coord`` is the coordinator of the Supervisor's open
session (or of the next one): while a session runs, ``request_stop`` goes through
that session's one stop path, so in a multi-worker job it stops every worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ._stopping import ExcInfo, StopFlag, as_exception


def _default_clean_stop_types() -> tuple[type[BaseException], ...]:
    import tensorflow as tf  # imported late: `asupervisor inspect --help` must stay fast

    return (tf.errors.OutOfRangeError, StopIteration, StopAsyncIteration)


class Coordinator:
    """A thread-safe stop flag plus the first exception, as ``tf.train.Coordinator``.

    With ``clean_stop_exception_types=None`` an error stops cleanly when it says the
    data ran out: ``StopIteration``, or TF's ``OutOfRangeError`` from a data op
    ("End of sequence"); an ``OutOfRangeError`` from a failed write (a full disk) is
    an error. Given types are taken as they are.
    """

    def __init__(
        self, clean_stop_exception_types: tuple[type[BaseException], ...] | None = None
    ) -> None:
        if clean_stop_exception_types is not None and not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in clean_stop_exception_types
        ):
            raise ValueError("clean_stop_exception_types must be a tuple of exception classes")
        self._flag = StopFlag(clean_stop_exception_types)
        self._route: Callable[[BaseException | None], None] | None = None

    @property
    def clean_stop_exception_types(self) -> tuple[type[BaseException], ...]:
        return self._flag.clean_types or _default_clean_stop_types()

    @property
    def reason(self) -> str | None:
        """Why the stop was requested; ``None`` while no stop was requested."""
        return self._flag.reason

    @property
    def stopped_at(self) -> float | None:
        """``time.monotonic()`` when the stop was first requested, else ``None``."""
        return self._flag.stopped_at

    @property
    def error(self) -> BaseException | None:
        """The first non-clean exception reported, or ``None``."""
        return self._flag.error

    def should_stop(self) -> bool:
        return self._flag.stopped

    def request_stop(self, exc: BaseException | ExcInfo | None = None) -> None:
        """Ask everything to stop; ``exc`` (an exception or exc_info) is the cause."""
        error = as_exception(exc)
        if self._route is not None:
            self._route(error)
        else:
            self._flag.set(error, "requested")

    async def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Wait until a stop is requested; ``False`` if ``timeout`` seconds passed first."""
        return await self._flag.wait(timeout)

    def clear_stop(self) -> None:
        """Forget the stop request and the error, so the coordinator can be used again."""
        self._flag.clear()

    @contextlib.contextmanager
    def stop_on_exception(self) -> Iterator[None]:
        """Report an exception raised in the block as a stop request, and suppress it."""
        try:
            yield
        except Exception as exc:
            self.request_stop(exc)

    def raise_requested_exception(self) -> None:
        """Raise the first error reported, if any (the same object, traceback intact)."""
        if self._flag.error is not None:
            raise self._flag.error


def session_coordinator() -> tuple[Coordinator, StopFlag, Callable[..., None]]:
    """A coordinator for one session: its flag, and how to route its stops through the
    session's stop path once the session exists."""
    coord = Coordinator()

    def route_to(request_stop: Callable[[BaseException | None], None]) -> None:
        coord._route = request_stop

    return coord, coord._flag, route_to
