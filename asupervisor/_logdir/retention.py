"""Which of the supervisor's checkpoints a logdir keeps, and the state file that names them.

The rules are ``tf.train.CheckpointManager``'s, owned here instead of borrowed from its
private members:

- the state file (``checkpoint``, TF's format: ``tf.train.latest_checkpoint`` reads it)
  lists the kept checkpoints oldest first, each with the time it was committed, and the
  latest; it is replaced whole (written aside, fsynced, renamed);
- beyond ``max_to_keep`` the oldest listed one goes, unless ``keep_checkpoint_every_n_hours``
  has passed since the last one kept that way: then it stays on disk, no longer listed
  (``last_preserved_timestamp`` in the state file carries this across sessions);
- the state file is written before anything is deleted, so a kill in between leaves
  extra files, never a state file that names deleted ones.

And rules TF's manager has not, kept in union with those: the best ``count`` by a metric
(``KeepBest``: the metrics each commit recorded, or the sidecar evaluator's), the newest
healthy checkpoint (the one a rollback goes back to), and any checkpoint a reader holds a
lease on (``_leases``). A checkpoint these keep stays listed beside the newest
``max_to_keep``. Each commit's metrics and health are recorded beside the state file
(``_records``), for the next session and ``asupervisor inspect``.

Only the supervisor's own checkpoints (``<basename>-<step>[_<n>]``) directly inside the
logdir are ever listed or deleted.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from typing import Any

from .._log import log
from .files import STATE, is_own, own_order, read_state
from .leases import leased
from .records import Record, read_evaluated, read_records, write_records
from .store import Store

_UNKNOWN = Record(step=-1, time=0.0)  # a checkpoint no commit recorded: healthy, no metrics


@dataclass(frozen=True)
class Kept:
    name: str  # the checkpoint's prefix, a name inside the logdir
    timestamp: float  # time.time() when it was committed


class KeepBest:
    """Keep the ``count`` best checkpoints by ``metric`` (``mode``: ``"min"`` or ``"max"``),
    beside the newest ``max_to_keep``. The metric is what the commit recorded (a step's
    result, ``fit``'s epoch logs, ``save_checkpoint(metrics=...)``) or what the sidecar
    evaluator measured on the checkpoint later."""

    def __init__(self, metric: str, mode: str = "min", count: int = 1) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty string, not {metric!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"count must be an int >= 1, not {count!r}")
        self.metric: str = metric
        self.mode: str = mode
        self.count: int = int(count)

    def __repr__(self) -> str:
        return f"KeepBest({self.metric!r}, mode={self.mode!r}, count={self.count})"

    def best(self, metrics: dict[str, dict[str, float]]) -> list[str]:
        """The names of the best ``count``, best first, among those with the metric."""
        scored = [(m[self.metric], name) for name, m in metrics.items() if self.metric in m]
        scored.sort(reverse=self.mode == "max")
        return [name for _, name in scored[: self.count]]


class Retention:
    """The committed checkpoints of one logdir, and the rules that keep them."""

    def __init__(
        self,
        store: Store,
        basename: str,
        max_to_keep: int | None,
        keep_every_n_hours: float | None,
        keep_best: KeepBest | None = None,
    ) -> None:
        self.store, self.basename = store, basename
        self.max_to_keep, self.keep_every_n_hours = max_to_keep, keep_every_n_hours
        self.keep_best = keep_best
        self._kept: list[Kept] = []  # listed in the state file, oldest first
        self.latest: str | None = None  # the name the state file gives as the latest
        self._last_preserved = time.time() - 1  # as a CheckpointManager over a new directory
        self.records: dict[str, Record] = {}  # what each commit recorded, by name

    # -- reading ---------------------------------------------------------------------

    def load(self, state: Any = None) -> None:
        """Take the state file as it is on disk (``state``: already read). Foreign
        checkpoints it names are left out: they are never swept."""
        state = read_state(self.store) if state is None else state
        self._kept, self.latest = [], None
        self.records = read_records(self.store)
        now = time.time()
        if state is None:
            self._last_preserved = now - 1
            return
        # As CheckpointManager: a clock that went backwards does not preserve forever.
        self._last_preserved = min(state.last_preserved_timestamp, now)
        stamps = list(state.all_model_checkpoint_timestamps)
        for i, path in enumerate(state.all_model_checkpoint_paths):
            name = self.store.name_of(path)
            if name is None or not is_own(name, self.basename):
                continue
            stamp = min(stamps[i], now) if i < len(stamps) else now
            self._kept.append(Kept(name, stamp))
        latest = self.store.name_of(state.model_checkpoint_path)
        self.latest = latest if latest is not None and is_own(latest, self.basename) else None

    @property
    def last_preserved(self) -> float:
        """The time of the newest checkpoint kept every N hours (``time.time()``): an
        unlisted checkpoint no newer than this may be one, and is never swept."""
        return self._last_preserved

    def names(self) -> list[str]:
        """The kept checkpoints' names, oldest first."""
        return [k.name for k in self._kept]

    def next_name(self, step: int) -> str:
        """The name of a new checkpoint at ``step``: ``<basename>-<step>``, or the next
        ``_<n>`` after it when a checkpoint of that step is already on disk."""
        name = f"{self.basename}-{step}"
        taken = [
            own_order(n[: -len(".index")], self.basename)
            for n in self.store.names()
            if n.endswith(".index")
        ]
        revisions = [order[1] for order in taken if order is not None and order[0] == step]
        return name if not revisions else f"{name}_{max(revisions) + 1}"

    # -- writing ---------------------------------------------------------------------

    def commit(self, name: str, record: Record | None = None) -> list[str]:
        """``name`` (whose files are on disk, synced) becomes the latest: the state file
        names it, then what the rules let go is deleted, then the records are written.
        Returns the names deleted."""
        self._kept = [k for k in self._kept if k.name != name]
        self._kept.append(Kept(name, time.time()))
        self.latest = name
        if record is not None:
            self.records[name] = record
        self._write_state()
        gone = self._sweep()
        if gone:
            self._write_state()
            gone = self._relist_leased(gone)
            for dropped in gone:
                self.records.pop(dropped.name, None)
                self._delete(dropped.name)
        self._write_records()
        return [k.name for k in gone]

    def _relist_leased(self, gone: list[Kept]) -> list[Kept]:
        """Leases read again *after* the state file stopped listing ``gone``: a reader
        writes its lease, then checks that its checkpoint is still listed, so one that
        saw it listed has a lease this read sees. Those go back on the list (a later
        sweep deletes them once the lease is gone); the rest are returned, to delete."""
        held = leased(self.store)
        back = [k for k in gone if k.name in held]
        if not back:
            return gone
        self._kept.extend(back)
        self._kept.sort(key=lambda k: own_order(k.name, self.basename) or (0, 0))
        self._write_state()
        return [k for k in gone if k.name not in held]

    def metrics(self) -> dict[str, dict[str, float]]:
        """Each listed checkpoint's metrics: the commit's, then the evaluator's over them."""
        evaluated = read_evaluated(self.store.root)
        return {
            k.name: {**self.records.get(k.name, _UNKNOWN).metrics, **evaluated.get(k.name, {})}
            for k in self._kept
        }

    def newest_healthy(self) -> str | None:
        """The newest listed checkpoint whose commit recorded a finite loss (or no loss)."""
        for kept in reversed(self._kept):
            if self.records.get(kept.name, _UNKNOWN).healthy:
                return kept.name
        return None

    def protected(self) -> set[str]:
        """What no sweep deletes: the best by the metric, the newest healthy checkpoint,
        and what readers hold leases on."""
        keep = leased(self.store)
        healthy = self.newest_healthy()
        if healthy is not None:
            keep.add(healthy)
        if self.keep_best is not None:
            keep.update(self.keep_best.best(self.metrics()))
        return keep

    def adopt(self, names: list[str]) -> None:
        """The chief restored ``names[-1]`` (checkpoints on disk, oldest first, that the
        state file does not list: a kill came between their files and the state file):
        they are listed, with their files' times, so that retention counts them."""
        listed = set(self.names())
        for name in names:
            if name not in listed:
                self._kept.append(Kept(name, self.store.mtime(name + ".index")))
        self._kept.sort(key=lambda k: own_order(k.name, self.basename) or (0, 0))
        self.latest = names[-1]
        self._write_state()

    def _sweep(self) -> list[Kept]:
        """CheckpointManager's rule: beyond ``max_to_keep``, the oldest goes (off the
        list; returned), unless one is due to be preserved (every
        ``keep_checkpoint_every_n_hours``); in union with what ``protected`` keeps
        (listed)."""
        gone: list[Kept] = []
        if self.max_to_keep is None:
            return gone
        protected = self.protected()
        beyond = self._kept[: max(0, len(self._kept) - self.max_to_keep)]  # oldest first
        for oldest in beyond:
            if oldest.name in protected:
                continue  # kept, and listed
            self._kept.remove(oldest)
            every = self.keep_every_n_hours
            if every is not None and oldest.timestamp - every * 3600 >= self._last_preserved:
                self._last_preserved = oldest.timestamp  # kept on disk, no longer listed
                continue
            gone.append(oldest)
        return gone

    def _write_records(self) -> None:
        listed = {k.name for k in self._kept}
        write_records(self.store, {n: r for n, r in self.records.items() if n in listed})

    def _write_state(self) -> None:
        from google.protobuf import text_format
        from tensorflow.python.checkpoint import checkpoint_management

        state = checkpoint_management.CheckpointState(
            model_checkpoint_path=self.latest or "",
            all_model_checkpoint_paths=self.names(),
            all_model_checkpoint_timestamps=[k.timestamp for k in self._kept],
            last_preserved_timestamp=self._last_preserved,
        )
        self.store.write(STATE, text_format.MessageToString(state).encode())
        self.store.sync([])  # the rename into place is durable

    def _delete(self, name: str) -> None:
        # The index first: a kill in between leaves a data file no index names (removed
        # at the chief's next start), never an index whose data is gone.
        for file in sorted(self.store.files_of(name), key=lambda n: not n.endswith(".index")):
            try:
                self.store.remove(file)
            except OSError as exc:  # left behind, not fatal: the state no longer names it
                log.warning("checkpoint.not_deleted", path=self.store.path(file), error=repr(exc))
