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
- how many steps ran (fewer than asked when the data ran out: the iterator's
  ``get_next_as_optional`` ends the loop at a step boundary, no batch lost).
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
        # The last element spec seen and its loop: an iterator hands back the same spec
        # object at every call, and its repr (the key above) costs a visible part of a call.
        self._last: tuple[Any, tuple[Callable[..., Any], bool]] | None = None

    def run(self, iterator: Any, n: int) -> Ran:
        import tensorflow as tf

        spec, last = iterator.element_spec, self._last
        if last is not None and last[0] is spec:
            loop, bare = last[1]
        else:
            key = repr(spec)
            if key not in self._loops:
                self._loops[key] = self._build(spec)
            loop, bare = self._loops[key]
            self._last = (spec, (loop, bare))
        count, steps, scalars = loop(iterator, tf.constant(n, tf.int32))
        return Ran(int(count), steps.numpy(), {k: v.numpy() for k, v in scalars.items()}, bare)

    def _build(self, spec: Any) -> tuple[Callable[..., Any], bool]:
        import tensorflow as tf

        step_fn, variable, owned = self.step_fn, self.step.variable, self.step.owned
        args = spec if isinstance(spec, tuple) else (spec,)
        # The step's outputs decide what is recorded: its single numbers.
        outputs = step_fn.get_concrete_function(*args).structured_outputs
        bare = not isinstance(outputs, dict)
        parts = {"loss": outputs} if bare else outputs
        names = tuple(str(k) for k, v in parts.items() if tf.is_tensor(v) and v.shape.rank == 0)

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
