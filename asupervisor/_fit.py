"""Keras ``model.fit`` under supervision, on the training thread.

A callback makes each batch a supervised step: the hooks run around it, the
global step and the data position advance, step schedules fire, and the jobs
queued meanwhile (saves, ``sess.call``, ``between_steps`` holds) run between two
batches. A stop ends ``fit`` after the batch in flight. A resumed run goes on at
the saved epoch and batch: the first, partial epoch skips the batches already
trained, then ``fit`` goes on with whole epochs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._position import epoch_data, skipped

if TYPE_CHECKING:
    from ._runtime import SessionRuntime


def check_data(data: Any) -> None:
    """``fit`` resumes inside an epoch only over data it can skip into: a ``tf.data``
    dataset, or a function of the epoch that returns one."""
    if callable(data) and not hasattr(data, "__iter__"):
        return
    if not hasattr(data, "element_spec"):
        raise ValueError(
            "data must be a tf.data.Dataset of batches (or a function epoch -> Dataset), so "
            "that a resumed run can go on at the batch it stopped at; for arrays use "
            "tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)"
        )


def supervisor_callback(runtime: SessionRuntime) -> Any:
    import keras

    stepper, position = runtime.stepper, runtime.position

    class SupervisorCallback(keras.callbacks.Callback):  # type: ignore[misc]
        """Each batch of ``fit`` is a supervised step."""

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            runtime.check_open()
            self.ctx = stepper.before((), {})

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            stepper.after(self.ctx, dict(logs or {}), False, running_means=True, deferred=True)
            thread = runtime.thread
            if thread.has_pending():
                thread.run_pending()  # saves, calls and holds queued during the batch
            if runtime.flag.stopped:
                self.model.stop_training = True

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if not runtime.flag.stopped:
                position.next_epoch()

    return SupervisorCallback()


def fit(
    runtime: SessionRuntime,
    model: Any,
    data: Any,
    epochs: int,
    callbacks: Sequence[Any],
    kwargs: dict[str, Any],
) -> Any:
    """Training thread: ``model.fit`` from the saved position to ``epochs``; the History."""
    position, flag = runtime.position, runtime.flag
    every = [*callbacks, supervisor_callback(runtime)]
    histories = []
    position.counting = True
    try:
        while position.epoch < epochs and not flag.stopped:
            start = position.epoch
            if position.batch > 0 and _ended(epoch_data(data, start), position.batch):
                position.next_epoch()  # stopped right after the epoch's last batch
                continue
            if position.batch > 0:  # inside an epoch: finish it first, then whole ones
                source, last = skipped(epoch_data(data, start), position.batch), start + 1
            elif callable(data) and not hasattr(data, "__iter__"):
                source, last = data(start), start + 1  # a new dataset each epoch
            else:
                source, last = data, epochs
            histories.append(
                model.fit(source, initial_epoch=start, epochs=last, callbacks=every, **kwargs)
            )
    finally:
        position.counting = False
        runtime.step.flush()
    return _merged(histories)


def _ended(dataset: Any, batches: int) -> bool:
    """Whether ``batches`` batches are all of ``dataset`` (when its length is known)."""
    length = int(dataset.cardinality()) if hasattr(dataset, "cardinality") else -1
    return length >= 0 and batches >= length


def _merged(histories: list[Any]) -> Any:
    """One History over every ``fit`` call of this session (``None`` if none ran)."""
    if not histories:
        return None
    merged = histories[-1]
    history: dict[str, list[Any]] = {}
    epochs: list[int] = []
    for part in histories:
        epochs += list(part.epoch)
        for key, values in part.history.items():
            history.setdefault(key, []).extend(values)
    merged.epoch, merged.history = epochs, history
    return merged
