"""A non-chief worker's part in the saves of a multi-worker job."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import TYPE_CHECKING

from .checkpointer import Checkpointer

if TYPE_CHECKING:
    from .._logdir.records import Record
    from .root import SavedRoot


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
            root,
            scratch,
            basename=basename,
            max_to_keep=1,
            keep_checkpoint_every_n_hours=None,
            durable=False,  # thrown away at once: no fsync
        )

    def save(
        self,
        step: int,
        *,
        force: bool = False,
        final: bool = False,
        tag: int = 0,
        record: Record | None = None,
    ) -> str | None:
        """Take part in the save at ``step``; nothing is kept, so nothing is returned."""
        try:
            super().save(step, force=force, final=final, tag=tag)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        return None

    def candidates(self) -> list[str]:
        return []  # a non-chief never picks a checkpoint: the chief does
