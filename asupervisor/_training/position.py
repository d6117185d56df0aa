"""Where the data is: the epoch, the batch inside it, saved with every checkpoint.

One session owns one ``Position`` and changes it through its methods only. Python ints
on the hot path (a step pays nothing for them); written into variables of the
checkpoint just before each save, read back after a restore.

Two objects go into the checkpoint: ``data_place``, one string (JSON) holding the epoch
and the batch (which ``train(epochs=)`` and ``fit`` both use) and what ``fit`` alone
needs (the length of an epoch when the data cannot say it, whether a callback ended
``fit``, and the last batch's logs, for an epoch whose end a stop interrupted); and
``data_iterator`` (the state of the iterator read there: see ``reader``). One variable,
not five in two objects: TF's write of a checkpoint costs per object and per variable,
and a small model's save paid a fifth more for them.

Checkpoints written before held the same values as ``data_position`` (the epoch and the
batch) and ``fit_state`` (the rest), a variable each: those are still read (``legacy``).
A checkpoint without any of them (older, or another tool's) restores with all at zero
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

NAME = "data_place"  # its name in the checkpoint
# The names older checkpoints gave the same values: read, no longer written.
LEGACY_POSITION = "data_position"
LEGACY_FIT_STATE = "fit_state"


class Position:
    def __init__(self) -> None:
        import tensorflow as tf

        def counter(name: str) -> tf.Variable:
            return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)

        place = tf.Module(name=NAME)
        # "": restored from no checkpoint of this layout (an older one, or none).
        place.json = tf.Variable("", dtype=tf.string, trainable=False, name="json")
        module = tf.Module(name=LEGACY_POSITION)
        module.epoch, module.batch = counter("epoch"), counter("batch")
        fit = tf.Module(name=LEGACY_FIT_STATE)
        fit.epoch_batches, fit.stopped = counter("epoch_batches"), counter("stopped")
        fit.logs = tf.Variable("{}", dtype=tf.string, trainable=False, name="logs")
        self.place, self.module, self.fit_module = place, module, fit
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
        """The checkpoint's children for the position, by name: what a save writes."""
        return {NAME: self.place, **self.reader.objects()}

    def legacy(self) -> dict[str, Any]:
        """The children older checkpoints held the position in: restored from, when a
        checkpoint has them, never written."""
        return {LEGACY_POSITION: self.module, LEGACY_FIT_STATE: self.fit_module}

    def sync(self) -> None:
        """Training thread, before a save: the position goes into the checkpoint."""
        place = {
            "epoch": self.epoch,
            "batch": self.batch,
            "epoch_batches": self.epoch_batches,
            "stopped": self.stopped,
            "logs": _numbers(self.logs),
        }
        self._synced.assign(self.place.json, json.dumps(place, separators=(",", ":")))
        self.reader.sync((self.epoch, self.batch))

    def reload(self) -> None:
        """Training thread, after a restore (or a fresh start): what the checkpoint holds,
        in this layout or an older one's."""
        self._synced.forget()  # the restore wrote the variables
        text = self.place.json.numpy().decode()
        if text:
            place = json.loads(text)
            self.epoch, self.batch = int(place["epoch"]), int(place["batch"])
            self.epoch_batches = int(place["epoch_batches"])
            self.stopped = bool(place["stopped"])
            self.logs = dict(place["logs"])
            # A restore of an older checkpoint later (a rollback past an upgrade) leaves
            # this variable as it is: it must not read as that checkpoint's. Every save
            # assigns it again first (``sync``, the cache forgotten above).
            self.place.json.assign("")
        else:
            fit = self.fit_module
            self.epoch = int(self.module.epoch.numpy())
            self.batch = int(self.module.batch.numpy())
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
