"""Services: coroutines that run beside training, and what happens when one fails.

A service is an object with ``name`` and ``async def run(self, sess)``, or a
coroutine function ``async def fn(sess)``. Each runs in the session's task group
under a wrapper that applies its failure policy, so no failure is silent and
none escapes as an ExceptionGroup:

- ``"stop"``: request a stop with the error (it is re-raised when the session ends);
- ``"restart"``: log ``service.failed`` and run it again after a backoff that
  doubles up to ``max_backoff_secs``; after ``max_restarts`` restarts, stop;
- ``"log"``: log ``service.failed`` and end only that service.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio

from ._log import log

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from ._session import ManagedSession

POLICIES = ("stop", "restart", "log")


@runtime_checkable
class Service(Protocol):
    """What the supervisor runs beside training."""

    name: str

    async def run(self, sess: ManagedSession) -> None: ...


class _FunctionService:
    """A coroutine function seen as a Service."""

    def __init__(self, fn: Callable[[ManagedSession], Awaitable[None]], name: str) -> None:
        self.name = name
        self._fn = fn

    async def run(self, sess: ManagedSession) -> None:
        await self._fn(sess)


@dataclass(frozen=True)
class Registration:
    """A service with its failure policy."""

    service: Service
    on_error: str = "stop"
    max_restarts: int = 3
    backoff_secs: float = 1.0
    max_backoff_secs: float = 60.0

    @property
    def name(self) -> str:
        return self.service.name


def register(
    service: Any,
    *,
    on_error: str = "stop",
    max_restarts: int = 3,
    backoff_secs: float = 1.0,
    name: str | None = None,
) -> Registration:
    """Check a service and its policy, and wrap a coroutine function as a Service."""
    if on_error not in POLICIES:
        raise ValueError(f"on_error must be one of {POLICIES}, not {on_error!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative int, not {max_restarts!r}")
    if not isinstance(backoff_secs, (int, float)) or backoff_secs < 0:
        raise ValueError(f"backoff_secs must be a non-negative number, not {backoff_secs!r}")
    if inspect.iscoroutinefunction(service):
        service = _FunctionService(service, name or service.__name__)
    elif not (hasattr(service, "run") and inspect.iscoroutinefunction(service.run)):
        raise TypeError(
            f"a service is a coroutine function or has `async def run(self, sess)`; got {service!r}"
        )
    elif name is not None:
        service.name = name
    if not isinstance(getattr(service, "name", None), str):
        raise TypeError(f"service {service!r} needs a `name` string")
    return Registration(service, on_error, max_restarts, float(backoff_secs))


class ServiceGroup:
    """The services of one session: started in its task group, counted, awaited."""

    def __init__(self) -> None:
        self._tg: TaskGroup | None = None
        self._sess: ManagedSession | None = None
        self._fail: Callable[[BaseException], None] | None = None
        self.running = 0
        self._done: anyio.Event | None = None

    def attach(
        self, tg: TaskGroup, sess: ManagedSession, fail: Callable[[BaseException], None]
    ) -> None:
        self._tg, self._sess, self._fail = tg, sess, fail

    def start(self, reg: Registration) -> None:
        if self._tg is None or self._sess is None:
            raise RuntimeError("the session has not started or has already ended")
        self.running += 1
        self._tg.start_soon(self._supervise, reg, name=f"service:{reg.name}")

    def close(self) -> None:
        self._tg = None

    async def _supervise(self, reg: Registration) -> None:
        try:
            await supervise(reg, self._sess, self._fail)  # type: ignore[arg-type]
        finally:
            self.running -= 1
            if self.running == 0 and self._done is not None:
                self._done.set()

    async def wait(self) -> None:
        if self.running:
            self._done = anyio.Event()
            await self._done.wait()


async def supervise(
    reg: Registration, sess: ManagedSession, fail: Callable[[BaseException], None]
) -> None:
    """Run one service under its failure policy; never raises (but for cancellation)."""
    restarts, backoff = 0, reg.backoff_secs
    while True:
        try:
            await reg.service.run(sess)
            return
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            if not _handle_failure(reg, exc, restarts, fail):
                return
        restarts += 1
        if await sess.sleep_until_stop(backoff):
            return
        backoff = min(backoff * 2, reg.max_backoff_secs)


def _handle_failure(
    reg: Registration, exc: Exception, restarts: int, fail: Callable[[BaseException], None]
) -> bool:
    """Log a failure and apply the policy; ``True`` means run the service again."""
    restart = reg.on_error == "restart" and restarts < reg.max_restarts
    log.error(
        "service.failed",
        service=reg.name,
        error=f"{type(exc).__name__}: {exc}",
        policy=reg.on_error,
        restarts=restarts,
        action="restart" if restart else ("end" if reg.on_error == "log" else "stop"),
        exc_info=exc,
    )
    if reg.on_error != "log" and not restart:
        fail(exc)  # an error whatever its type: a failed service did not reach end of data
    return restart
