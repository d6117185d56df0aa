"""A non-chief worker's part in the saves of a multi-worker job."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import TYPE_CHECKING, Any

from .checkpointer import Checkpointer
from .writer import Writer

if TYPE_CHECKING:
    from .._logdir.records import Record
    from .root import SavedRoot


class ScratchWriter(Writer):
    """Takes part in each save, and keeps nothing: the directory goes straight after."""

    def _commit(self, name: str, record: Record) -> None:
        pass  # nothing of a non-chief's is committed: the chief's files are the checkpoint

    def save(self, step: int, record: Record, **kwargs: Any) -> str | None:
        try:
            super().save(step, record, **kwargs)
        finally:
            shutil.rmtree(self.store.root, ignore_errors=True)
        return None


class ScratchCheckpointer(Checkpointer):
    """A non-chief worker's part in the saves of a multi-worker job.

    The strategy's collectives need every worker in every save, but only the
    chief's files are kept: a non-chief saves into a private temporary directory,
    never into the logdir, and removes it straight after (TF's own pattern).
    It restores the checkpoint the chief chose, from the chief's logdir.
    """

    def __init__(self, root: SavedRoot, worker: str, basename: str) -> None:
        # Not created here: TF makes it on each save, and it is removed after each.
        name = f"asupervisor-{worker.replace(':', '')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        scratch = os.path.join(tempfile.gettempdir(), name)
        super().__init__(
            root, scratch, basename=basename, max_to_keep=1, keep_checkpoint_every_n_hours=None
        )
        self.writer = ScratchWriter(
            root, self.catalog, self.writer.retention, self.writer.guard, durable=False
        )
