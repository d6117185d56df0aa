"""Where the data is: the epoch, the batch inside it, saved with every checkpoint.

One session owns one ``Position`` and changes it through its methods only. Python ints
on the hot path (a step pays nothing for them); written into variables of the
checkpoint just before each save, read back after a restore.

Three objects go into the checkpoint: ``data_position`` (the epoch and the batch, which
``train(epochs=)`` and ``fit`` both use), ``fit_state`` (what ``fit`` alone needs:
the length of an epoch when the data cannot say it, whether a callback ended ``fit``,
and the last batch's logs, for an epoch whose end a stop interrupted) and
``data_iterator`` (the state of the iterator read there: see ``reader``).
A checkpoint without them (older, or another tool's) restores with the first two at zero
and no iterator state (a resume inside an epoch then skips to its batch).
"""

from __future__ import annotations

import collections.abc
import contextlib
import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .reader import Reader

NAME = "data_position"  # their names in the checkpoint
FIT_STATE = "fit_state"


class Position:
    def __init__(self) -> None:
        import tensorflow as tf

        def counter(name: str) -> tf.Variable:
            return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)

        module = tf.Module(name=NAME)
        module.epoch, module.batch = counter("epoch"), counter("batch")
        fit = tf.Module(name=FIT_STATE)
        fit.epoch_batches, fit.stopped = counter("epoch_batches"), counter("stopped")
        fit.logs = tf.Variable("{}", dtype=tf.string, trainable=False, name="logs")
        self.module, self.fit_module = module, fit
        self.epoch = 0
        self.batch = 0
        self.epoch_batches = 0  # batches in a whole epoch, once seen (0: not known)
        self.stopped = False  # a callback ended fit (EarlyStopping): it stays ended
        self.logs: dict[str, Any] = {}  # the last batch's Keras logs
        self.reader = Reader()  # the iterator read at this position, and its state
        self._counting = False
        self._synced = Synced()

    # -- what the checkpoint holds ---------------------------------------------------

    def objects(self) -> dict[str, Any]:
        """The checkpoint's children for the position, by name."""
        return {NAME: self.module, FIT_STATE: self.fit_module, **self.reader.objects()}

    def sync(self) -> None:
        """Training thread, before a save: the position goes into the checkpoint."""
        fit, synced = self.fit_module, self._synced
        synced.assign(self.module.epoch, self.epoch)
        synced.assign(self.module.batch, self.batch)
        synced.assign(fit.epoch_batches, self.epoch_batches)
        synced.assign(fit.stopped, int(self.stopped))
        synced.assign(fit.logs, json.dumps(_numbers(self.logs)))
        self.reader.sync((self.epoch, self.batch))

    def reload(self) -> None:
        """Training thread, after a restore (or a fresh start): what the checkpoint holds."""
        self._synced.forget()  # the restore wrote the variables
        self.epoch = int(self.module.epoch.numpy())
        self.batch = int(self.module.batch.numpy())
        fit = self.fit_module
        self.epoch_batches = int(fit.epoch_batches.numpy())
        self.stopped = bool(fit.stopped.numpy())
        self.logs = json.loads(fit.logs.numpy().decode() or "{}")
        self.reader.reload((self.epoch, self.batch))

    # -- moving ----------------------------------------------------------------------

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Inside ``train(epochs=)`` or ``fit``: each step is a batch of the data."""
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    def counts(self) -> bool:
        return self._counting

    def advance(self, batches: int = 1) -> None:
        if self._counting:
            self.batch += batches
            self.reader.advance(batches)

    def go_to(self, epoch: int, batch: int) -> None:
        """A rollback moves the data past the batches that led to the divergence."""
        self.epoch, self.batch = epoch, batch

    def next_epoch(self) -> None:
        if self.batch > 0 and not self.epoch_batches:
            self.epoch_batches = self.batch  # the data could not say it: now it is known
        self.epoch, self.batch = self.epoch + 1, 0

    def fit_stopped(self) -> None:
        self.stopped = True

    def keep_logs(self, logs: dict[str, Any]) -> None:
        """The last batch's logs: an epoch's end interrupted by a stop needs them again."""
        self.logs = logs


def _numbers(logs: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of Keras' logs (JSON has no NaN)."""
    out = {}
    for key, value in logs.items():
        with contextlib.suppress(TypeError, ValueError):
            number = float(value)
            if math.isfinite(number):
                out[str(key)] = number
    return out


def epoch_data(data: Any, epoch: int) -> Any:
    """``data`` itself, or ``data(epoch)`` when it is a function of the epoch (a shuffled
    dataset must be, to give the same order again after a restart)."""
    if is_epoch_function(data):
        return data(epoch)
    return data


def is_epoch_function(data: Any) -> bool:
    return callable(data) and not hasattr(data, "__iter__")


def skipped(data: Any, batches: int) -> Iterable[Any]:
    """``data`` without its first ``batches`` elements (``Dataset.skip`` for tf.data)."""
    if batches <= 0:
        return data  # type: ignore[no-any-return]
    skip: Callable[[int], Any] | None = getattr(data, "skip", None)
    if skip is not None and hasattr(data, "element_spec"):  # a tf.data.Dataset
        return skip(batches)  # type: ignore[no-any-return]
    return itertools.islice(iter(data), batches, None)


def is_one_shot(data: Any) -> bool:
    """Whether ``data`` is an iterator (a generator, ``iter(dataset)``): it runs out once,
    so it cannot be iterated again for the next epoch."""
    return isinstance(data, collections.abc.Iterator)


class Synced:
    """What the last save's sync assigned to each variable, so that the next one assigns
    only what changed: a save of a run whose position did not move pays no eager assign
    for it. ``forget`` after a restore, which writes the variables behind its back."""

    def __init__(self) -> None:
        self._values: dict[int, Any] = {}

    def assign(self, variable: Any, value: Any) -> None:
        key = id(variable)
        if key in self._values and type(self._values[key]) is type(value):
            if self._values[key] == value:
                return
        variable.assign(value)
        self._values[key] = value

    def forget(self) -> None:
        self._values.clear()
