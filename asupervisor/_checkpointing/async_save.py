"""Asynchronous checkpoints: hold training only while the state is snapshotted.

TensorFlow's own ``CheckpointOptions(enable_async=True)`` copies every object to
the CPU first, which fails on the second save of a Keras 3 model. Here the
snapshot is the tensors TF itself would write, gathered on the training thread:
reading a resource variable shares its buffer, and TF copies a shared buffer
before updating it in place, so the snapshot stays the state of one step
boundary while training goes on. A writer thread then writes those tensors.

This leans on TF internals (``_gather_serialized_tensors``, ``MultiDeviceSaver``)
that TF's own async checkpointing uses; the tests write, mutate, and read back to
pin the behaviour. Committing the files (the state file, retention) is the
supervisor's own (``_retention``).
"""

from __future__ import annotations

import os
from typing import Any

Snapshot = tuple[dict[Any, Any], dict[Any, Any]]


def take_snapshot(checkpoint: Any) -> Snapshot:
    """On the training thread: the checkpoint's values as tensors that later steps cannot change."""
    tensors, _, registered_savers, _ = checkpoint._saver._gather_serialized_tensors(None)
    for entries in tensors.values():
        for key, value in list(entries.items()):
            if isinstance(value, dict):
                for spec, part in list(value.items()):
                    value[spec] = _read_now(part)
            else:
                entries[key] = _read_now(value)
    return tensors, registered_savers


def _read_now(value: Any) -> Any:
    """The value read now, not when the writer gets to it: a ``Callable`` reads when
    called, and a ``SaveSpec`` (what a variable under a multi-worker strategy gives)
    holds a function that reads the variable when the file is written, so a write that
    lands after the next step would hold that step's weights."""
    from tensorflow.python.checkpoint import tensor_callable
    from tensorflow.python.training.saving import saveable_object

    if isinstance(value, tensor_callable.Callable):
        return value.tensor
    if isinstance(value, saveable_object.SaveSpec):
        return saveable_object.SaveSpec(
            value.tensor, value.slice_spec, value.name, dtype=value.dtype, device=value.device
        )
    return value


def write_snapshot(snapshot: Snapshot, prefix: str) -> None:
    """On the writer thread: the snapshot's files at ``prefix``."""
    from tensorflow.python.checkpoint import functional_saver

    tensors, registered_savers = snapshot
    import tensorflow as tf

    tf.io.gfile.makedirs(os.path.dirname(prefix) or ".")
    functional_saver.MultiDeviceSaver(tensors, registered_savers).save(prefix)
