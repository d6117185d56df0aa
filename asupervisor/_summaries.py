"""Writing values into a run's events file."""

from __future__ import annotations

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
