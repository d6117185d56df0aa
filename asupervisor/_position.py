"""Where the data is: the epoch, and the batch inside it, saved with every checkpoint.

Python ints on the hot path (a step pays nothing for them); written into two
variables of the checkpoint just before each save, read back after a restore.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

NAME = "data_position"  # its name in the checkpoint; older checkpoints may lack it


class Position:
    def __init__(self) -> None:
        import tensorflow as tf

        self.module = tf.Module(name=NAME)
        self.module.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.module.batch = tf.Variable(0, dtype=tf.int64, trainable=False, name="batch")
        self.epoch = 0
        self.batch = 0
        self.counting = False  # inside train(epochs=) or fit: each step is one batch

    def reload(self) -> None:
        self.epoch = int(self.module.epoch.numpy())
        self.batch = int(self.module.batch.numpy())

    def sync(self) -> None:
        """Training thread, before a save: the position goes into the checkpoint."""
        self.module.epoch.assign(self.epoch)
        self.module.batch.assign(self.batch)

    def next_epoch(self) -> None:
        self.epoch, self.batch = self.epoch + 1, 0


def epoch_data(data: Any, epoch: int) -> Any:
    """``data`` itself, or ``data(epoch)`` when it is a function of the epoch (a shuffled
    dataset must be, to give the same order again after a restart)."""
    if callable(data) and not hasattr(data, "__iter__"):
        return data(epoch)
    return data


def skipped(data: Any, batches: int) -> Iterable[Any]:
    """``data`` without its first ``batches`` elements (``Dataset.skip`` for tf.data)."""
    if batches <= 0:
        return data  # type: ignore[no-any-return]
    skip: Callable[[int], Any] | None = getattr(data, "skip", None)
    if skip is not None and hasattr(data, "element_spec"):  # a tf.data.Dataset
        return skip(batches)  # type: ignore[no-any-return]
    return itertools.islice(iter(data), batches, None)
