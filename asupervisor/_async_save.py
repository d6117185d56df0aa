"""Asynchronous checkpoints: hold training only while the state is snapshotted.

TensorFlow's own ``CheckpointOptions(enable_async=True)`` copies every object to
the CPU first, which fails on the second save of a Keras 3 model. Here the
snapshot is the tensors TF itself would write, gathered on the training thread:
reading a resource variable shares its buffer, and TF copies a shared buffer
before updating it in place, so the snapshot stays the state of one step
boundary while training goes on. A writer thread then writes those tensors.

This leans on TF internals (``_gather_serialized_tensors``, ``MultiDeviceSaver``
and the manager's state bookkeeping) that TF's own async checkpointing uses;
the tests write, mutate, and read back to pin the behaviour.
"""

from __future__ import annotations

import os
import time
from typing import Any

Snapshot = tuple[dict[Any, Any], dict[Any, Any]]


def take_snapshot(checkpoint: Any) -> Snapshot:
    """On the training thread: the checkpoint's values as tensors that later steps cannot change."""
    from tensorflow.python.checkpoint import tensor_callable

    checkpoint.save_counter.assign_add(1)  # as CheckpointManager.save does before writing
    tensors, _, registered_savers, _ = checkpoint._saver._gather_serialized_tensors(None)
    for entries in tensors.values():
        for key, value in list(entries.items()):
            if isinstance(value, tensor_callable.Callable):
                entries[key] = value.tensor  # read now, not when the writer gets to it
            elif isinstance(value, dict):
                for spec, part in list(value.items()):
                    if isinstance(part, tensor_callable.Callable):
                        value[spec] = part.tensor
    return tensors, registered_savers


def write_snapshot(snapshot: Snapshot, prefix: str) -> None:
    """On the writer thread: the snapshot's files at ``prefix``."""
    from tensorflow.python.checkpoint import functional_saver

    tensors, registered_savers = snapshot
    import tensorflow as tf

    tf.io.gfile.makedirs(os.path.dirname(prefix) or ".")
    functional_saver.MultiDeviceSaver(tensors, registered_savers).save(prefix)


def commit(manager: Any, prefix: str) -> None:
    """Point the manager's state file at ``prefix`` and sweep old checkpoints,
    in the order ``CheckpointManager.save`` uses: state, sweep, state."""
    manager._maybe_delete.pop(prefix, None)
    manager._maybe_delete[prefix] = time.time()
    manager._latest_checkpoint = prefix
    manager._record_state()
    manager._sweep()
    manager._record_state()
