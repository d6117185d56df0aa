"""The dedicated training thread and the hop to and from it.

Every step of a session runs on one OS thread that lives as long as the
session: TensorFlow keeps per-thread state (the default summary writer, device
and name scopes), and a stable thread keeps it stable. The event loop hands a
job over through a queue (one wake-up of the training thread) and is woken
when it is done through the loop's thread-safe callback (one wake-up of the
loop). Jobs run strictly in order, so a job queued behind a step runs at a
step boundary.

The thread knows which jobs it runs (a job queued during a long one runs inside
it, at a step boundary) and when each began, and a long job marks where each of
its steps begins: the grace period bounds a job, the watchdog bounds a step.

**The fence.** Work enters the thread only here. Once the session has closed,
nothing enters (``SessionClosed``) and queued jobs are dropped with it; a job its
owner gave up on is *fenced*: its next look at the fence (``check_fence``, which
every state-changing part of the session makes) raises ``SessionClosed``, so it
runs no hook, saves nothing and asks for no stop.
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

from .._errors import SessionClosed
from .._kinds import JobKind

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


class Job:
    """One call to run on the training thread, and its outcome."""

    __slots__ = (
        "args",
        "error",
        "fenced",
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
        kind: JobKind = JobKind.CALL,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs or {}
        # What to call the job in errors and logs: the user's function, not a wrapper.
        self.label = label or fn
        self.kind = kind
        self.result: Any = None
        self.error: BaseException | None = None
        self.skipped = False  # its waiter gave up before it started: it never runs
        self.fenced = False  # its owner gave up on it while it ran: it may act no more
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

    def wake(self, notify: Callable[[], None]) -> None:
        """``notify()`` when the job is done, or dropped."""
        self.notify = notify

    def abandon(self, *, fence: bool) -> None:
        """Its waiter gave up: not started, it never runs; running, with ``fence`` it may
        act no more (its next look at the fence raises ``SessionClosed``)."""
        self.skipped = True
        self.fenced = fence

    def drop(self) -> None:
        """Never run it: its waiter learns that the session has closed."""
        self.skipped = True
        self.error = SessionClosed("the session has closed; the job was not run")
        self.done()

    def done(self) -> None:
        if self.notify is not None:
            self.notify()

    def outcome(self) -> Any:
        if self.error is not None:
            error, self.error = self.error, None  # no cycle through the traceback
            raise error
        return self.result


class Flight:
    """What runs on the training thread now: the job (the outermost), when it began,
    when its current step began (a job of several steps marks each), and whether that
    is a training step (not a validation batch, an epoch's end, a save, a call)."""

    __slots__ = ("job", "started_at", "step_started_at", "training")

    def __init__(
        self, job: Job, started_at: float, step_started_at: float, training: bool = False
    ) -> None:
        self.job, self.started_at, self.step_started_at = job, started_at, step_started_at
        self.training = training


class TrainingThread:
    """One OS thread that runs jobs in order for the life of a session."""

    def __init__(self, caller: LoopCaller, name: str = "asupervisor-training") -> None:
        self._caller = caller
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # A daemon: a step that never returns must not keep the process alive.
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        # The jobs running now, outermost first (a job queued during a long one runs
        # inside it), with when each began; and when the current step began.
        self._stack: list[tuple[Job, float]] = []
        self._step_started_at = 0.0
        self._training = False  # what the current step is: a training step, or other work
        self.steps_in_call = 1  # the training steps the current step's call runs
        self.closed = False  # the session is over: nothing more runs

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
        return not self._stack and self._jobs.empty()

    def in_flight(self) -> Flight | None:
        """The outermost job running now, or ``None``."""
        stack = list(self._stack)  # read from the loop while the thread changes it
        if not stack:
            return None
        (job, started), *inner = stack
        stepping = job.kind is JobKind.STEP
        step = self._step_started_at if stepping else started
        if inner:  # a job run at a step boundary of the outer one: it is what runs now
            step, stepping = inner[-1][1], False
        return Flight(job, started, max(step, started), stepping and self._training)

    def mark_step(self, training: bool = True, steps: int = 1) -> None:
        """On the training thread: a step of the job in flight begins now; with
        ``training=False``, work that is no training step (a validation batch, an
        epoch's end, a save), bounded by the watchdog all the same. ``steps``: how many
        training steps it runs in one call (its deadline is that many steps')."""
        self._step_started_at = time.monotonic()
        self._training = training
        self.steps_in_call = steps

    def step_ended(self) -> None:
        """On the training thread: the training step has ended; what follows until the
        next one (an epoch's end, fit's validation setting up) is no training step. The
        watchdog still times it from the step's start."""
        self._training = False

    def check_fence(self) -> None:
        """On the training thread: raise ``SessionClosed`` if the session has closed or the
        job running now (or one it runs inside) was given up on by its owner."""
        if self.closed:
            raise SessionClosed("the session has closed, or gave up on this job")
        for job, _ in self._stack:  # a loop, not any(): no generator per step
            if job.fenced:
                raise SessionClosed("the session has closed, or gave up on this job")

    def _execute(self, job: Job) -> None:
        self._training = False  # until the job marks a training step of its own
        self.steps_in_call = 1
        self._stack.append((job, time.monotonic()))
        try:
            job.execute()
        finally:
            self._stack.pop()
        job.done()  # after it is off the stack: a waiter woken sees the thread idle

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if self.closed:
                job.drop()
            elif not job.skipped:
                self._execute(job)
        self._drop_queued()

    def _drop_queued(self) -> None:
        """After the thread's last job: every job still queued learns that it never runs
        (a waiter must never wait for a thread that has ended)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.drop()

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

    def _enter(self, job: Job, notify: Callable[[], None]) -> None:
        """The one way into the thread: refused once the session has closed."""
        if self.closed:
            raise SessionClosed(
                f"the session has closed: {job.name!r} was not run (the training thread "
                "belongs to the session that made it)"
            )
        job.wake(notify)
        self._jobs.put(job)

    def run_beside(self, job: Job, timeout: float) -> bool:
        """From a thread of the session's own beside a held event loop (the loop watch):
        run ``job`` on the training thread, waiting at most ``timeout`` seconds; ``False``
        (and the job fenced) if it did not end by then or was never run."""
        done = threading.Event()
        try:
            self._enter(job, done.set)
        except SessionClosed:
            return False
        if not done.wait(timeout):
            job.abandon(fence=True)
            return False
        return not job.skipped and job.error is None

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the training thread and return its result."""
        return await self.run_job(Job(fn, args, kwargs))

    async def run_job(self, job: Job, *, fence_on_cancel: bool = False) -> Any:
        """Run ``job`` on the training thread and return its result (or raise its error).

        Cancelled: a job that has not started does not start; one already running goes
        on (threads cannot be cancelled) and, with ``fence_on_cancel``, acts no more."""
        self._check_not_on_thread()
        done = anyio.Event()
        self._enter(job, lambda: self._caller(done.set))
        try:
            await done.wait()
        except BaseException:
            job.abandon(fence=fence_on_cancel)
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

        job = Job(wait_for_release, kind=JobKind.HOLD)
        # Woken when held, and also when the job is dropped (the session closed first).
        self._enter(job, lambda: self._caller(held.set))
        try:
            await held.wait()
            if job.skipped:
                job.outcome()  # SessionClosed
            yield
        finally:
            job.abandon(fence=False)
            release.set()


def describe(fn: Any) -> str:
    """A function's name for errors and logs (``Pair.step``), or its repr."""
    return getattr(fn, "__qualname__", None) or repr(fn)
