"""Many steps in one call: ``train(steps_per_loop=K)``'s ``tf.function`` over the data.

On a small model most of a step is Python: the call into TensorFlow, the hooks, the
bookkeeping. Up to K steps run inside one ``tf.function`` (a ``tf.while_loop``
over the ``tf.data`` iterator, as Keras' ``steps_per_execution`` and Orbit's
``steps_per_loop`` do), and the supervisor's promises are kept at the boundary of
each call. What the call hands back is enough to keep the per-step ones exactly:

- the global step after each step (the supervisor's own variable is advanced inside
  the loop, after the step's outputs, so ``tf.summary.*`` in the step writes each step
  at its own number);
- each step's scalar results (``loss`` and the dict's other single numbers), so the
  first non-finite loss is found by its step, and each step's values reach the means
  and the step summaries;
- how many steps ran (fewer than asked when the data ran out: the call ends at a step
  boundary, no batch lost).

Two loops, one per kind of iterator. Over a ``tf.data`` iterator of this process, the
loop takes each batch with ``get_next`` and the data's end ends the call by its error:
each step's numbers go into variables as the step ends (so the steps before the end are
known), and a second count says whether the end came from the data (the next batch was
never fetched) or from inside a step (its own error, raised as it is). Over a
distributed iterator the workers must agree on the data's end, which its
``get_next_as_optional`` does: a ``tf.cond`` per step, about a tenth of a tiny model's
step, paid only there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .steps import GlobalStep


@dataclass(frozen=True)
class Ran:
    """What one call did: ``count`` steps; ``steps[j]`` the global step after step j;
    ``scalars[name][j]`` step j's numbers; ``bare``: the step returns one number."""

    count: int
    steps: Any
    scalars: dict[str, Any]
    bare: bool

    def columns(self) -> dict[str, list[float]]:
        """Each name's numbers in step order, as Python floats (what ``float`` of each
        step's result would give)."""
        return {name: values[: self.count].tolist() for name, values in self.scalars.items()}

    def result(self, j: int) -> Any:
        """Step j's result as ``sess.last_result`` holds it: its numbers."""
        if self.bare:
            return self.scalars["loss"][j]
        return {name: values[j] for name, values in self.scalars.items()}


@dataclass(frozen=True)
class _Fast:
    """The loop over a ``tf.data`` iterator of this process, and where it records: each
    step's numbers (variables of ``capacity`` places), the global step after each step
    (a variable too, for a step variable of the user's; ours moves by one a step), the
    steps done, and the batches fetched (one ahead of the steps done while a step runs)."""

    fn: Callable[..., Any]
    bare: bool
    names: tuple[str, ...]
    capacity: int
    values: list[Any]
    steps: Any  # None for ours
    done: Any
    fetched: Any
    variable: Any  # the global step

    def ran(self, outputs: Any) -> Ran:
        """What a call that ran to its end did: its outputs, the records as it left them."""
        import numpy as np

        count, steps, values = outputs
        count = int(count)
        scalars = {k: v.numpy()[:count] for k, v in zip(self.names, values, strict=True)}
        if self.steps is None:  # ours: ``steps`` is where the call left it, one a step
            last = int(steps)
            return Ran(count, np.arange(last - count + 1, last + 1), scalars, self.bare)
        return Ran(count, steps.numpy()[:count], scalars, self.bare)

    def ended(self, raised: BaseException) -> Ran:
        """What a call that ``raised`` did, read from the records: the steps before it.
        The loop's data ran out (the next batch was never fetched): the call ended there.
        Anything else (a step's error, its own data's end) is ``StepsThenError``."""
        import tensorflow as tf

        count = int(self.done.numpy())
        steps = self.steps if self.steps is not None else tf.convert_to_tensor(self.variable)
        ran = self.ran((count, steps, self.values))
        if isinstance(raised, tf.errors.OutOfRangeError) and int(self.fetched.numpy()) == count:
            return ran
        raise StepsThenError(ran, raised)


class StepsThenError(Exception):
    """A call of many steps that ran ``ran``'s steps and then failed with ``error``: the
    steps before the error trained, and are counted before the error goes on as it is."""

    def __init__(self, ran: Ran, error: BaseException) -> None:
        super().__init__(ran, error)
        self.ran, self.error = ran, error


class StepLoop:
    """One ``tf.function`` running up to ``n`` steps of ``step_fn`` over an iterator."""

    def __init__(self, step_fn: Callable[..., Any], step: GlobalStep) -> None:
        import tensorflow as tf

        self.step_fn: Any = (
            step_fn
            if isinstance(step_fn, tf.types.experimental.PolymorphicFunction)
            else tf.function(step_fn)
        )
        self.step = step
        self._loops: dict[str, tuple[Callable[..., Any], bool]] = {}
        self._fast: dict[str, _Fast] = {}
        # The last element spec seen and its loop: an iterator hands back the same spec
        # object at every call, and its repr (the key above) costs a visible part of a call.
        self._last: tuple[Any, Any] | None = None

    def run(self, iterator: Any, n: int) -> Ran:
        import tensorflow as tf

        spec, last = iterator.element_spec, self._last
        if last is not None and last[0] is spec and _fits(last[1], n):
            built = last[1]
        else:
            built = self._built(iterator, spec, n)
            self._last = (spec, built)
        if isinstance(built, _Fast):
            try:
                outputs = built.fn(iterator, tf.constant(n, tf.int32))
            except tf.errors.OpError as exc:  # the graph's: the records say how far it got
                return built.ended(exc)
            return built.ran(outputs)
        loop, bare = built
        count, steps, scalars = loop(iterator, tf.constant(n, tf.int32))
        return Ran(int(count), steps.numpy(), {k: v.numpy() for k, v in scalars.items()}, bare)

    def _built(self, iterator: Any, spec: Any, n: int) -> Any:
        import tensorflow as tf

        key = repr(spec)
        if isinstance(iterator, tf.distribute.DistributedIterator) or not isinstance(
            iterator, tf.data.Iterator
        ):
            if key not in self._loops:
                self._loops[key] = self._build(spec)
            return self._loops[key]
        fast = self._fast.get(key)
        if fast is None or not _fits(fast, n):
            fast = self._fast[key] = self._build_fast(spec, n)
        return fast

    def _signature(self, spec: Any) -> tuple[bool, tuple[str, ...]]:
        """Whether the step returns one number, and the names of its single numbers."""
        import tensorflow as tf

        args = spec if isinstance(spec, tuple) else (spec,)
        # The step's outputs decide what is recorded: its single numbers.
        outputs = self.step_fn.get_concrete_function(*args).structured_outputs
        bare = not isinstance(outputs, dict)
        parts = {"loss": outputs} if bare else outputs
        names = tuple(str(k) for k, v in parts.items() if tf.is_tensor(v) and v.shape.rank == 0)
        return bare, names

    def _build_fast(self, spec: Any, capacity: int) -> _Fast:
        import tensorflow as tf

        step_fn, variable, owned = self.step_fn, self.step.variable, self.step.owned
        bare, names = self._signature(spec)
        # Made here, on the training thread, outside any strategy's scope: the loop's own
        # records, in no checkpoint.
        values = [tf.Variable(tf.zeros([capacity], tf.float32), trainable=False) for _ in names]
        # The global step after each step: ours is where the call left it, less one a
        # step after it; the user's may move by anything, and is recorded.
        steps = None if owned else tf.Variable(tf.zeros([capacity], tf.int64), trainable=False)
        done = tf.Variable(0, dtype=tf.int32, trainable=False)
        fetched = tf.Variable(0, dtype=tf.int32, trainable=False)

        def loop(iterator: Any, n: Any) -> Any:
            def more(i: Any) -> Any:
                return i < n

            def one(i: Any) -> Any:
                # Each record waits for what it records, and the step for the record of
                # its batch: ops of one iteration that do not depend on each other run in
                # any order, and one may still run, or not yet, when another fails.
                batch = iterator.get_next()
                with tf.control_dependencies(tf.nest.flatten(batch)):
                    took = fetched.assign(i + 1)
                # A control input of the step's call: its ops wait for it even where they
                # do not use the batch (the call is inlined: data inputs gate only users).
                with tf.control_dependencies([took]):
                    result = step_fn(*batch) if isinstance(batch, tuple) else step_fn(batch)
                values_of = {"loss": result} if bare else result
                outputs = [t for t in tf.nest.flatten(result) if tf.is_tensor(t)]
                with tf.control_dependencies([*outputs, took]):  # a step that fails: not counted
                    written = [
                        v[i].assign(tf.cast(values_of[k], tf.float32))
                        for k, v in zip(names, values, strict=True)
                    ]
                    if steps is None:  # ours
                        written.append(variable.assign_add(tf.constant(1, variable.dtype)))
                    else:
                        written.append(
                            steps[i].assign(tf.cast(tf.convert_to_tensor(variable), tf.int64))
                        )
                with tf.control_dependencies(written):
                    return done.assign(i + 1, read_value=True)

            # The records start over before the first step (one that fails reads them).
            with tf.control_dependencies([done.assign(0), fetched.assign(0)]):
                start = tf.identity(tf.constant(0))
            (count,) = tf.while_loop(more, one, (start,))
            after = tf.convert_to_tensor(variable) if steps is None else steps.read_value()
            return count, after, [v.read_value() for v in values]

        return _Fast(
            tf.function(loop, autograph=False), bare, names, capacity, values, steps, done,
            fetched, variable,
        )  # fmt: skip

    def _build(self, spec: Any) -> tuple[Callable[..., Any], bool]:
        import tensorflow as tf

        step_fn, variable, owned = self.step_fn, self.step.variable, self.step.owned
        bare, names = self._signature(spec)

        def loop(iterator: Any, n: Any) -> Any:
            def more(i: Any, going: Any, steps: Any, arrays: list[Any]) -> Any:
                return tf.logical_and(going, i < n)

            def one(i: Any, going: Any, steps: Any, arrays: list[Any]) -> Any:
                optional = iterator.get_next_as_optional()

                def step() -> Any:
                    batch = optional.get_value()
                    result = step_fn(*batch) if isinstance(batch, tuple) else step_fn(batch)
                    values = {"loss": result} if bare else result
                    done = [t for t in tf.nest.flatten(result) if tf.is_tensor(t)]
                    with tf.control_dependencies(done):  # a step that fails does not count
                        if owned:
                            variable.assign_add(tf.constant(1, variable.dtype))
                        now = tf.cast(tf.convert_to_tensor(variable), tf.int64)
                    written = [
                        a.write(i, tf.cast(values[k], tf.float32))
                        for k, a in zip(names, arrays, strict=True)
                    ]
                    return i + 1, tf.constant(True), steps.write(i, now), written

                def end() -> Any:  # the data ran out: the call ends at this boundary
                    return i, tf.constant(False), steps, arrays

                return tf.cond(optional.has_value(), step, end)

            arrays = [tf.TensorArray(tf.float32, size=0, dynamic_size=True) for _ in names]
            steps = tf.TensorArray(tf.int64, size=0, dynamic_size=True)
            count, _, steps, arrays = tf.while_loop(
                more, one, (tf.constant(0), tf.constant(True), steps, arrays)
            )
            stacked = {k: a.stack() for k, a in zip(names, arrays, strict=True)}
            return count, steps.stack(), stacked

        return tf.function(loop, autograph=False), bare


def _fits(built: Any, n: int) -> bool:
    return not isinstance(built, _Fast) or built.capacity >= n
