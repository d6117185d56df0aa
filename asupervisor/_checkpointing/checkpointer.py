"""One session's checkpoints in a logdir: its catalog (the history), restorer and writer.

Every function here runs on the training thread (the background writer aside), so a
save or a restore always sees the state of one step boundary. The parts:

- ``Catalog`` (``_logdir/history.py``): the logdir's history, the one order of commits;
- ``Restorer``: restore with fallback, adoption of what a kill left uncommitted;
- ``Writer``: durable sync and async saves, the write guard, failures;
- ``Retention`` (``_logdir/retention.py``): the rules that keep checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._kinds import RestoreSource
from .._logdir.catalog import Catalog
from .._logdir.history import Provenance
from .._logdir.lock import WriteGuard
from .._logdir.retention import KeepBest, Retention
from .._logdir.store import Store
from .restorer import Restorer
from .root import SavedRoot
from .writer import Writer


@dataclass(frozen=True)
class RestoreReport:
    """How a session began."""

    source: RestoreSource
    path: str | None
    step: int
    skipped: tuple[tuple[str, str], ...] = ()
    """Unreadable checkpoints passed over, as (path, reason)."""


class Checkpointer:
    """Saves and restores one session's root in a logdir."""

    def __init__(
        self,
        root: SavedRoot,
        directory: str,
        *,
        basename: str,
        max_to_keep: int | None,
        keep_checkpoint_every_n_hours: float | None,
        async_write: bool = False,
        guard: WriteGuard | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        durable: bool = True,
        keep_best: KeepBest | None = None,
        lookback: int | None = None,
        provenance: Provenance | None = None,
    ) -> None:
        guard = guard or WriteGuard(None)
        self.root = root
        self.directory = directory
        self.store = store = Store(directory)
        self.basename = basename
        # Only the chief (the one with a guard over the logdir) writes the history.
        self.catalog = Catalog(
            store, basename, writer=guard.lock is not None, provenance=provenance
        )
        self.catalog.load()  # bounded, never blocking: a FIFO is damage, not a hang
        retention = Retention(
            store, max_to_keep, keep_checkpoint_every_n_hours, keep_best, lookback
        )
        self.restorer = Restorer(root, self.catalog, guard)
        self.writer = Writer(
            root,
            self.catalog,
            retention,
            guard,
            async_write=async_write,
            durable=durable,
            on_fatal=on_fatal,
        )

    # -- what the session's other parts read -------------------------------------------

    @property
    def last_saved_step(self) -> int | None:
        return self.writer.last_saved_step

    @property
    def last_saved_at(self) -> float | None:
        return self.writer.last_saved_at

    @property
    def async_write(self) -> bool:
        return self.writer.async_write

    @property
    def fatal(self) -> BaseException | None:
        return self.writer.fatal

    def wait_for_write(self, timeout: float | None = None) -> bool:
        return self.writer.wait_for_write(timeout)

    def latest_committed(self) -> str | None:
        return self.writer.latest_committed()

    @property
    def restore_status(self) -> Any:
        return self.restorer.restore_status

    # -- restoring -----------------------------------------------------------------------

    def restore_newest(self) -> tuple[str | None, list[tuple[str, str]]]:
        return self.restorer.restore_newest()

    def restore(self, path: str) -> None:
        self.restorer.restore(path)

    def restored(self, path: str) -> None:
        """The session restored ``path``: the last good checkpoint (of unknown time)."""
        order = self.catalog.names.order(path)
        if order is not None and not self.restorer.migrated:  # a foreign number is no step
            self.writer.restored(order[0])
