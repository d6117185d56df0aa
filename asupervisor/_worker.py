"""The dedicated training thread and the hop to and from it.

Every step of a session runs on one OS thread that lives as long as the
session: TensorFlow keeps per-thread state (the default summary writer, device
and name scopes), and a stable thread keeps it stable. The event loop hands a
job over through a queue (one wake-up of the training thread) and is woken
when it is done through the loop's thread-safe callback (one wake-up of the
loop). Jobs run strictly in order, so a job queued behind a step runs at a
step boundary.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import sniffio

LoopCaller = Callable[[Callable[[], object]], None]


def loop_caller() -> LoopCaller:
    """Return a function that runs a callback on the current event loop, from any thread."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        import asyncio

        loop = asyncio.get_running_loop()

        def schedule(callback: Callable[[], object]) -> None:
            loop.call_soon_threadsafe(callback)
    elif library == "trio":
        import trio

        schedule = trio.lowlevel.current_trio_token().run_sync_soon  # type: ignore[assignment]
    else:  # pragma: no cover - anyio supports only these two
        raise RuntimeError(f"asupervisor does not support the {library!r} event loop")

    def call(callback: Callable[[], object]) -> None:
        try:
            schedule(callback)
        except RuntimeError:
            # The loop has closed (asyncio) or finished (trio's RunFinishedError):
            # nobody is left to wake.
            pass

    return call


class Job:
    """One call to run on the training thread, and its outcome."""

    __slots__ = (
        "args",
        "error",
        "fn",
        "kwargs",
        "label",
        "notify",
        "result",
        "skipped",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        label: Callable[..., Any] | None = None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs or {}
        # What to call the job in errors and logs: the user's function, not a wrapper.
        self.label = label or fn
        self.result: Any = None
        self.error: BaseException | None = None
        # Set by the waiter when it gives up: a job not yet started is skipped.
        self.skipped = False
        self.notify: Callable[[], None] | None = None

    @property
    def name(self) -> str:
        return describe(self.label)

    def execute(self) -> None:
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # handed to the waiter, never lost
            self.error = exc
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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Let the thread end after the jobs already queued."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.skipped:
                continue
            self.current = job
            job.execute()
            self.current = None

    def has_pending(self) -> bool:
        """Whether jobs are queued (asked on the training thread, between two steps)."""
        return not self._jobs.empty()

    def run_pending(self) -> None:
        """On the training thread, inside a long job: run the jobs queued meanwhile."""
        outer = self.current
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:  # the stop sentinel belongs to the main loop
                self._jobs.put(None)
                break
            if not job.skipped:
                self.current = job
                job.execute()
        self.current = outer

    def _check_not_on_thread(self) -> None:
        if threading.get_ident() == self._thread.ident:
            raise RuntimeError(
                "called from the training thread itself: it would wait for itself forever"
            )

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the training thread and return its result."""
        return await self.run_job(Job(fn, args, kwargs))

    async def run_job(self, job: Job) -> Any:
        """Run ``job`` on the training thread and return its result (or raise its error)."""
        self._check_not_on_thread()
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
        self._jobs.put(job)

    async def drain(self) -> None:
        """Return once every job queued so far has finished."""
        await self.run(_nothing)

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold the training thread between two jobs for the block's duration."""
        self._check_not_on_thread()
        held = anyio.Event()
        release = threading.Event()

        def wait_for_release() -> None:
            self._caller(held.set)
            release.wait()

        job = Job(wait_for_release)
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


def _nothing() -> None:
    return None
