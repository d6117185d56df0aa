"""Steps on the training thread: hooks around them, the global step, step-based saves.

Everything here runs on the session's training thread. The runtime owns the
session; this module owns what one step does and what steps have done so far
(the last result, steps since the last save, recoveries in a row).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ._hooks import Hook, RunContext
from ._log import log
from ._means import ResultMeans
from ._position import epoch_data, skipped
from ._release import release
from ._stopping import is_end_of_data

if TYPE_CHECKING:
    from ._runtime import SessionRuntime

FUSED_CACHE_SIZE = 32  # step functions kept fused; per-step partials must not pile up
STILL_CHECK_EVERY = 10  # steps between two looks at whether the global step moves


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
        self._unsynced = 0  # our steps counted in the mirror, not yet in the variable

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

    def advance(self, in_graph: bool = False, deferred: bool = False) -> None:
        """After a successful step (training thread): ours by one (unless the step's
        own graph did it; ``deferred``: in the mirror now, in the variable at the next
        ``flush``); the user's as it is."""
        if self.owned:
            if deferred:
                self._unsynced += 1
            elif not in_graph:
                self._add_one()
            self._value += 1
        else:
            self._stale = True

    def flush(self) -> None:
        """Training thread: deferred steps into our variable (before a save, after fit).
        ``fit`` defers them: an eager op per batch cost 5-8% of a small model's batch."""
        if self._unsynced:
            self.variable.assign_add(self._unsynced)
            self._unsynced = 0

    def for_summaries(self) -> Any:
        """The default step of ``tf.summary.*`` inside steps. Every value a step makes is
        labelled with the step number it leaves behind (N+1 for the step from N), as
        ``summary_fn``'s, Keras' and TF1's SummarySaverHook's are. Ours is advanced
        after the step, so inside it the label is the variable + 1; the user's is read
        where the summary is written (after the user's own increment, it is N+1)."""
        return _StepAfter(self.variable) if self.owned else self.variable

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """For a ``tf.function`` step and our own variable: one ``tf.function`` that
        runs the step and then the increment, in the same graph call.

        An eager ``assign_add`` after each step costs 60-80 us in a real training
        loop (a third of a tiny model's step overhead); inside the graph it is free.
        The increment depends on the step's outputs, so a step that fails does
        not count. The wrapper keeps the step's ``input_signature``, so it traces
        no more often than the step itself.
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


class _StepAfter:
    """Converts to ``variable + 1`` where a summary op reads it (in a graph: at run time)."""

    registered = False

    def __init__(self, variable: Any) -> None:
        import tensorflow as tf

        self.variable = variable
        if not _StepAfter.registered:
            tf.register_tensor_conversion_function(_StepAfter, _step_after_tensor)
            _StepAfter.registered = True

    def __int__(self) -> int:  # for code that reads tf.summary.experimental.get_step()
        return int(self.variable.numpy()) + 1

    def numpy(self) -> Any:
        return self.variable.numpy() + 1


def _step_after_tensor(
    value: _StepAfter, dtype: Any = None, name: str | None = None, as_ref: bool = False
) -> Any:
    import tensorflow as tf

    tensor = value.variable.read_value() + 1
    return tensor if dtype is None else tf.cast(tensor, dtype)


class Stepper:
    """What a step does on the training thread, and what steps have done so far."""

    def __init__(
        self,
        runtime: SessionRuntime,
        step: GlobalStep,
        hooks: Sequence[Hook],
        save_steps: int | None,
        summary_steps: int | None = None,
        averaging: bool = False,
    ) -> None:
        self.runtime = runtime
        self.averaging = averaging  # keep results for their means (summaries from results)
        self.means = ResultMeans()
        self.summary_steps = summary_steps
        self.last_summary_step: int | None = None
        self.step = step
        self.hooks = tuple(hooks)
        self.save_steps = save_steps
        self.last_result: Any = None
        self.steps_since_save = 0  # steps run since the last save (whatever the step says)
        self.last_save_step: int | None = None  # for save_steps: as CheckpointSaverHook
        self.recoveries = 0  # recoveries in a row, for max_recoveries
        # Each step function: what to call for it, and whether that advances the step.
        # Bounded: a new partial or lambda per step must not pile up.
        self._fused: collections.OrderedDict[Any, tuple[Callable[..., Any], bool]] = (
            collections.OrderedDict()
        )
        self._still_since: tuple[int, int] | None = None  # (steps run, step value) at last look
        self._steps_run = 0
        self._warned_still = False

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
        """One step with hooks around it; end of data and failures go to the runtime."""
        runtime = self.runtime
        runtime.check_open()
        try:
            return self._step(fn, args, kwargs)
        except BaseException as exc:
            replacement = runtime.step_failed(exc)
            if replacement is exc:
                raise
            raise replacement from exc

    def _step(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ctx = self.before(args, kwargs)
        call, counted_in_graph = self.prepared(fn)
        result = self._call_step(call, args, kwargs)
        self.after(ctx, result, counted_in_graph)
        return result

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
        running_means: bool = False,
        deferred: bool = False,
    ) -> None:
        """After a successful step: count it, run the hooks, then what is due.
        ``running_means``: the result is already a mean (Keras' logs), not averaged again."""
        runtime = self.runtime
        runtime.check_open()  # an abandoned step that returns at last does nothing more
        self.recoveries = 0
        self.step.advance(in_graph=counted_in_graph, deferred=deferred)
        self.steps_since_save += 1
        self._steps_run += 1
        if runtime.position.counting:
            runtime.position.batch += 1
        self.last_result = result  # for progress displays; one assignment, no copy
        if self.averaging and not running_means:
            self.means.add(result)
        if self._steps_run == 1:
            runtime.check_deferred()
            runtime.rate_mark = runtime.rate_origin = (self.step.value, time.monotonic())
        for hook in self.hooks:
            hook.after_run(ctx, result)  # type: ignore[arg-type]
        if not self.step.owned and self._steps_run % STILL_CHECK_EVERY == 0:
            self._check_moving()  # ours always moves: we advance it
        if self.save_steps and self._due(self.save_steps, "last_save_step"):
            runtime.save()
        if self.summary_steps and self._due(self.summary_steps, "last_summary_step"):
            runtime.step_summaries()
        runtime.after_step()

    def _due(self, every: int, last: str) -> bool:
        """As TF's ``SecondOrStepTimer``: due when the step has moved ``every`` past the
        last time (or the session's start), whatever each step advances it by."""
        step, previous = self.step.value, getattr(self, last)
        if previous is None:  # set at the session's start; a fallback only
            setattr(self, last, step)
            return False
        if step >= previous + every:
            setattr(self, last, step)
            return True
        return False

    def _check_moving(self) -> None:
        """Warn once, as TF1's step counter did, when steps run but the global step stays."""
        value, runs = self.step.reload(), self._steps_run
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
        """The step itself, retried after a recoverable error."""
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if is_end_of_data(exc) or not self.runtime.recoverable(exc):
                    raise
                self.runtime.recover(exc)  # raises when it cannot

    def train_loop(
        self,
        step_fn: Callable[..., Any],
        data: Any,
        max_steps: int | None,
        epochs: int | None = None,
    ) -> int:
        """On the training thread: steps back to back; between two, the stop flag is
        checked and the jobs queued meanwhile (saves, holds, calls) are run. With
        ``epochs``, from the saved position (epoch, batch) to the end of the last epoch."""
        if epochs is None:
            return self._steps_over(step_fn, data, max_steps)[0]
        position, done = self.runtime.position, 0
        position.counting = True
        try:
            while position.epoch < epochs:
                source = skipped(epoch_data(data, position.epoch), position.batch)
                left = None if max_steps is None else max_steps - done
                ran, exhausted = self._steps_over(step_fn, source, left)
                del source  # may be the iterator itself: _steps_over hands it on
                done += ran
                if not exhausted:
                    break  # a stop, or max_steps
                position.next_epoch()
        finally:
            position.counting = False
        return done

    def _steps_over(
        self, step_fn: Callable[..., Any], source: Iterable[Any], max_steps: int | None
    ) -> tuple[int, bool]:
        """Steps over an iterator of ``source``: how many ran, and whether the data ran out.
        The iterator is handed to the releaser after, since its destructor may block
        (a ``tf.data`` iterator's waits for its threads): not before the final save."""
        iterator = iter(source)
        try:
            return self._steps(step_fn, iterator, max_steps)
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
            try:
                batch = next(iterator)
            except StopIteration:
                return done, True  # the epoch is over; the session goes on
            except Exception as exc:
                if is_end_of_data(exc):
                    return done, True
                runtime.step_failed(exc)
                raise
            try:
                run_step(step_fn, batch if isinstance(batch, tuple) else (batch,), {})
            except Exception as exc:
                if is_end_of_data(exc):
                    return done, False  # the step's own data ran out: the stop is requested
                raise
            done += 1
        return done, False
