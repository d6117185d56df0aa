"""Steps on the training thread: hooks around them, the global step, step- and time-based saves.

Everything here runs on the session's training thread. The runtime owns the
session; this module owns what one step does and what steps have done so far
(the last result, steps run, steps since the last good save, recoveries in a row).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._log import log
from .._session.stopping import end_of_data_types
from .hooks import Hook, RunContext
from .position import epoch_data, is_epoch_function, skipped
from .release import release

if TYPE_CHECKING:
    from .._session.runtime import SessionRuntime
    from .loop import Ran, StepLoop
    from .session_summaries import SessionSummaries

# Runs steps over an iterator, at most max_steps: (steps run, whether the data ran out).
StepsRunner = Callable[[Iterator[Any], "int | None"], tuple[int, bool]]

FUSED_CACHE_SIZE = 32  # step functions kept fused; per-step partials must not pile up
STILL_CHECK_EVERY = 10  # steps between two looks at whether the global step moves
ROLLED_BACK = object()  # a call of many steps whose divergence rolled the run back


class GlobalStep:
    """The global step variable, and a Python mirror of it that costs nothing to read.

    Ours is advanced by one raw op per step (cheaper than ``tf.Variable.assign_add``),
    or inside a ``tf.function`` step's own graph. The user's is advanced by the user's
    step, and read back only when something asks for the value: hooks, step-based
    saves, ``sess.global_step``; a bare loop of steps never pays for it.
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
        self._unsynced = 0  # our steps counted in the mirror, not yet in the variable
        self.summary_step = SummaryStep(variable) if owned else None

    @property
    def value(self) -> int:
        if self._stale:
            self.reload()
        return self._value

    def reload(self) -> int:
        self._unsynced = 0  # the variable, restored or not, is what counts now
        self._value = self._read()
        self._stale = False
        return self._value

    def seen(self, value: int) -> None:
        """The variable is known to hold ``value`` (read inside a loop of steps, after
        the step it counts): the mirror follows without reading it again."""
        self._unsynced = 0
        self._value = value
        self._stale = False

    def advance(self, by: int = 1, in_graph: bool = False, deferred: bool = False) -> None:
        """After a successful step (training thread): ours by ``by`` (unless the step's
        own graph did it; ``deferred``: in the mirror now, in the variable at the next
        ``flush``); the user's as it is."""
        if self.owned:
            if deferred:
                self._unsynced += by
            elif not in_graph:
                for _ in range(by):
                    self._add_one()
            self._value += by
        else:
            self._stale = True

    def flush(self) -> None:
        """Training thread: deferred steps into our variable (before a save, after fit).
        ``fit`` defers them: an eager op per batch is a visible part of a small model's batch."""
        if self._unsynced:
            self.variable.assign_add(self._unsynced)
            self._unsynced = 0

    def for_summaries(self) -> Any:
        """The default step of ``tf.summary.*`` on the training thread: ours as a
        ``SummaryStep`` (see there); the user's is read where the summary is written
        (after the user's own increment, the step the state has reached)."""
        return self.summary_step if self.summary_step is not None else self.variable

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """For a ``tf.function`` step and our own variable: one ``tf.function`` that
        runs the step and then the increment, in the same graph call.

        An eager ``assign_add`` after each step is a dispatch of its own, a visible part
        of a tiny model's step; inside the graph it costs nothing measurable. The
        increment depends on the step's outputs, so a step that fails does not count.
        The wrapper keeps the step's ``input_signature``, so it traces no more often
        than the step itself.
        """
        import tensorflow as tf

        if not self.owned or not isinstance(fn, tf.types.experimental.PolymorphicFunction):
            return None
        variable = self.variable

        def step_and_count(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            outputs = [t for t in tf.nest.flatten(result) if tf.is_tensor(t)]
            with tf.control_dependencies(outputs):
                variable.assign_add(tf.constant(1, variable.dtype))
            return result

        signature = getattr(fn, "input_signature", None)
        fused = tf.function(
            step_and_count,
            input_signature=signature,
            reduce_retracing=bool(getattr(fn, "_reduce_retracing", False)),
        )
        return fused  # type: ignore[no-any-return]


_conversion_registered = False


class SummaryStep:
    """The step ``tf.summary.*`` writes at, for the supervisor's own step variable.

    Every value a step makes is labelled with the step number it leaves behind (N+1 for
    the step from N), as ``summary_fn``'s, Keras' and TF1's SummarySaverHook's are. Ours
    is advanced after the step, so inside a step the label is the variable + 1; between
    steps (``sess.call``) it is the variable itself; inside ``fit``, where our variable
    is written only before saves, it is the optimizer's iterations plus the difference
    the two had when ``fit`` began, + 1. Converted where a summary op reads it: in a
    ``tf.function``, when it is traced.
    """

    def __init__(self, variable: Any) -> None:
        import tensorflow as tf

        global _conversion_registered
        self.variable = variable
        self.in_step = False
        self.fit_iterations: Any = None  # the optimizer's iterations, while fit runs
        self.fit_delta = tf.Variable(0, dtype=tf.int64, trainable=False)
        if not _conversion_registered:
            tf.register_tensor_conversion_function(SummaryStep, _summary_step_tensor)
            _conversion_registered = True

    def stepping(self) -> SummaryStep:
        """``with summary_step.stepping():`` around a step (the label is the step it
        leaves behind). The step itself is the context manager: no generator per step."""
        return self

    def __enter__(self) -> None:
        self.in_step = True

    def __exit__(self, *exc: object) -> None:
        self.in_step = False

    @contextlib.contextmanager
    def fitting(self, iterations: Any, step: int) -> Iterator[None]:
        self.fit_delta.assign(step - int(iterations.numpy()))
        self.fit_iterations = iterations
        try:
            yield
        finally:
            self.fit_iterations = None

    def tensor(self) -> Any:
        import tensorflow as tf

        if self.fit_iterations is not None:
            iterations = tf.cast(tf.convert_to_tensor(self.fit_iterations), tf.int64)
            return iterations + self.fit_delta + 1
        value = tf.cast(self.variable.read_value(), tf.int64)
        return value + 1 if self.in_step else value

    def __int__(self) -> int:  # for code that reads tf.summary.experimental.get_step()
        return int(self.tensor().numpy())

    def numpy(self) -> Any:
        return self.tensor().numpy()


def _summary_step_tensor(
    value: SummaryStep, dtype: Any = None, name: str | None = None, as_ref: bool = False
) -> Any:
    import tensorflow as tf

    tensor = value.tensor()
    return tensor if dtype is None else tf.cast(tensor, dtype)


class Rewind(Exception):
    """A recoverable error restored an earlier checkpoint inside ``train(epochs=)``: the
    data must go back to the restored position too (the loop starts over from it)."""


class Stepper:
    """What a step does on the training thread, and what steps have done so far."""

    def __init__(
        self,
        runtime: SessionRuntime,
        step: GlobalStep,
        hooks: Sequence[Hook],
        summaries: SessionSummaries,
        save_steps: int | None,
        summary_steps: int | None = None,
        save_secs: float | None = None,
    ) -> None:
        self.runtime = runtime
        self.summaries = summaries
        self.summary_steps = summary_steps
        self.step = step
        self.hooks = tuple(hooks)
        self.save_steps = save_steps
        self.save_secs = save_secs
        self._timed: tuple[int, float] = (0, time.monotonic())  # for save_secs: (step, time)
        self.last_result: Any = None
        self.steps_run = 0  # steps this session ran
        self._saved_at_run = 0  # steps_run when the state of the last good save was taken
        self._last_save_step: int | None = None  # for save_steps: as CheckpointSaverHook
        self._last_summary_step: int | None = None  # for summary_steps: as SummarySaverHook
        self.recoveries = 0  # recoveries in a row, for max_recoveries
        self.first_done: tuple[int, float] | None = None  # (step, monotonic) after step 1
        # Each step function: what to call for it, and whether that advances the step.
        # Bounded: a new partial or lambda per step must not pile up.
        self._fused: collections.OrderedDict[Any, tuple[Callable[..., Any], bool]] = (
            collections.OrderedDict()
        )
        # Each step function's loop of many steps per call (steps_per_loop), bounded too.
        self._step_loops: collections.OrderedDict[Any, StepLoop] = collections.OrderedDict()
        self._still_since: tuple[int, int] | None = None  # (steps run, step value) at last look
        self._warned_still = False

    # -- what the session tells the stepper ------------------------------------------

    def begin(self, step: int) -> None:
        """The session starts (or is restored) at ``step``: the step schedules count from
        here, as TF's CheckpointSaverHook does; the first step writes summaries, as TF's
        SummarySaverHook does; nothing since is unsaved."""
        self._last_save_step, self._last_summary_step = step, None
        self._timed = (step, time.monotonic())
        self._saved_at_run = self.steps_run

    def recovered(self) -> None:
        """An earlier checkpoint was restored (a recoverable error, a rollback)."""
        self.recoveries += 1
        self._saved_at_run = self.steps_run
        self.summaries.discard()  # the failed steps' results are not the restored state's
        self.last_result = None

    def state_saved(self, at_run: int) -> None:
        """A save of the state as it was after ``at_run`` steps is on disk."""
        self._saved_at_run = max(self._saved_at_run, at_run)

    @property
    def unsaved(self) -> int:
        """Steps run since the state of the last good save was taken."""
        return self.steps_run - self._saved_at_run

    # -- one step ------------------------------------------------------------------

    def prepared(self, fn: Callable[..., Any]) -> tuple[Callable[..., Any], bool]:
        # Keyed by equality: a bound method is a new object at every attribute access.
        try:
            found = self._fused.get(fn)
        except TypeError:  # unhashable callable: never cached
            return fn, False
        if found is not None:
            self._fused.move_to_end(fn)
            return found
        fused = self.step.fuse(fn)
        found = self._fused[fn] = (fused or fn, fused is not None)
        if len(self._fused) > FUSED_CACHE_SIZE:
            self._fused.popitem(last=False)
        return found

    def run_step(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """One step with hooks around it; what it raises is classified by the runtime."""
        thread = self.runtime.thread
        thread.check_fence()
        thread.mark_step()
        # A try, not ``_classified``: a context manager's frames are a visible part of the
        # Python around a tiny model's step, which runs after the step evicted it from cache.
        try:
            ctx = self.before(args, kwargs) if self.hooks else None
            call, counted_in_graph = self.prepared(fn)
            result = self._call_step(call, args, kwargs)
            self.after(ctx, result, counted_in_graph)
            return result
        except Rewind:
            raise
        except BaseException as exc:
            self._reraise_classified(exc)
            raise

    def _reraise_classified(self, exc: BaseException) -> None:
        """Raise what the runtime classifies ``exc`` as, when that is another error
        (``job_failed``: the error it stands for); return when it is ``exc`` itself."""
        replacement = self.runtime.job_failed(exc)
        if replacement is not exc:
            raise replacement from exc

    @contextlib.contextmanager
    def _classified(self) -> Iterator[None]:
        """What a call of steps raises, as the runtime classifies it (see
        ``_reraise_classified``); a ``Rewind`` as it is."""
        try:
            yield
        except Rewind:
            raise
        except BaseException as exc:
            self._reraise_classified(exc)
            raise

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RunContext | None:
        """Before a step (or a batch of ``fit``): the hooks' ``before_run``."""
        ctx = (
            RunContext(self.step.value, args, kwargs, self.runtime.session) if self.hooks else None
        )
        for hook in self.hooks:
            hook.before_run(ctx)  # type: ignore[arg-type]
        return ctx

    def after(
        self,
        ctx: RunContext | None,
        result: Any,
        counted_in_graph: bool,
        *,
        batches: int = 1,
        running_means: bool = False,
        deferred: bool = False,
    ) -> None:
        """After a successful step of ``batches`` batches: count it, run the hooks, then
        what is due. ``running_means``: the result is already a mean (Keras' logs), not
        averaged again."""
        runtime = self.runtime
        runtime.thread.check_fence()  # an abandoned step that returns at last does no more
        runtime.thread.step_ended()
        self.recoveries = 0
        self.step.advance(batches, in_graph=counted_in_graph, deferred=deferred)
        self.steps_run += batches
        runtime.position.advance(batches)
        self.last_result = result  # for progress displays; one assignment, no copy
        if runtime.checkpoints.check_divergence(result):  # rolled back: this step is undone
            if runtime.position.counts():
                raise Rewind()  # the data goes on from where the rollback put it
            return
        if not running_means:
            self.summaries.add(result)
        if self.first_done is None:
            runtime.checkpoints.check_deferred()
            self.first_done = (self.step.value, time.monotonic())
        for hook in self.hooks:
            hook.after_run(ctx, result)  # type: ignore[arg-type]
        if not self.step.owned and self.steps_run % STILL_CHECK_EVERY < batches:
            self._check_moving()  # ours always moves: we advance it
        if self.save_steps and self._due_save():
            runtime.checkpoints.save()
        elif self.save_secs and self._due_timed_save():
            runtime.checkpoints.timed_save()
        if self.summary_steps and self._due_summary():
            self.summaries.step_summaries(result)
        runtime.after_step()

    def _due_save(self) -> bool:
        """As TF's CheckpointSaverHook: due when the step has moved ``save_steps`` past
        the last such save (or the session's start), whatever each step advances it by."""
        step, last = self.step.value, self._last_save_step
        if last is None or step >= last + self.save_steps:  # type: ignore[operator]
            self._last_save_step = step
            return last is not None
        return False

    def _due_timed_save(self) -> bool:
        """As TF's CheckpointSaverHook with ``save_secs`` (its ``SecondOrStepTimer``): due
        at the end of the first step that ends ``save_secs`` or more after the last save,
        if the step moved since. Any save counts as the last (an explicit one moves the
        next timed one on); time between steps saves nothing, as in TF, where the timer
        is asked only after a step."""
        now, secs = time.monotonic(), self.save_secs
        last_step, last_time = self._timed
        if now < last_time + secs:  # type: ignore[operator]
            return False  # the cheap look first: most steps stop here
        saved = self.runtime.session.last_save  # of any kind: (step, when written)
        if saved is not None and saved[1] is not None and saved[1] > last_time:
            self._timed = last_step, last_time = saved[0], saved[1]
            if now < last_time + secs:  # type: ignore[operator]
                return False
        step = self.step.value  # read only when due: a step variable of the user's costs
        if step == last_step:
            return False
        self._timed = (step, now)
        return True

    def _due_summary(self) -> bool:
        """As TF's SummarySaverHook: at the session's first step, then each time the step
        has moved ``summary_steps`` past the last write."""
        step, last = self.step.value, self._last_summary_step
        if last is None or step >= last + self.summary_steps:  # type: ignore[operator]
            self._last_summary_step = step
            return True
        return False

    def _check_moving(self) -> None:
        """Warn once, as TF1's step counter did, when steps run but the global step stays."""
        value, runs = self.step.reload(), self.steps_run
        if self._still_since is None or self._still_since[1] != value:
            self._still_since = (runs, value)
            return
        if not self._warned_still and runs - self._still_since[0] >= STILL_CHECK_EVERY:
            self._warned_still = True
            log.warning(
                "step.not_advancing",
                step=value,
                steps_run=runs - self._still_since[0],
                hint="the global step variable is not advanced by the step; checkpoints are "
                "numbered by it, and schedules, limits and rates read it",
            )

    def _call_step(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The step itself, retried after a recoverable error (the state restored)."""
        runtime = self.runtime
        summary_step = self.step.summary_step
        while True:
            try:
                if summary_step is None:
                    return fn(*args, **kwargs)
                with summary_step.stepping():
                    return fn(*args, **kwargs)
            except Exception as exc:
                if isinstance(exc, end_of_data_types()) or not runtime.recoverable(exc):
                    raise
                runtime.checkpoints.recover(exc)  # raises when it cannot
                if runtime.position.counts():
                    raise Rewind() from exc  # the data goes back with the state

    # -- many steps ----------------------------------------------------------------

    def train_loop(
        self,
        step_fn: Callable[..., Any],
        data: Any,
        max_steps: int | None,
        epochs: int | None = None,
        steps_per_loop: int = 1,
    ) -> int:
        """On the training thread: steps back to back; between two, the stop flag is
        checked and the jobs queued meanwhile (saves, holds, calls) are run. With
        ``epochs``, from the saved position (epoch, batch) to the end of the last epoch.
        With ``steps_per_loop`` K > 1, up to K steps run in one call (``_loop_steps``):
        the boundaries are the calls'."""
        if steps_per_loop > 1:
            run: StepsRunner = functools.partial(
                self._loop_steps, self._step_loop(step_fn), steps_per_loop
            )
        else:
            run = functools.partial(self._steps, step_fn)
        if epochs is None:
            return self._steps_over(run, data, max_steps)[0]
        runtime = self.runtime
        position, before = runtime.position, self.steps_run
        reader = position.reader
        # Each worker reads its own shard: one checkpoint cannot hold every worker's state.
        alone = "" if runtime.agreement is None else "a multi-worker job (a shard per worker)"
        same = None if is_epoch_function(data) else data
        with position.counting():
            while position.epoch < epochs:
                epoch = position.epoch

                def build(skip: int, epoch: int = epoch) -> Iterable[Any]:
                    return skipped(epoch_data(data, epoch), skip)

                left = None if max_steps is None else max_steps - (self.steps_run - before)
                iterator = reader.open(
                    epoch, position.batch, build, saveable=alone, same_data=same, counted=True
                )
                between = False  # ended at a step boundary, the epoch not over
                try:
                    exhausted = run(iterator, left)[1]
                    between = not exhausted
                except Rewind:
                    continue  # the restored position: the epoch's data again, from there
                finally:
                    del iterator  # the reader lets it go, off this thread
                    reader.close(clean=between)
                if not exhausted:
                    break  # a stop, or max_steps
                position.next_epoch()
        return self.steps_run - before

    def _steps_over(
        self, run: StepsRunner, source: Iterable[Any], max_steps: int | None
    ) -> tuple[int, bool]:
        """Steps over an iterator of ``source``: how many ran, and whether the data ran out.
        The iterator is handed to the releaser after, since its destructor may block
        (a ``tf.data`` iterator's waits for its threads): not before the final save."""
        iterator = iter(source)
        try:
            return run(iterator, max_steps)
        finally:
            release(iterator)
            del iterator, source  # none left here, even in a traceback that keeps the frame

    def _steps(
        self, step_fn: Callable[..., Any], iterator: Iterator[Any], max_steps: int | None
    ) -> tuple[int, bool]:
        runtime, run_step = self.runtime, self.run_step
        worker, flag = runtime.thread, runtime.flag
        done = 0
        while max_steps is None or done < max_steps:
            if worker.has_pending():
                worker.run_pending()
            if flag.stopped:
                return done, False
            worker.mark_step()  # fetching the batch is part of the step
            try:
                batch = next(iterator)
            except StopIteration:
                return done, True  # the epoch is over; the session goes on
            except end_of_data_types():
                return done, True
            try:
                run_step(step_fn, batch if isinstance(batch, tuple) else (batch,), {})
            except end_of_data_types():
                return done, False  # the step's own data ran out: the stop is requested
            done += 1
        return done, False

    # -- many steps in one call ------------------------------------------------------

    def _step_loop(self, step_fn: Callable[..., Any]) -> StepLoop:
        """The loop of ``step_fn``, kept (bounded) so that each ``train`` call with it
        does not trace it again."""
        from .loop import StepLoop

        try:
            loop = self._step_loops.get(step_fn)
        except TypeError:  # unhashable callable: never cached
            return StepLoop(step_fn, self.step)
        if loop is None:
            loop = self._step_loops[step_fn] = StepLoop(step_fn, self.step)
            if len(self._step_loops) > FUSED_CACHE_SIZE:
                self._step_loops.popitem(last=False)
        self._step_loops.move_to_end(step_fn)
        return loop

    def _loop_steps(
        self, loop: StepLoop, per_call: int, iterator: Any, max_steps: int | None
    ) -> tuple[int, bool]:
        """As ``_steps``, each call running up to ``per_call`` steps inside one
        ``tf.function``: between two calls, the stop flag and the queued jobs; a call
        that ran fewer than it was asked found the end of the data."""
        runtime = self.runtime
        worker, flag = runtime.thread, runtime.flag
        counted = iterator if hasattr(iterator, "took") else None
        raw = counted.raw if counted is not None else iterator
        done = 0
        while max_steps is None or done < max_steps:
            if worker.has_pending():
                worker.run_pending()
            if flag.stopped:
                return done, False
            n = per_call if max_steps is None else min(per_call, max_steps - done)
            try:
                ran = self.run_loop(loop, raw, n, counted)
            except end_of_data_types():
                return done, False  # the step's own data ran out: the stop is requested
            done += ran.count
            if ran.count < n:
                return done, True  # the epoch is over; the session goes on
        return done, False

    def run_loop(self, loop: StepLoop, iterator: Any, n: int, counted: Any) -> Ran:
        """One call of up to ``n`` steps with hooks around it (at its boundaries)."""
        runtime = self.runtime
        runtime.thread.check_fence()
        runtime.thread.mark_step(steps=n)  # the step deadline is the call's: n steps
        with self._classified():
            ctx = self.before((), {})
            ran = self._call_step(self._in_loop(loop, n, counted), (iterator,), {})
            self.after_loop(ctx, ran)
            return ran  # type: ignore[no-any-return]

    def _in_loop(self, loop: StepLoop, n: int, counted: Any) -> Callable[[Any], Ran]:
        from .loop import StepsThenError

        def call(iterator: Any) -> Ran:
            error: BaseException | None = None
            try:
                ran = loop.run(iterator, n)
            except StepsThenError as failed:
                ran, error = failed.ran, failed.error
            if counted is not None:
                counted.took(ran.count)
            if error is not None:
                # The steps before the error trained: counted (the step, the data's place,
                # the means) before the error goes on, so that what is saved next agrees.
                self._counted_at_once(ran)
                raise error
            return ran

        return call

    def after_loop(self, ctx: RunContext | None, ran: Ran) -> None:
        """After a call of ``ran.count`` steps: each step counted at its own number (its
        loss looked at, its numbers into the means and the step summaries), then the
        hooks and what is due, once, at the boundary. When nothing can happen between
        two of its steps (no loss diverged, no summary every N steps, not the session's
        first step), the call's steps are counted at once: the same counts, sums and
        window, with no Python per step."""
        runtime = self.runtime
        runtime.thread.check_fence()
        runtime.thread.step_ended()
        self.recoveries = 0
        count = ran.count
        if not count:
            return
        columns = ran.columns()
        if (
            self.first_done is not None
            and not self.summary_steps
            and runtime.checkpoints.steady(columns.get("loss"))
        ):
            result = self._counted_at_once(ran, columns)
        else:
            result = self._each_step(ran)
            if result is ROLLED_BACK:
                return
        for hook in self.hooks:
            hook.after_run(ctx, result)  # type: ignore[arg-type]
        if self.save_steps and self._due_save():
            runtime.checkpoints.save()
        elif self.save_secs and self._due_timed_save():
            runtime.checkpoints.timed_save()
        runtime.after_step()

    def _counted_at_once(self, ran: Ran, columns: dict[str, list[float]] | None = None) -> Any:
        """A call's ``ran.count`` steps counted with no Python per step: the step, the
        data's place, the means; the last one's result (``None`` if none ran)."""
        count = ran.count
        if not count:
            return None
        self.step.seen(int(ran.steps[count - 1]))
        self.steps_run += count
        self.runtime.position.advance(count)
        self.summaries.add_many(ran.columns() if columns is None else columns)
        result = self.last_result = ran.result(count - 1)
        return result

    def _each_step(self, ran: Ran) -> Any:
        """The call's steps one at a time, each at its own number; the last one's result,
        or ``ROLLED_BACK`` when a step diverged and the run was rolled back."""
        runtime = self.runtime
        result = None
        for j in range(ran.count):
            self.step.seen(int(ran.steps[j]))
            self.steps_run += 1
            runtime.position.advance(1)
            result = self.last_result = ran.result(j)
            if runtime.checkpoints.check_divergence(result):  # rolled back: this call undone
                if runtime.position.counts():
                    raise Rewind()
                return ROLLED_BACK
            self.summaries.add(result)
            if self.first_done is None:
                runtime.checkpoints.check_deferred()
                self.first_done = (self.step.value, time.monotonic())
            if self.summary_steps and self._due_summary():
                self.summaries.step_summaries(result)
        return result
