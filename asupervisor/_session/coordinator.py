"""Coordinator: the public face of a stop flag, as ``tf.train.Coordinator``.

Anyone may ask for a stop from any thread: a step, a hook, a service, a signal
handler, the user. The first error wins; errors that say the data ran out stop
without an error. ``sv.coord`` is one coordinator for the Supervisor's whole life,
as in TF1: taken before a session (a thread, ``sv.loop``, a hook that keeps it), it
is the coordinator of every session that follows. While a session runs,
``request_stop`` goes through that session's one stop path (in a multi-worker job it
stops every worker); each session starts with the stop cleared.

Once a session's ending is decided, nothing will re-raise an error reported to its
coordinator: as TF1's coordinator once joined, ``request_stop(exc)`` then raises ``exc``
in the caller (a thread that outlives the session does not lose its error), until
``clear_stop`` or the next session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .._outcome import StopReason
from .stopping import ExcInfo, StopFlag, as_exception, end_of_data_types


class Coordinator:
    """A thread-safe stop flag plus the first exception, as ``tf.train.Coordinator``.

    With ``clean_stop_exception_types=None`` an error stops cleanly when it says the data
    ran out: ``StopIteration``, ``StopAsyncIteration`` or TF's ``OutOfRangeError``, as in
    TF1. Inside a session, where an error came from decides too: an ``OutOfRangeError``
    from the session's own writes (a full disk) is an error.
    """

    def __init__(
        self, clean_stop_exception_types: tuple[type[BaseException], ...] | None = None
    ) -> None:
        if clean_stop_exception_types is not None and not (
            isinstance(clean_stop_exception_types, tuple)
            and all(
                isinstance(t, type) and issubclass(t, BaseException)
                for t in clean_stop_exception_types
            )
        ):
            raise ValueError(
                "clean_stop_exception_types must be a tuple of exception classes, not "
                f"{clean_stop_exception_types!r}"
            )
        self._clean = clean_stop_exception_types
        self._flag = StopFlag()
        # While a session runs: its stop path (which raises an error it can no longer take).
        self._route: Callable[[BaseException | None], None] | None = None

    @property
    def clean_stop_exception_types(self) -> tuple[type[BaseException], ...]:
        return self._clean if self._clean is not None else end_of_data_types()

    @property
    def reason(self) -> StopReason | str | None:
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
        """Ask everything to stop; ``exc`` (an exception or exc_info) is the cause. After
        the session that used this coordinator has ended, an error is raised here instead
        (nothing would re-raise it), until ``clear_stop``."""
        error = as_exception(exc)
        if self._route is not None:
            self._route(error)
        elif error is not None and isinstance(error, self.clean_stop_exception_types):
            self._flag.set(None, StopReason.END_OF_DATA)
        elif not self._flag.set(error, StopReason.REQUESTED) and error is not None:
            raise error

    async def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Wait until a stop is requested; ``False`` if ``timeout`` seconds passed first."""
        return await self._flag.wait(timeout)

    def clear_stop(self) -> None:
        """Forget the stop request and the error, so the coordinator can be used again
        (errors are kept again, also after a session has ended)."""
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


class SessionCoordinator(Coordinator):
    """The Supervisor's coordinator (``sv.coord``): the public one, plus the hand-over
    to each session, whose one stop path its stops go through while the session runs."""

    def open_session(self, route: Callable[[BaseException | None], None]) -> StopFlag:
        """A session begins: the stop is cleared, and stops go through ``route`` until
        ``close_session``. Returns the flag the session stops by."""
        self._flag.clear()
        self._route = route
        return self._flag

    def close_session(self) -> None:
        self._route = None
