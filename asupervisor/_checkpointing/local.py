"""The local tier of one session: its saves, its history, its restore, and the mirror.

The session saves into the local tier (``LocalWriter``: a snapshot on the training
thread, the files written and committed by a thread of its own, one write in flight and a
timed save skipped while one runs); each commit is offered to the ``Mirror``, which copies
it into the logdir. The logdir's history stays the run's record; the local tier's is a
history of its own over its few newest commits.

A restore (``TwoTiers.restore_newest``) takes the local tier first when its newest commit
is at least as new as the logdir's head and no rollback of the logdir abandoned it, then
falls back to the logdir as a session without a local tier would; it says which tier it
read (``source``). After a local restore, a commit the logdir lacks is offered to the
mirror. In a multi-worker job a local commit counts only if every worker reads it too
(``shared``, asked by the job's restore agreement: ``_session/startup.py``); otherwise the
logdir's is restored and the local commits after it are set aside.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from .._log import log
from .._logdir.catalog import Catalog
from .._logdir.files import files_problem, remove_unfinished
from .._logdir.history import History, Provenance, index_names, mtime_of
from .._logdir.lock import LogdirLock, WriteGuard
from .._logdir.records import Record
from .._logdir.retention import Facts, Retention
from .._logdir.store import Store
from .mirror import Mirror, record_of
from .restorer import Restorer
from .writer import Writer

if TYPE_CHECKING:
    from .root import SavedRoot
    from .tiers import LocalTier

Tier = Literal["local", "store"]


class LocalCatalog(Catalog):
    """The local tier's history; a new name is one neither tier has used."""

    def __init__(self, store: Store, basename: str, remote: Catalog, **kwargs: Any) -> None:
        super().__init__(store, basename, **kwargs)
        self.remote = remote

    def next_name(self, step: int) -> str:
        taken = (
            index_names(self.store)
            | {c.name for c in self.history.commits}
            | {c.name for c in self.remote.history.commits}
        )
        return self.names.build(step, taken)


class LocalRetention(Retention):
    """The newest ``keep`` local commits, and the ones the mirror still needs."""

    def __init__(self, store: Store, keep: int, mirror: Mirror) -> None:
        super().__init__(store, keep, None)
        self.mirror = mirror

    def keeps(self, facts: Facts) -> set[int]:
        pinned = self.mirror.pinned()
        kept = {c.seq for c in facts.history.commits if c.name in pinned}
        return super().keeps(facts) | kept


class LocalWriter(Writer):
    """Writes the session's saves into the local tier, in the background; each commit
    is offered to the mirror."""

    # Below training still, but not the lowest: a kill loses the interval and the write
    # in flight, and at 19 the write starved behind any other busy process (a standby's
    # imports, another job): 2 s writes of an 8 MB model, 7 s lost at a 2 s interval.
    write_nice = 10

    def __init__(self, *args: Any, mirror: Mirror, together: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mirror = mirror
        # In a multi-worker job every worker takes part in each save: one skipped here
        # alone would leave the others in its collectives. The chief proposes no timed
        # save while a write runs instead (SessionCheckpoints.timed_save); a save agreed
        # or due by steps waits for the write in flight.
        self.together = together

    @property
    def busy(self) -> bool:
        """Whether a local write is in flight."""
        writer = self._writer
        return writer is not None and writer.is_alive()

    def save(self, step: int, record: Record, **kwargs: Any) -> str | None:
        final_or_forced = kwargs.get("final") or kwargs.get("force")
        if self.busy and not final_or_forced and not self.together:
            # One write in flight: a timed save while it runs is skipped, not queued
            # (the next one comes at the next interval).
            log.debug("checkpoint.local_skipped", step=step, writing=self.writing)
            return None
        return super().save(step, record, **kwargs)

    def _commit(self, name: str, record: Record) -> None:
        super()._commit(name, record)
        commit = self.catalog.history.by_name(name)
        if commit is not None:
            self.mirror.committed(name, record_of(commit))

    def _saved(self, step: int, path: str, seconds: float, blocked: float) -> None:
        super()._saved(step, path, seconds, blocked)
        log.debug("checkpoint.local_saved", step=step, steps_at_risk=self.mirror.steps_at_risk())


class TwoTiers:
    """The local tier of one session's logdir, and the mirror behind it."""

    def __init__(
        self,
        tier: LocalTier,
        root: SavedRoot,
        remote: Catalog,
        remote_retention: Retention,
        guard: WriteGuard,
        *,
        logdir: str,
        basename: str,
        durable: bool,
        on_fatal: Any,
        provenance: Provenance | None,
        together: bool = False,
    ) -> None:
        self.tier = tier
        self.directory = tier.tier_dir(logdir)
        self.store = store = Store(self.directory)
        store.make()
        self.remote = remote
        chief = guard.lock is not None
        # A guard of its own: the logdir's checks its lease at each write (on a store, a
        # request), and a local save must cost no round trip to the store, nor wait for
        # one that cannot be reached. The mirror's copies go through the logdir's guard.
        self.lock = LogdirLock(self.directory) if chief else None
        if self.lock is not None:
            self.lock.acquire()  # one session per local tier, as per logdir
        self.guard = WriteGuard(self.lock)
        if chief:
            leftovers = remove_unfinished(store, basename)
            if leftovers:
                log.info("checkpoint.unfinished_removed", paths=leftovers, tier="local")
        self.catalog = LocalCatalog(store, basename, remote, writer=chief, provenance=provenance)
        self.catalog.load()
        self.mirror = Mirror(store, remote, remote_retention, guard, every=tier.mirror_every)
        self.retention = LocalRetention(store, tier.keep, self.mirror)
        self.restorer = Restorer(root, self.catalog, self.guard)
        self.writer = LocalWriter(
            root,
            self.catalog,
            self.retention,
            self.guard,
            async_write=True,
            durable=durable,
            on_fatal=on_fatal,
            mirror=self.mirror,
            together=together,
        )
        self.source: Tier | None = None  # the tier the last restore read

    def close(self) -> None:
        """No copy begins any more (what is left is said); the local lock goes once the
        local write under way, if any, has ended."""
        self.mirror.close()
        self.guard.close()

    # -- restoring -------------------------------------------------------------------

    def _newest_local(self) -> float | None:
        """When the local tier's newest checkpoint was made (its head, or a whole one a
        kill left uncommitted), if it may be restored: one a rollback of the logdir
        abandoned never is."""
        history, abandoned = self.catalog.history, self._abandoned()
        times = [c.time for c in history.line() if c.name not in abandoned][:1]
        times += [t for n in self.catalog.orphans()[:1] if (t := mtime_of(self.store, n))]
        return max(times, default=None)

    def _abandoned(self) -> set[str]:
        return {c.name for c in self.remote.history.abandoned()}

    def restore_newest(
        self, remote: Restorer, shared: Callable[[str], bool] | None = None
    ) -> tuple[str | None, list[tuple[str, str]]]:
        """The local tier's newest checkpoint that reads back whole, when it is at least
        as new as the logdir's head; else the logdir's (as without a local tier).

        ``shared`` (a multi-worker job): asked of the local checkpoint restored, whether
        every worker reads it too; if not, the logdir's is restored, and the local
        commits newer than it are set aside (never restored, never copied)."""
        head = self.remote.history.head_commit()
        newest = self._newest_local()
        skipped: list[tuple[str, str]] = []
        set_aside = False  # a local commit was restored that not every worker reads
        if newest is not None and (head is None or newest >= head.time):
            path, skipped = self.restorer.restore_newest()
            commit = None if path is None else self.catalog.history.by_name(os.path.basename(path))
            if (
                path is not None
                and commit is not None
                and commit.name not in self._abandoned()
                and (head is None or commit.time >= head.time)
            ):
                if shared is None or shared(path):
                    self.source = "local"
                    self._catch_up(commit.name)
                    return path, skipped
                set_aside = True
        path, more = remote.restore_newest()
        self.source = None if path is None else "store"
        if set_aside:
            self._set_aside(None if path is None else os.path.basename(path))
        return path, [*skipped, *more]

    def _set_aside(self, name: str | None) -> None:
        """The job restored the logdir's ``name`` (or nothing) past a local commit not
        every worker could read: the local tier's history goes back to ``name`` (or
        abandons all it holds), so that the commits after it are neither restored nor
        copied, and the next local commits descend from what was restored."""
        self.mirror.drop_pending()
        self.rolled_back(name, reason="not every worker of the job reads the local tier")

    def _catch_up(self, name: str) -> None:
        """After a local restore: the logdir gets the commit restored if it lacks it."""
        have = self.remote.history.by_name(name)
        if have is not None and have.on_disk:
            self.mirror.caught_up(have.step)
            return
        commit = self.catalog.history.by_name(name)
        if commit is not None:
            self.mirror.offer(name, record_of(commit))

    def offer_head(self) -> None:
        """The local head goes to the logdir if it lacks it (the final save)."""
        head = self.catalog.history.head_commit()
        have = None if head is None else self.remote.history.by_name(head.name)
        if head is not None and (have is None or not have.on_disk):
            self.mirror.offer(head.name, record_of(head))

    def rolled_back(self, name: str | None, reason: str | None = None) -> None:
        """The logdir's history went back to ``name``: the local tier's goes back to it
        too, or, without it, abandons every commit it holds."""
        history = self.catalog.history
        target = None if name is None else history.by_name(name)
        if target is None and not history.line():
            return
        to = target.seq if target is not None else 0
        why = reason or f"the logdir rolled back to {name}"
        self.catalog.roll_back(to, kind="divergence", reason=why)

    def path_of(self, name: str) -> str | None:
        """The local copy of ``name`` if the local tier holds it committed, else ``None``."""
        commit = self.catalog.history.by_name(name)
        if commit is None or not commit.on_disk or not self.store.exists(name + ".index"):
            return None
        return self.store.path(name)

    def history(self) -> History:
        return self.catalog.history


# -- a local commit another worker of the job may read ---------------------------------


def offer_of(path: str) -> str:
    """What the chief asks of the other workers about its local checkpoint ``path``: its
    name and the digest of its ``.index`` (which holds every tensor's checksum, so equal
    digests mean the same checkpoint), as JSON."""
    return json.dumps({"name": os.path.basename(path), "index_sha256": _index_digest(path)})


def copy_in(offer: str, directory: str) -> str | None:
    """The checkpoint ``offer`` (``offer_of``) in ``directory``, if it is there whole and
    the same: its path; else ``None`` (another host's local tier, another directory, a
    stale checkpoint of the same name)."""
    wanted = json.loads(offer)
    store = Store(directory)
    path = store.path(wanted["name"])
    try:
        if files_problem(store, path) is not None or not _shards_whole(store, wanted["name"]):
            return None
        return path if _index_digest(path) == wanted["index_sha256"] else None
    except (OSError, ValueError):
        return None


def _shards_whole(store: Store, name: str) -> bool:
    """Every data file its name promises (``.data-00000-of-00002`` and the rest) is there."""
    shards = [f for f in store.files_of(name) if ".data-" in f]
    return bool(shards) and len(shards) == int(shards[0].rsplit("-of-", 1)[1])


def _index_digest(path: str) -> str:
    with open(path + ".index", "rb") as file:  # a local tier is a path on the host
        return hashlib.sha256(file.read()).hexdigest()
