"""ManagedSession: what the body of ``async with sv.session()`` works with."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import anyio

from ._checkpoints import Checkpointer, RestoreReport
from ._coordinator import Coordinator
from ._hooks import Hook, RunContext
from ._log import log
from ._services import Registration, Service, register, supervise
from ._summaries import create_events_file, write_values
from ._worker import Job, TrainingThread

if TYPE_CHECKING:
    import tensorflow as tf
    from anyio.abc import TaskGroup

    from ._supervisor import Supervisor


class GlobalStep:
    """The global step variable, mirrored in a Python int so reading it costs nothing."""

    def __init__(self, variable: Any, owned: bool) -> None:
        import tensorflow as tf

        self.variable = variable
        self.owned = owned
        # assign_add of a ready-made constant without reading back: 31 us, not 82 us.
        self._one = tf.constant(1, dtype=variable.dtype)
        self.value = 0

    def reload(self) -> int:
        self.value = int(self.variable.numpy())
        return self.value

    def advance(self) -> None:
        """After a successful step (training thread): ours by one; the user's as it is."""
        if self.owned:
            self.variable.assign_add(self._one, read_value=False)
            self.value += 1
        else:
            self.reload()


class ManagedSession:
    """A running supervised session. Create it with ``Supervisor.session()``."""

    def __init__(
        self,
        supervisor: Supervisor,
        worker: TrainingThread,
        step: GlobalStep,
        checkpointer: Checkpointer | None,
        writer: tf.summary.SummaryWriter | None,
        make_loop: Callable[..., Service],
    ) -> None:
        self.supervisor = supervisor
        self._worker = worker
        self._coord: Coordinator = supervisor.coord
        self._step_var = step
        self._hooks: Sequence[Hook] = supervisor.hooks
        self._checkpointer = checkpointer
        self._save_steps = supervisor.save_model_steps if checkpointer else None
        self._writer = writer
        self._make_loop = make_loop
        self._task_group: TaskGroup | None = None
        self._running_services = 0
        self._services_done: anyio.Event | None = None
        self.restore_report = RestoreReport("fresh", None, 0)
        self._last_result: Any = None
        self._recoveries = 0  # recoveries in a row, for max_recoveries
        self._events_path: str | None = None  # the events file the supervisor made

    # -- steps --------------------------------------------------------------

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """One training step on the training thread, with hooks around it."""
        return await self._worker.run_job(Job(self._run_step, (fn, args, kwargs), label=fn))

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the training thread, at a step boundary, counting no step."""
        return await self._worker.run(fn, *args, **kwargs)

    def _run_step(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        hooks = self._hooks
        ctx = RunContext(self._step_var.value, args, kwargs, self) if hooks else None
        for hook in hooks:
            hook.before_run(ctx)  # type: ignore[arg-type]
        while True:
            try:
                result = fn(*args, **kwargs)
                break
            except self._coord.clean_stop_exception_types as exc:
                self._coord.request_stop(exc)  # end of data: a clean stop, re-raised
                raise
            except self.supervisor.recoverable_errors as exc:
                self._recover(exc)  # raises when it cannot
        self._recoveries = 0
        self._step_var.advance()
        self._last_result = result  # for progress displays; one assignment, no copy
        for hook in hooks:
            hook.after_run(ctx, result)  # type: ignore[arg-type]
        if self._save_steps and self._step_var.value % self._save_steps == 0:
            self._save_checkpoint()
        if self._checkpointer is not None and self._checkpointer.completed:
            self._after_background_saves()
        return result

    def _recover(self, exc: BaseException) -> None:
        """After a recoverable error: restore the newest good checkpoint, so that the
        failed step's partial writes are gone, and let the step run again."""
        sv, checkpointer = self.supervisor, self.supervisor._checkpointer
        self._recoveries += 1
        if checkpointer is None or self._recoveries > sv.max_recoveries:
            raise exc
        checkpointer.wait_for_write()
        path, _ = checkpointer.restore_newest()
        if path is None:
            raise exc
        self._step_var.reload()
        log.warning(
            "step.recovered",
            error=f"{type(exc).__name__}: {exc}",
            restored_step=self._step_var.value,
            path=path,
            attempt=self._recoveries,
            max_recoveries=sv.max_recoveries,
        )

    def _save_checkpoint(self) -> str | None:
        """Save at the current step (training thread); hooks' after_save may ask to stop.

        With ``async_checkpoint`` the files are written in the background and the
        hooks run at the first step boundary after they are on disk.
        """
        if self._checkpointer is None:
            return None
        step = self._step_var.value
        path = self._checkpointer.save(step)
        if path is not None:
            self._call_after_save(step, path)
        return path

    def _after_background_saves(self) -> None:
        completed = self._checkpointer.completed  # type: ignore[union-attr]
        while completed:
            self._call_after_save(*completed.popleft())

    def _call_after_save(self, step: int, path: str) -> None:
        for hook in self._hooks:
            if hook.after_save(self, step, path):
                self._request_stop("requested")

    def _step_running_since(self) -> tuple[str, float] | None:
        """The step running now, as (name, monotonic start time), or ``None``."""
        job = self._worker.current
        if job is None or job.fn != self._run_step or job.started_at is None:
            return None
        return job.name, job.started_at

    @property
    def global_step(self) -> int:
        """The last known global step."""
        return self._step_var.value

    def between_steps(self) -> AbstractAsyncContextManager[None]:
        """``async with``: the training thread is held at a step boundary meanwhile.

        Inside the block, run TensorFlow work with ``anyio.to_thread.run_sync``,
        not ``sess.call`` (the training thread is the one being held).
        """
        return self._worker.hold()

    # -- stopping -----------------------------------------------------------

    def should_stop(self) -> bool:
        return self._coord.should_stop()

    def request_stop(self, exc: BaseException | None = None) -> None:
        """Ask for a stop, from any thread; ``exc`` is re-raised at the end unless clean."""
        self._coord.request_stop(exc)

    def _request_stop(self, reason: str) -> None:
        self._coord._request(None, reason)

    async def sleep_until_stop(self, seconds: float) -> bool:
        """Sleep; ``True`` as soon as a stop is requested, ``False`` when the time is up."""
        return await self._coord.wait_for_stop(seconds)

    @property
    def stop_reason(self) -> str | None:
        return self._coord.reason

    # -- summaries ----------------------------------------------------------

    def summary_computed(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Write ``values`` into this run's events file at ``step`` (default: the global step)."""
        if self._writer is None:
            log.warning("summary.disabled", tags=sorted(values))
            return
        write_values(self._writer, values, self.global_step if step is None else step)

    def _events_file_lost(self) -> bool:
        """Whether the events file this session writes was deleted under it."""
        return self._events_path is not None and not os.path.exists(self._events_path)

    def _renew_events_file(self) -> None:
        """On the training thread: a new events file in place of a deleted one.

        TF would go on writing into the deleted file's inode, and every summary
        would be lost without a word.
        """
        lost = self._events_path
        if self._writer is not None:
            self._writer.close()
        self._writer, self._events_path = create_events_file(self.supervisor.logdir)  # type: ignore[arg-type]
        self.supervisor._writer = self._writer
        self._writer.set_as_default(step=self.supervisor.global_step)
        log.warning("summary.file_lost", path=lost, new_path=self._events_path)

    # -- services -----------------------------------------------------------

    def loop(
        self, interval_secs: float, target: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        """Call ``target(*args, **kwargs)`` now, then every ``interval_secs``, until stop."""
        self.start_service(self._make_loop(interval_secs, target, args, kwargs))

    def start_service(self, service: Any, *, on_error: str = "stop", max_restarts: int = 3) -> None:
        """Start a service now, for this session only."""
        self._start(register(service, on_error=on_error, max_restarts=max_restarts))

    def _start(self, reg: Registration) -> None:
        if self._task_group is None:
            raise RuntimeError("the session has not started or has already ended")
        self._running_services += 1
        self._task_group.start_soon(self._supervise, reg, name=f"service:{reg.name}")

    async def _supervise(self, reg: Registration) -> None:
        try:
            await supervise(reg, self)
        finally:
            self._running_services -= 1
            if self._running_services == 0 and self._services_done is not None:
                self._services_done.set()

    async def _wait_services(self) -> None:
        if self._running_services:
            self._services_done = anyio.Event()
            await self._services_done.wait()
