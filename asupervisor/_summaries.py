"""The run's events file, and writing values into it."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf


def write_values(writer: tf.summary.SummaryWriter, values: Mapping[str, Any], step: int) -> None:
    """Scalars (numbers, 0-d tensors) become scalar summaries; rank >= 1, histograms."""
    import tensorflow as tf

    with writer.as_default(step=step):
        for tag, value in values.items():
            tensor = tf.convert_to_tensor(value)
            if tensor.shape.rank == 0:
                tf.summary.scalar(tag, tensor)
            else:
                tf.summary.histogram(tag, tensor)


def create_events_file(logdir: str) -> tuple[tf.summary.SummaryWriter, str | None]:
    """A new writer in ``logdir`` and the events file it writes (``None`` if unknown).

    The file is found by what appeared in the directory: only the chief, which
    holds the logdir lock, creates events files there.
    """
    import tensorflow as tf

    pattern = os.path.join(glob.escape(logdir), "events.out.tfevents.*")
    before = set(glob.glob(pattern))
    writer = tf.summary.create_file_writer(logdir)
    writer.flush()
    new = set(glob.glob(pattern)) - before
    return writer, (new.pop() if len(new) == 1 else None)
