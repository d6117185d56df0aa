"""Services: coroutines that run beside training, and what happens when one fails.

A service is an object with ``name`` and ``async def run(self, sess)``, or a
coroutine function ``async def fn(sess)``. Each runs under a wrapper that applies its
failure policy, so no failure is silent and none escapes as an ExceptionGroup:

- ``"stop"``: request a stop with the error (it is re-raised when the session ends);
- ``"restart"``: log ``service.failed`` and run it again after a backoff that
  doubles up to ``max_backoff_secs``; after ``max_restarts`` restarts, stop;
- ``"log"``: log ``service.failed`` and end only that service.

Whatever a service raises, ``BaseException`` subclasses too (but for its own
cancellation), reaches the session's outcome as the object raised.

**Bounded.** Each service runs in a task of its own, in a cancel scope of its own, not
in a task group the session would have to wait for: a service that swallows its
cancellation and goes on cannot hold the session. The session cancels the services,
waits what is left of its grace period, and leaves behind (``service.abandoned``) any
that is still running; it can touch nothing of the session any more.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
import anyio.lowlevel

from .._log import log

if TYPE_CHECKING:
    from .managed import ManagedSession

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
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, not {max_restarts!r}")
    if (
        isinstance(backoff_secs, bool)
        or not isinstance(backoff_secs, (int, float))
        or not 0 <= backoff_secs < math.inf
    ):
        raise ValueError(f"backoff_secs must be a number >= 0, not {backoff_secs!r}")
    if inspect.iscoroutinefunction(service):
        service = _FunctionService(service, name or service.__name__)
    elif not (hasattr(service, "run") and inspect.iscoroutinefunction(service.run)):
        raise ValueError(
            f"service must be a coroutine function or have `async def run(self, sess)`, "
            f"not {service!r}"
        )
    elif name is not None:
        service = _FunctionService(service.run, name)
    if not isinstance(getattr(service, "name", None), str):
        raise ValueError(f"service {service!r} needs a `name` string")
    return Registration(service, on_error, int(max_restarts), float(backoff_secs))


def spawn(fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
    """Run ``fn()`` in a task nobody waits for (asyncio's tasks, trio's system tasks).
    ``fn`` must never raise: a trio system task that raises crashes the run."""
    native = anyio.lowlevel.current_token().native_token
    if hasattr(native, "run_sync_soon"):  # a trio token
        import trio

        trio.lowlevel.spawn_system_task(fn, name=name)
    else:
        import asyncio

        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(fn(), name=name)
        _running_tasks.add(task)  # asyncio keeps only weak references to its tasks
        task.add_done_callback(_running_tasks.discard)


_running_tasks: set[Any] = set()


class ServiceGroup:
    """The services of one session: started, cancelled, waited for with a bound."""

    def __init__(self, sess: ManagedSession, fail: Callable[[BaseException], None]) -> None:
        self._sess, self._fail = sess, fail
        self._scopes: dict[int, tuple[str, anyio.CancelScope]] = {}
        self._ids = 0
        self._open = False
        self._idle = anyio.Event()
        self._idle.set()

    @property
    def running(self) -> list[str]:
        return sorted(name for name, _ in self._scopes.values())

    def open(self) -> None:
        self._open = True

    def close(self) -> None:
        """No service starts any more (the session is over)."""
        self._open = False

    def start(self, reg: Registration) -> None:
        if not self._open:
            raise RuntimeError("the session has not started or has already ended")
        self._ids += 1
        key, scope = self._ids, anyio.CancelScope()
        self._scopes[key] = (reg.name, scope)
        self._idle = anyio.Event()

        async def run() -> None:
            try:
                with scope:
                    await supervise(reg, self._sess, self._fail)
            except BaseException as exc:  # never out of a task nobody waits for
                log.error("service.escaped", service=reg.name, error=repr(exc))
            finally:
                self._scopes.pop(key, None)
                if not self._scopes:
                    self._idle.set()

        spawn(run, f"service:{reg.name}")

    def cancel(self) -> None:
        for _, scope in list(self._scopes.values()):
            scope.cancel()

    async def wait(self, timeout: float | None) -> bool:
        """Wait until every service has ended; ``False`` if ``timeout`` ran out first."""
        if self._idle.is_set():
            return True  # also with no time left: nothing runs to wait for
        with anyio.move_on_after(timeout):
            await self._idle.wait()
            return True
        return False


async def supervise(
    reg: Registration, sess: ManagedSession, fail: Callable[[BaseException], None]
) -> None:
    """Run one service under its failure policy; never raises (but for cancellation)."""
    restarts, backoff = 0, reg.backoff_secs
    cancelled = anyio.get_cancelled_exc_class()
    while True:
        try:
            await reg.service.run(sess)
            return
        except cancelled:
            raise
        except BaseException as exc:  # GeneratorExit, SystemExit... reach the outcome as themselves
            if not _handle_failure(reg, exc, restarts, fail):
                return
        restarts += 1
        if await sess.sleep_until_stop(backoff):
            return
        backoff = min(backoff * 2, reg.max_backoff_secs)


def _handle_failure(
    reg: Registration, exc: BaseException, restarts: int, fail: Callable[[BaseException], None]
) -> bool:
    """Log a failure and apply the policy; ``True`` means run the service again."""
    ordinary = isinstance(exc, Exception)
    restart = ordinary and reg.on_error == "restart" and restarts < reg.max_restarts
    log.error(
        "service.failed",
        service=reg.name,
        error=f"{type(exc).__name__}: {exc}",
        policy=reg.on_error,
        restarts=restarts,
        action="restart" if restart else ("end" if reg.on_error == "log" and ordinary else "stop"),
        exc_info=exc,
    )
    if not restart and (reg.on_error != "log" or not ordinary):
        fail(exc)  # an error whatever its type: a failed service did not reach end of data
    return restart
