"""Keras ``model.fit`` under supervision: one ``fit`` call for the whole run.

Keras resets its callbacks (EarlyStopping, ReduceLROnPlateau...) in ``on_train_begin``,
once per ``fit`` call, and honours ``stop_training`` only inside the call; so a session
makes exactly one call, from the saved position to the last epoch:

- **The data.** Keras iterates an ``EpochStream`` once per epoch; the stream gives the
  epoch the position names: ``data`` or ``data(epoch)``, from the batch a resumed epoch
  is at, through the session's reader (which restores the saved iterator state, or
  skips). Keras asks for each epoch's iterator twice (at the end of the epoch before, and
  at its start): the reader gives the same one, so each epoch's data is read once, as
  in a resumed run. The resumed epoch ends where the data would have: the stream holds
  only its remaining batches, and fit is told to end that epoch after the last of them
  (``stop_training``, taken back before the epoch's end is seen by callbacks); its
  metrics' running state goes back at its start (``RunningMeans``).
- **The steps.** A callback first in the list runs the hooks' ``before_run`` and marks
  each batch for the watchdog; one last counts the batch (hooks, the global step, the
  position, step schedules) and runs the jobs queued meanwhile (saves, calls, holds).
- **A stop** ends fit at the next batch boundary, of training or of validation: the cut
  epoch's validation and ``on_epoch_end`` do not run (they run once, when a resumed
  run ends that epoch); ``on_train_end`` does. A stop during validation leaves the
  epoch trained and its end due: the resumed run evaluates and ends it first.
- **Keras' own stop** (EarlyStopping) ends fit as it does in Keras, and stays: the
  checkpoint says so, and a resumed ``sess.fit`` has nothing left to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._log import log
from .kept_state import key_of
from .position import epoch_data, is_epoch_function, skipped
from .reader import STREAM
from .steps import Rewind

if TYPE_CHECKING:
    from .._session.runtime import SessionRuntime

UNKNOWN = -2  # tf.data's cardinality when the data cannot say how long it is
INFINITE = -1


class FitStopped(Exception):
    """The session stopped fit at a batch boundary (private: caught by ``fit`` below)."""


def check_data(data: Any, steps_per_epoch: int | None) -> None:
    """``fit`` resumes inside an epoch only over data it can skip into: a ``tf.data``
    dataset, or a function of the epoch that returns one."""
    if is_epoch_function(data):
        return
    if not hasattr(data, "element_spec"):
        raise ValueError(
            "data must be a tf.data.Dataset of batches (or a function epoch -> Dataset), so "
            "that a resumed run can go on at the batch it stopped at; for arrays use "
            "tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)"
        )
    length = int(data.cardinality())
    if steps_per_epoch is not None and length != INFINITE:
        if length == UNKNOWN or length % steps_per_epoch:
            raise ValueError(
                f"steps_per_epoch={steps_per_epoch} over one dataset of "
                f"{'unknown length' if length == UNKNOWN else f'{length} batches'}: Keras "
                "reads one stream across epochs and cuts an epoch short where the stream "
                "runs out, which a resumed run could not repeat. Repeat the dataset "
                "(dataset.repeat()), make steps_per_epoch divide its length, or pass a "
                "function of the epoch"
            )


class Plan:
    """What one ``fit`` call will do: the epoch lengths, where it starts, what is due."""

    def __init__(
        self, runtime: SessionRuntime, data: Any, epochs: int, steps_per_epoch: int | None
    ) -> None:
        position = runtime.position
        self.epochs = epochs
        self.per_function = is_epoch_function(data)
        self.steps_per_epoch = steps_per_epoch
        self.keras_steps = None if self.per_function else steps_per_epoch  # fit's own
        first = epoch_data(data, position.epoch)
        self.element_spec = first.element_spec
        self.length = steps_per_epoch or self._length(first, position)  # None: unknown
        # The epoch was trained, but a stop interrupted its validation or its end.
        self.end_due = self.length is not None and position.batch >= self.length > 0

    @staticmethod
    def _length(first: Any, position: Any) -> int | None:
        length = int(first.cardinality())
        if length >= 0:
            return length
        if position.epoch_batches:
            return int(position.epoch_batches)  # seen in an earlier session
        if position.batch == 0:
            return None  # Keras learns it from the first epoch, as in plain fit
        # Inside the first epoch the data can say nothing: a resumed epoch must end after
        # its last batch, and Keras would take the short epoch for every epoch's length.
        log.info("fit.counting_batches", epoch=position.epoch, reason="unknown length")
        return int(first.reduce(0, lambda count, _: count + 1))


def epoch_data_adapter(
    runtime: SessionRuntime, model: Any, data: Any, plan: Plan, weights: Any, run: FitRun
) -> Any:
    """What ``fit`` reads: a Keras data adapter (``fit`` takes one as its ``x``) whose
    stream is each epoch's data, as the position names it, read by the session's reader."""
    import tensorflow as tf
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    made: dict[int, Any] = {}  # the last epoch's data: fit may ask for it more than once
    reader = runtime.position.reader
    # A dataset given once, as fit reads it from an epoch's start (class weights mapped):
    # made once, as the reader fingerprints each dataset object once; a new ``map`` every
    # epoch would be fingerprinted every epoch. (An epoch function's data is new anyway.)
    whole: list[Any] = []

    def of_epoch(epoch: int) -> Any:
        if epoch not in made:
            made.clear()
            made[epoch] = epoch_data(data, epoch)
        return made[epoch]

    def fitted(source: Any) -> Any:
        """As fit itself does (the default strategy gives the dataset back as it is)."""
        if weights is not None:
            source = source.map(weights)
        return model.distribute_strategy.experimental_distribute_dataset(source)

    class EpochStream(tf.distribute.DistributedDataset):  # type: ignore[misc]
        """Iterated once per epoch (with ``steps_per_epoch`` over one dataset, once for
        the run; a distributed dataset is taken by fit as it is): each time, the stream
        is the epoch the position names, from the batch it names. Keras asks for the
        next epoch's iterator at the end of each epoch, and again at its start: the
        reader gives the same one, so that each epoch's data is iterated once."""

        @property
        def element_spec(self) -> Any:
            return plan.element_spec

        def __iter__(self) -> Iterator[Any]:
            epoch, batch = runtime.position.epoch, runtime.position.batch
            if plan.length is not None and batch >= plan.length:
                epoch, batch = epoch + 1, 0  # trained, its end still to come: the next one
            if epoch >= plan.epochs:  # fit asks ahead after the last epoch: nothing left
                return iter(of_epoch(plan.epochs - 1).take(0))
            if not run.training:
                # Keras builds a model under a strategy from one batch, before training:
                # one of its own, so that what training reads is not one batch on.
                if not plan.per_function:
                    reader.iterated(data)
                return iter(fitted(epoch_data(data, epoch).take(1)))
            steps = plan.steps_per_epoch
            if plan.keras_steps is not None:  # one stream over every epoch: it repeats
                stream = data.repeat() if int(data.cardinality()) != INFINITE else data
                return reader.open(
                    STREAM,
                    epoch * plan.keras_steps + batch,
                    lambda skip: fitted(stream.skip(skip)),
                )

            def build(skip: int) -> Any:
                once = skip == 0 and not plan.per_function
                if once and whole:
                    return whole[0]
                source: Any = skipped(of_epoch(epoch), skip)
                if steps is not None:
                    source = source.take(steps - skip)
                if once:
                    whole.append(fitted(source))
                    return whole[0]
                return fitted(source)

            return reader.open(epoch, batch, build, same_data=None if plan.per_function else data)

        def reduce(self, initial_state: Any, reduce_func: Any) -> Any:
            raise NotImplementedError("the supervisor's stream is for fit only")

    class EpochData(DataAdapter):  # type: ignore[misc]
        def __init__(self) -> None:
            self.stream = EpochStream()

        def get_tf_dataset(self) -> Any:
            return self.stream

        @property
        def num_batches(self) -> int | None:
            return None if plan.keras_steps is not None else plan.length

        @property
        def batch_size(self) -> int | None:
            first = tf.nest.flatten(plan.element_spec)[0]
            return None if first.shape.rank is None else first.shape[0]

        @property
        def has_partial_batch(self) -> None:
            return None

        @property
        def partial_batch_size(self) -> None:
            return None

    return EpochData()


class FitRun:
    """One fit call's supervision: what the callbacks (``First``, ``Last``) do, and the
    little state they share."""

    def __init__(self, runtime: SessionRuntime, model: Any, plan: Plan) -> None:
        self.runtime, self.model, self.plan = runtime, model, plan
        self.callbacks: Any = None  # the CallbackList fit runs (set once, by `callbacks`)
        self.validation: dict[str, Any] = {}
        self.begin = 0  # the batch index fit gave the step in flight
        # The optimizer's count of steps, read around a call of many steps (a call of
        # one needs no count: it trains one batch).
        self.per_call = _steps_per_execution(model)  # batches in one call of Keras'
        self.iterations = _iterations(model) if self.per_call > 1 else None
        self.iterations_before = 0
        self.ctx: Any = None  # the hooks' RunContext of the step in flight
        self.cut = False  # we asked fit to end the resumed epoch after its last batch
        self.stopped_by_user = False  # a callback set stop_training during a batch
        self.stopped_by_keras = False  # a callback stopped fit while an interrupted end ran
        self.epoch_logs: dict[str, Any] | None = None
        self.training = False  # on_train_begin has run: batches read now are trained
        self.means = RunningMeans(model, plan.element_spec)
        # Resumed inside an epoch: its metrics' running state goes back at its start.
        self.resumed_inside = 0 < runtime.position.batch and not plan.end_due

    def list(self, user: Sequence[Any], validation: dict[str, Any], setup: dict[str, Any]) -> Any:
        import keras

        run = self

        class First(keras.callbacks.Callback):  # type: ignore[misc]
            """First in the list: before each epoch and batch, and first at an epoch's end."""

            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                run.epoch_begin()

            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                run.batch_begin(batch)

            def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
                run.runtime.thread.mark_step(training=False)  # progress, not training

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                run.epoch_end_first()

        class Last(keras.callbacks.Callback):  # type: ignore[misc]
            """Last in the list: after each batch, and last at an epoch's end."""

            def on_train_begin(self, logs: Any = None) -> None:
                run.train_begin()  # after every other callback's: History's too

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                run.batch_end(batch, logs)

            def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
                run.boundary()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                run.epoch_end_last(logs)

        verbose = setup["verbose"]
        self.validation = validation
        self.user = list(user)
        if self.runtime.events.writer is not None:
            warn_tensorboard_callback(self.user)
        self.keys = [key_of(i, cb) for i, cb in enumerate(self.user)]
        self.runtime.kept.track("callbacks", self.user, self.keys)
        self.runtime.kept.track("fit", [self.means], [RunningMeans.KEY])
        # Keras' own History and progress bar, as fit adds them, but before Last.
        defaults = [keras.callbacks.History()]
        if verbose != 0:
            defaults.append(keras.callbacks.ProgbarLogger())
        self.callbacks = keras.callbacks.CallbackList(
            [First(), *user, *defaults, Last()],
            verbose=verbose,
            epochs=setup["epochs"],
            steps=self.plan.length,
            model=self.model,
        )
        return self.callbacks

    # -- what the callbacks do -------------------------------------------------------

    def train_begin(self) -> None:
        """After every callback's ``on_train_begin`` (Keras resets them there): their kept
        state back, then an epoch end a stop interrupted."""
        self.training = True
        self.runtime.kept.give_back("callbacks", self.user, self.keys)
        if self.plan.end_due:
            self._end_interrupted_epoch()

    def epoch_begin(self) -> None:
        # Keras sets the epoch's data up now: bounded, but no training step yet.
        self.runtime.thread.mark_step(training=False)
        if self.runtime.flag.stopped or self.stopped_by_keras:
            raise FitStopped()
        if self.resumed_inside:  # after Keras reset the metrics for the epoch
            self.resumed_inside = False
            self.runtime.kept.give_back("fit", [self.means], [RunningMeans.KEY])

    def batch_begin(self, batch: int) -> None:
        thread = self.runtime.thread
        thread.check_fence()
        thread.mark_step(steps=self.per_call)  # the deadline is K batches'
        self.begin, self.ctx = batch, self.runtime.stepper.before((), {})
        if self.iterations is not None:
            self.iterations_before = int(self.iterations.numpy())

    def batch_end(self, batch: int, logs: Any) -> None:
        runtime, position = self.runtime, self.runtime.position
        logs = dict(logs or {})
        batches = self._batches_run(batch)
        runtime.stepper.after(
            self.ctx, logs, False, batches=batches, running_means=True, deferred=True
        )
        position.keep_logs(logs)
        self.boundary()
        self.stopped_by_user = bool(self.model.stop_training)
        length = self.plan.length
        if length is not None and position.batch >= length > batch + 1:
            self.cut = True  # the resumed epoch's last batch, where fit would ask for more
            self.model.stop_training = True

    def _batches_run(self, batch: int) -> int:
        """How many batches the call that ended at Keras' ``batch`` trained: more than one
        with ``steps_per_execution``. Keras names a call's last batch ``begin + K - 1``
        even when the epoch's data ran out inside it (45 batches, K = 10: the last call
        trains 5 and is named 40..49): a known epoch length, and the optimizer's count of
        steps when it has one, say how many ran."""
        batches = batch - self.begin + 1
        length = self.plan.length
        if length is not None:
            batches = min(batches, max(length - self.runtime.position.batch, 1))
        if self.iterations is not None:
            ran = int(self.iterations.numpy()) - self.iterations_before
            if 0 < ran < batches:
                batches = ran
        return batches

    def boundary(self) -> None:
        """Between two batches (of training or validation): the jobs queued meanwhile
        (saves, calls, holds) run, and a stop ends fit here."""
        thread = self.runtime.thread
        if thread.has_pending():
            thread.run_pending()
        if self.runtime.flag.stopped:
            raise FitStopped()

    def epoch_end_first(self) -> None:
        # The epoch-end callbacks may take a while: bounded, but no training step.
        self.runtime.thread.mark_step(training=False)
        if self.cut:
            self.cut = False
            self.model.stop_training = self.stopped_by_user

    def epoch_end_last(self, logs: Any) -> None:
        runtime = self.runtime
        self.epoch_logs = dict(logs or {})
        logs = _with_learning_rate(self.model, self.epoch_logs)
        runtime.summaries.epoch_summaries(runtime.position.epoch, logs)
        runtime.position.next_epoch()
        best = runtime.sv.keep_best
        if best is not None and best.metric in self.epoch_logs and runtime.sv.checkpointing:
            # keep-best needs the epoch's own checkpoint
            runtime.checkpoints.save(metrics=self.epoch_logs)

    def _end_interrupted_epoch(self) -> None:
        """The epoch whose validation a stop interrupted: evaluated and ended now, before
        fit's first epoch, with the training logs it had."""
        position = self.runtime.position
        epoch, logs = position.epoch, dict(position.logs)
        validation = self.validation
        if validation.get("validation_data") is not None and _due(
            epoch, validation.get("validation_freq", 1)
        ):
            logs.update(_evaluate(self.model, validation, self.callbacks))
        self.callbacks.on_epoch_end(epoch, logs)  # Last moves the position on
        self.stopped_by_keras = bool(self.model.stop_training)


def _steps_per_execution(model: Any) -> int:
    try:
        return int(getattr(model, "steps_per_execution", 1) or 1)
    except (TypeError, ValueError):
        return 1


def _iterations(model: Any) -> Any:
    """The model's optimizer's step counter, if it has one (a Keras optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    iterations = getattr(optimizer, "iterations", None)
    return iterations if hasattr(iterations, "numpy") else None


def _with_learning_rate(model: Any, logs: dict[str, Any]) -> dict[str, Any]:
    """An epoch's logs as Keras' TensorBoard callback writes them: with the optimizer's
    learning rate (``epoch_learning_rate``)."""
    import keras

    optimizer = getattr(model, "optimizer", None)
    if "learning_rate" in logs or not isinstance(optimizer, keras.optimizers.Optimizer):
        return logs
    rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    return {**logs, "learning_rate": rate}


class RunningMeans:
    """The running state of fit's metrics (the loss's mean too), which Keras resets at
    each epoch's start and its logs report: kept with the other state (``state()``,
    ``restore()``), so that an epoch resumed at batch b reports the means of all its
    batches, as the run left alone does, and callbacks watching them act alike."""

    KEY = "running_means"

    def __init__(self, model: Any, element_spec: Any) -> None:
        self.model, self.element_spec = model, element_spec

    def state(self) -> dict[str, Any]:
        import keras

        return {
            v.path: keras.ops.convert_to_numpy(v).tolist() for v in self.model.metrics_variables
        }

    def restore(self, state: Any) -> None:
        import numpy as np

        self._build()
        for variable in self.model.metrics_variables:
            if variable.path in state:
                variable.assign(np.asarray(state[variable.path], dtype=variable.dtype))

    def _build(self) -> None:
        """Compiled metrics make their variables at the first batch: made now, from the
        data's element spec, as Keras does under a strategy (when it cannot, a custom
        ``train_step`` for one, only the loss's mean goes back)."""
        compiled = getattr(self.model, "_compile_metrics", None)
        if compiled is None or compiled.built:
            return
        try:
            self.model._symbolic_build(data_batch=self.element_spec)
        except Exception as exc:
            log.info("fit.metrics_not_restored", reason=f"{type(exc).__name__}: {exc}"[:300])


def _due(epoch: int, freq: Any) -> bool:
    """Whether fit validates after ``epoch`` (Keras' ``validation_freq``)."""
    if isinstance(freq, int):
        return (epoch + 1) % freq == 0
    return epoch + 1 in freq


def warn_tensorboard_callback(callbacks: Sequence[Any]) -> None:
    """Keras' ``TensorBoard`` callback in a session that writes summaries: one line that
    says what it adds. ``sess.fit`` already writes what it writes at an epoch's end
    (the ``train``/``validation`` runs); with the session's writer the default one on
    the training thread, the callback also writes ``batch_<metric>`` for every batch at
    its own batch counter, which starts again at 1 in each session (plain Keras writes
    none with ``update_freq="epoch"``: it has no default writer)."""
    import keras

    found = [cb for cb in callbacks if isinstance(cb, keras.callbacks.TensorBoard)]
    if found:
        log.warning(
            "fit.tensorboard_callback",
            log_dir=[str(getattr(cb, "log_dir", "?")) for cb in found],
            hint="sess.fit writes Keras' epoch runs itself: leave the callback out "
            "(with it, its batch_<metric> points go into the logdir's run at a batch "
            "counter that starts again at 1 in each session, over the points before)",
        )


def _evaluate(model: Any, validation: dict[str, Any], callbacks: Any) -> dict[str, Any]:
    import keras

    x, y, weights = keras.utils.unpack_x_y_sample_weight(validation["validation_data"])
    found = model.evaluate(
        x=x,
        y=y,
        sample_weight=weights,
        batch_size=validation.get("validation_batch_size"),
        steps=validation.get("validation_steps"),
        callbacks=callbacks,
        return_dict=True,
    )
    return {f"val_{name}": value for name, value in found.items()}


def _class_weights(weights: Any) -> Any:
    if weights is None:
        return None
    from keras.src.trainers.data_adapters.tf_dataset_adapter import make_class_weight_map_fn

    return make_class_weight_map_fn(weights)


def _build_optimizer(model: Any) -> None:
    """The optimizer as fit's first batch would build it: it takes its restored state
    (Keras 3 restores into an unbuilt optimizer deferred; left so, its saved values are
    warned about as not found when the process ends)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not getattr(optimizer, "built", True):
        optimizer.build(model.trainable_variables)


def _empty_history(model: Any) -> Any:
    import keras

    history = keras.callbacks.History()
    history.set_model(model)
    history.on_train_begin()
    return history


VALIDATION_ARGS = (
    "validation_data",
    "validation_steps",
    "validation_batch_size",
    "validation_freq",
)


def fit(
    runtime: SessionRuntime,
    model: Any,
    data: Any,
    epochs: int,
    callbacks: Sequence[Any],
    kwargs: dict[str, Any],
) -> Any:
    """Training thread: one ``model.fit`` from the saved position to ``epochs``; the History.
    A recoverable error restores the newest checkpoint and fit goes on from there (a new
    call: Keras' callbacks begin again)."""
    while True:
        try:
            return _fit_once(runtime, model, data, epochs, callbacks, dict(kwargs))
        except Rewind:
            continue  # rolled back after a divergence: fit goes on from the moved position
        except Exception as exc:
            if not runtime.recoverable(exc):
                raise
            runtime.checkpoints.recover(exc)  # raises when it cannot


def _fit_once(
    runtime: SessionRuntime,
    model: Any,
    data: Any,
    epochs: int,
    callbacks: Sequence[Any],
    kwargs: dict[str, Any],
) -> Any:
    position = runtime.position
    plan = Plan(runtime, data, epochs, kwargs.pop("steps_per_epoch", None))
    if position.stopped or position.epoch >= epochs:
        log.info("fit.nothing_left", epoch=position.epoch, ended_by_callback=position.stopped)
        _build_optimizer(model)
        # The callbacks as the run left them (as if its fit had gone on to here), and kept.
        keys = [key_of(i, cb) for i, cb in enumerate(callbacks)]
        runtime.kept.give_back("callbacks", callbacks, keys)
        runtime.kept.track("callbacks", callbacks, keys)
        return _empty_history(model)
    weights = _class_weights(kwargs.pop("class_weight", None))
    run = FitRun(runtime, model, plan)
    stream = epoch_data_adapter(runtime, model, data, plan, weights, run)
    validation = {k: kwargs[k] for k in VALIDATION_ARGS if k in kwargs}
    setup = {"verbose": kwargs.get("verbose", "auto"), "epochs": epochs}
    callback_list = run.list(callbacks, validation, setup)
    at_boundary = False  # fit ended between two batches (its reader's state is whole)
    with contextlib.ExitStack() as stack:
        stack.enter_context(position.counting())
        summary_step = runtime.step.summary_step
        if summary_step is not None:
            iterations = model.optimizer.iterations
            stack.enter_context(summary_step.fitting(iterations, runtime.step.value))
        try:
            model.fit(
                stream,
                epochs=epochs,
                initial_epoch=position.epoch + (1 if plan.end_due else 0),
                steps_per_epoch=plan.keras_steps,
                callbacks=callback_list,
                **kwargs,
            )
            at_boundary = True
        except FitStopped:
            at_boundary = True
            if run.stopped_by_keras:
                position.fit_stopped()
            callback_list.on_train_end(run.epoch_logs)
        else:
            if model.stop_training and position.epoch < epochs:
                position.fit_stopped()  # a callback ended it: a restart must not go on
        finally:
            position.reader.close(clean=at_boundary)
            runtime.step.flush()
    return model.history
