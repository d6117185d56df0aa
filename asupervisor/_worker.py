"""The dedicated training thread and the hop to and from it.

Every step of a session runs on one OS thread that lives as long as the
session: TensorFlow keeps per-thread state (the default summary writer, device
and name scopes), and a stable thread keeps it stable. The event loop hands a
job over through a queue (one wake-up of the training thread) and is woken
when it is done through the loop's thread-safe callback (one wake-up of the
loop). Jobs run strictly in order, so a job queued behind a step runs at a
step boundary.

The thread knows which job it runs and since when: the grace period and the
watchdog bound *any* work on it (a step with its hooks, a save, a call), not
only the step function.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel

LoopCaller = Callable[[Callable[[], object]], None]


def loop_caller() -> LoopCaller:
    """Return a function that runs a callback on the current event loop, from any thread
    (and from a signal handler: both schedulers below are safe to call from one)."""
    native = anyio.lowlevel.current_token().native_token
    schedule: Callable[[Callable[[], object]], object]
    if hasattr(native, "call_soon_threadsafe"):  # an asyncio loop
        schedule = native.call_soon_threadsafe
    elif hasattr(native, "run_sync_soon"):  # a trio token
        schedule = native.run_sync_soon
    else:  # pragma: no cover - anyio supports only these two
        raise RuntimeError(f"asupervisor does not support the event loop {native!r}")

    def call(callback: Callable[[], object]) -> None:
        try:
            schedule(callback)
        except RuntimeError:
            # The loop has closed (asyncio) or finished (trio's RunFinishedError):
            # nobody is left to wake.
            pass

    return call


class Fenced(Exception):
    """Raised on the training thread when its session has closed: an abandoned
    step that finally returns must not run hooks, save, or ask for stops."""


class Job:
    """One call to run on the training thread, and its outcome."""

    __slots__ = (
        "args",
        "error",
        "fn",
        "kind",
        "kwargs",
        "label",
        "notify",
        "result",
        "skipped",
        "submitted_at",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        label: Callable[..., Any] | None = None,
        kind: str = "call",
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs or {}
        # What to call the job in errors and logs: the user's function, not a wrapper.
        self.label = label or fn
        self.kind = kind  # "step", "call", "save", "hold", "internal"
        self.result: Any = None
        self.error: BaseException | None = None
        # Set by the waiter when it gives up: a job not yet started is skipped.
        self.skipped = False
        self.notify: Callable[[], None] | None = None
        self.submitted_at = time.monotonic()

    @property
    def name(self) -> str:
        return describe(self.label)

    def execute(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # handed to the waiter, never lost
            self.error = exc

    def done(self) -> None:
        if self.notify is not None:
            self.notify()

    def outcome(self) -> Any:
        if self.error is not None:
            error, self.error = self.error, None  # no cycle through the traceback
            raise error
        return self.result


class TrainingThread:
    """One OS thread that runs jobs in order for the life of a session."""

    def __init__(self, caller: LoopCaller, name: str = "asupervisor-training") -> None:
        self._caller = caller
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # A daemon: a step that never returns must not keep the process alive.
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.current: Job | None = None
        self.started_at: float | None = None  # time.monotonic() when `current` began
        self.closed = False  # the session is over: jobs still queued are dropped

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Let the thread end after the job in flight; later jobs are dropped."""
        self.closed = True
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def on_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def idle(self) -> bool:
        """No job running and none queued."""
        return self.current is None and self._jobs.empty()

    def in_flight(self) -> tuple[Job, float] | None:
        """The job running now and its start (``time.monotonic()``), or ``None``."""
        job, started = self.current, self.started_at
        if job is None or started is None:
            return None
        return job, started

    def _execute(self, job: Job) -> None:
        outer = self.current, self.started_at
        self.current, self.started_at = job, time.monotonic()
        try:
            job.execute()
        finally:
            self.current, self.started_at = outer
        job.done()  # after `current` is cleared: a waiter woken sees the thread idle

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self.closed:
                if job is not None:
                    job.skipped = True
                    job.error = Fenced("the session has closed")
                    job.done()
                if job is None:
                    return
                continue
            if not job.skipped:
                self._execute(job)

    def has_pending(self) -> bool:
        """Whether jobs are queued (asked on the training thread, between two steps)."""
        return not self._jobs.empty()

    def run_pending(self) -> None:
        """On the training thread, inside a long job: run the jobs queued meanwhile."""
        while not self.closed:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:  # the stop sentinel belongs to the main loop
                self._jobs.put(None)
                break
            if not job.skipped:
                self._execute(job)

    def _check_not_on_thread(self) -> None:
        if self.on_thread():
            raise RuntimeError(
                "called from the training thread itself: it would wait for itself forever"
            )

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the training thread and return its result."""
        return await self.run_job(Job(fn, args, kwargs))

    async def run_job(self, job: Job) -> Any:
        """Run ``job`` on the training thread and return its result (or raise its error)."""
        self._check_not_on_thread()
        if self.closed:
            raise Fenced("the session has closed")
        done = anyio.Event()
        job.notify = lambda: self._caller(done.set)
        self._jobs.put(job)
        try:
            await done.wait()
        except BaseException:
            # Cancelled: a job that has not started yet need not start at all;
            # one already running finishes on its own (threads cannot be cancelled).
            job.skipped = True
            raise
        return job.outcome()

    def submit(self, job: Job) -> None:
        """Queue ``job`` without waiting for it (from the loop, or the training thread)."""
        if not self.closed:
            self._jobs.put(job)

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the training thread between two jobs for the block's duration."""
        self._check_not_on_thread()
        held = anyio.Event()
        release = threading.Event()

        def wait_for_release() -> None:
            self._caller(held.set)
            release.wait()

        job = Job(wait_for_release, kind="hold")
        self._jobs.put(job)
        try:
            await held.wait()
            yield
        finally:
            job.skipped = True
            release.set()


def describe(fn: Any) -> str:
    """A function's name for errors and logs (``Pair.step``), or its repr."""
    return getattr(fn, "__qualname__", None) or repr(fn)
