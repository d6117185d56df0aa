"""ManagedSession: what the body of ``async with sv.session()`` works with."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import anyio

from ._checkpoints import Checkpointer, RestoreReport
from ._coordinator import Coordinator
from ._hooks import Hook, RunContext
from ._log import log
from ._services import Registration, Service, register, supervise
from ._summaries import create_events_file, write_values
from ._validate import optional_positive_int
from ._worker import Job, TrainingThread, describe

if TYPE_CHECKING:
    import tensorflow as tf
    from anyio.abc import TaskGroup

    from ._cluster import Agreement, Decision
    from ._supervisor import Supervisor


class GlobalStep:
    """The global step variable, and a Python mirror of it that costs nothing to read.

    Ours is advanced by one raw op per step: 13 us, where ``tf.Variable.assign_add``
    costs 34 us (measured here, TF 2.21). The user's is advanced by the user's
    step, and read back (18 us) only when something asks for the value: hooks,
    step-based saves, ``sess.global_step``; a bare loop of steps never pays for it.
    """

    def __init__(self, variable: Any, owned: bool) -> None:
        import tensorflow as tf
        from tensorflow.python.ops import gen_resource_variable_ops as raw

        self.variable = variable
        self.owned = owned
        # A Keras 3 variable wraps a tf.Variable in `.value`; a tf.Variable is its own.
        inner = variable if isinstance(variable, tf.Variable) else getattr(variable, "value", None)
        handle = getattr(inner, "handle", None) if isinstance(inner, tf.Variable) else None
        one = tf.constant(1, dtype=variable.dtype)
        self._read: Callable[[], int]
        self._add_one: Callable[[], object]
        if handle is not None:
            dtype = tf.as_dtype(variable.dtype)
            self._read = lambda: int(raw.read_variable_op(handle, dtype))
            self._add_one = lambda: raw.assign_add_variable_op(handle, one)
        else:  # e.g. a distributed variable: the public, slower way
            self._read = lambda: int(variable.numpy())
            self._add_one = lambda: variable.assign_add(one, read_value=False)
        self._value = 0
        self._stale = False

    @property
    def value(self) -> int:
        if self._stale:
            self.reload()
        return self._value

    def reload(self) -> int:
        self._value = self._read()
        self._stale = False
        return self._value

    def advance(self, in_graph: bool = False) -> None:
        """After a successful step (training thread): ours by one (unless the step's
        own graph did it); the user's as it is."""
        if self.owned:
            if not in_graph:
                self._add_one()
            self._value += 1
        else:
            self._stale = True

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """For a ``tf.function`` step and our own variable: one ``tf.function`` that
        runs the step and then the increment, in the same graph call.

        An eager ``assign_add`` after each step costs 60-80 us in a real training
        loop (a third of a tiny model's step overhead); inside the graph it is free.
        The increment depends on the step's outputs, so a step that fails does
        not count.
        """
        import tensorflow as tf

        if not self.owned or not isinstance(fn, tf.types.experimental.PolymorphicFunction):
            return None
        variable = self.variable

        @tf.function  # type: ignore[untyped-decorator]
        def step_and_count(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            outputs = [t for t in tf.nest.flatten(result) if tf.is_tensor(t)]
            with tf.control_dependencies(outputs):
                variable.assign_add(tf.constant(1, variable.dtype))
            return result

        return step_and_count  # type: ignore[no-any-return]


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
        self._step_fn: Any = None
        # Each step function: what to call for it, and whether that advances the step.
        self._fused: dict[Callable[..., Any], tuple[Callable[..., Any], bool]] = {}
        self._step_started: float | None = None  # time.monotonic() while a step runs
        # In a multi-worker job: the decisions every worker takes together, and how
        # this worker proposes a stop to all (set by the session's lifecycle).
        self._agreement: Agreement | None = None
        self._propose_stop: Callable[[str], None] | None = None

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
        # Keyed by equality: a bound method is a new object at every attribute access.
        prepared = self._fused.get(fn)
        if prepared is None:
            fused = self._step_var.fuse(fn)
            prepared = self._fused[fn] = (fused or fn, fused is not None)
        call, counted_in_graph = prepared
        self._step_fn, self._step_started = fn, time.monotonic()  # for the watchdogs
        try:
            result = self._call_step(call, args, kwargs)
        finally:
            self._step_started = None
        self._recoveries = 0
        self._step_var.advance(in_graph=counted_in_graph)
        self._last_result = result  # for progress displays; one assignment, no copy
        for hook in hooks:
            hook.after_run(ctx, result)  # type: ignore[arg-type]
        if self._save_steps and self._step_var.value % self._save_steps == 0:
            self._save_checkpoint()
        if self._checkpointer is not None and self._checkpointer.completed:
            self._after_background_saves()
        if self._agreement is not None and self._agreement.pending:
            self._carry_out(self._agreement.due(self._step_var.value))
        return result

    def _carry_out(self, decisions: list[Decision]) -> None:
        """After the step every worker agreed on: save, or stop (the final save follows)."""
        for decision in decisions:
            log.info(
                "cluster.agreed",
                step=decision.step,
                kind=decision.kind,
                reason=decision.reason,
                proposed_by=decision.proposer,
            )
            if decision.kind == "save":
                self._save_checkpoint()
            elif decision.kind == "stop":
                self._coord._request(None, decision.reason)

    def _timed_save(self) -> None:
        """Training thread: the checkpoint timer fired. In a multi-worker job only the
        chief's timer runs, and every worker saves after the next step."""
        if self._agreement is None:
            self._save_checkpoint()
        elif not self._coord.should_stop():
            self._agreement.propose("save", "timer", self._step_var.value)

    def _call_step(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The step itself, retried after a recoverable error."""
        while True:
            try:
                return fn(*args, **kwargs)
            except self._coord.clean_stop_exception_types as exc:
                self._coord.request_stop(exc)  # end of data: a clean stop, re-raised
                raise
            except self.supervisor.recoverable_errors as exc:
                self._recover(exc)  # raises when it cannot

    async def train(
        self, step_fn: Callable[..., Any], data: Iterable[Any], *, max_steps: int | None = None
    ) -> int:
        """The fast path: run ``step_fn`` over ``data`` on the training thread, no hop per step.

        Each element is passed as ``step_fn(*element)`` if it is a tuple, else
        ``step_fn(element)``; hooks and step counting are as for ``run``. Returns
        the number of steps run, when ``data`` is exhausted (the session goes on:
        call it again for the next epoch), when a stop is requested, or after
        ``max_steps``. A clean-stop error inside a step (``OutOfRangeError``) stops
        the session with reason ``end_of_data``.
        """
        check_max = optional_positive_int("max_steps", max_steps)
        steps: int = await self._worker.run_job(
            Job(self._train_loop, (step_fn, data, check_max), label=step_fn)
        )
        return steps

    def _train_loop(
        self, step_fn: Callable[..., Any], data: Iterable[Any], max_steps: int | None
    ) -> int:
        """On the training thread: steps back to back; between two, the stop flag is
        checked and the jobs queued meanwhile (saves, holds, calls) are run."""
        coord, worker, run_step = self._coord, self._worker, self._run_step
        iterator = iter(data)
        done = 0
        while max_steps is None or done < max_steps:
            if worker.has_pending():
                worker.run_pending()
            if coord.should_stop():
                break
            try:
                batch = next(iterator)
            except StopIteration:
                break
            try:
                run_step(step_fn, batch if isinstance(batch, tuple) else (batch,), {})
            except coord.clean_stop_exception_types:
                break  # the step asked for a clean stop (end of data) already
            done += 1
        return done

    def _recover(self, exc: BaseException) -> None:
        """After a recoverable error: restore the newest good checkpoint, so that the
        failed step's partial writes are gone, and let the step run again."""
        sv, checkpointer = self.supervisor, self.supervisor._checkpointer
        if self._agreement is not None:
            # A collective failed: a worker is gone. Retrying alone cannot help; the
            # job stops, and its restart resumes from the last checkpoint.
            log.error("cluster.step_failed", error=f"{type(exc).__name__}: {_cause_line(exc)}")
            raise exc
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
        started, fn = self._step_started, self._step_fn
        if started is None:
            return None
        return describe(fn), started

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
        """Ask for a stop, from any thread; ``exc`` is re-raised at the end unless clean.

        In a multi-worker job a stop without an error is proposed to every worker:
        all stop together after the next step (each must keep stepping until then).
        """
        if exc is None and self._propose_stop is not None:
            self._worker.submit(Job(self._propose_stop, ("requested",)))
        else:
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


def _cause_line(exc: BaseException) -> str:
    """The line of a collective's error that says what happened (TF's message is
    mostly a graph traceback): ``Collective ops is aborted by: Socket closed``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "aborted by" in line or "Connection reset" in line:
            return line[:300]
    return (lines[0] if lines else "")[:300]
