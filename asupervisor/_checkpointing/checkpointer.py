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
from .local import Tier, TwoTiers
from .restorer import Restorer
from .root import SavedRoot
from .tiers import LocalTier
from .writer import Writer


@dataclass(frozen=True)
class RestoreReport:
    """How a session began."""

    source: RestoreSource
    path: str | None
    step: int
    skipped: tuple[tuple[str, str], ...] = ()
    """Unreadable checkpoints passed over, as (path, reason)."""
    tier: str | None = None
    """With a local tier: which tier the checkpoint was read from, ``"local"`` or
    ``"store"`` (the logdir); ``None`` without one."""


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
        local: LocalTier | None = None,
        together: bool = False,
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
        # With a local tier the session saves there, and the mirror commits each copy
        # into this logdir with this retention (the logdir's history stays the record).
        self.tiers: TwoTiers | None = None
        if local is not None:
            self.tiers = TwoTiers(
                local,
                root,
                self.catalog,
                retention,
                guard,
                logdir=directory,
                basename=basename,
                durable=durable,
                on_fatal=on_fatal,
                provenance=provenance,
                together=together,
            )
            self.writer = self.tiers.writer
        self._last_restorer = self.restorer
        self._read_tier: Tier | None = None  # the tier of a path restored as told (restore)

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

    def wait_for_mirror(self, timeout: float | None = None) -> bool:
        """Until the logdir holds every local commit offered to the mirror (at once
        without a local tier); ``False`` if not after ``timeout`` seconds."""
        return True if self.tiers is None else self.tiers.mirror.wait(timeout)

    def finish_mirror(self, timeout: float | None = None) -> bool:
        """At the session's end: the newest local commit goes to the logdir too (whatever
        ``mirror_every`` says), within ``timeout`` seconds; ``False`` if not copied."""
        if self.tiers is None:
            return True
        self.tiers.mirror.hurry()  # no retry pause longer than the grace can afford
        self.tiers.offer_head()
        return self.tiers.mirror.wait(timeout)

    def steps_at_risk(self) -> int | None:
        """Steps committed locally that the logdir does not hold yet (``None``: no
        local tier)."""
        return None if self.tiers is None else self.tiers.mirror.steps_at_risk()

    def close(self) -> None:
        """No more copies to the logdir begin (what is left is said)."""
        if self.tiers is not None:
            self.tiers.close()

    @property
    def restored_tier(self) -> Tier | None:
        return self._read_tier if self.tiers is None else self.tiers.source

    def settle_mirror(self, timeout: float) -> None:
        """A rollback: the logdir gets what the mirror has (within ``timeout``); what is
        still waiting then is dropped (the rollback abandons it)."""
        if self.tiers is not None and not self.tiers.mirror.wait(timeout):
            self.tiers.mirror.drop_pending()

    def rolled_back(self, name: str) -> None:
        """A rollback went back to ``name``: the local tier's head goes back with it."""
        if self.tiers is not None:
            self.tiers.rolled_back(name)

    def store_of(self, path: str) -> Store:
        """The tier's store that holds ``path``."""
        if self.tiers is not None and self.tiers.store.name_of(path) is not None:
            return self.tiers.store
        return self.store

    def path_of(self, name: str) -> str:
        """Where a committed checkpoint of the logdir's is read fastest: its local copy
        if the local tier holds it, else the logdir's."""
        local = None if self.tiers is None else self.tiers.path_of(name)
        return local or self.store.path(name)

    def latest_committed(self) -> str | None:
        return self.writer.latest_committed()

    @property
    def last_restorer(self) -> Restorer:
        """The restorer of the last restore: the local tier's, or the logdir's."""
        return self._last_restorer

    @property
    def restore_status(self) -> Any:
        return self.last_restorer.restore_status

    # -- restoring -----------------------------------------------------------------------

    def restore_newest(
        self, shared: Callable[[str], bool] | None = None
    ) -> tuple[str | None, list[tuple[str, str]]]:
        """Restore the newest checkpoint that reads back whole (of either tier); with a
        local tier, ``shared`` says whether a local one counts (see ``TwoTiers``)."""
        if self.tiers is not None:
            found = self.tiers.restore_newest(self.restorer, shared)
            local = self.tiers.source == "local"
            self._last_restorer = self.tiers.restorer if local else self.restorer
            return found
        return self.restorer.restore_newest()

    def restore(self, path: str, tier: Tier | None = None) -> None:
        """Restore ``path`` (another worker's choice, of tier ``tier``)."""
        self._last_restorer = self.restorer
        self._read_tier = tier
        self.restorer.restore(path)

    def restored(self, path: str) -> None:
        """The session restored ``path``: the last good checkpoint (of unknown time)."""
        order = self.catalog.names.order(path)
        if order is not None and not self.last_restorer.migrated:  # a foreign number is no step
            self.writer.restored(order[0])
