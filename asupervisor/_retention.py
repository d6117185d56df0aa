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

Only the supervisor's own checkpoints (``<basename>-<step>[_<n>]``) directly inside the
logdir are ever listed or deleted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ._log import log
from ._logdir import STATE, is_own, own_order, read_state
from ._store import Store


@dataclass(frozen=True)
class Kept:
    name: str  # the checkpoint's prefix, a name inside the logdir
    timestamp: float  # time.time() when it was committed


class Retention:
    """The committed checkpoints of one logdir, and the rules that keep them."""

    def __init__(
        self,
        store: Store,
        basename: str,
        max_to_keep: int | None,
        keep_every_n_hours: float | None,
    ) -> None:
        self.store, self.basename = store, basename
        self.max_to_keep, self.keep_every_n_hours = max_to_keep, keep_every_n_hours
        self._kept: list[Kept] = []  # listed in the state file, oldest first
        self.latest: str | None = None  # the name the state file gives as the latest
        self._last_preserved = time.time() - 1  # as a CheckpointManager over a new directory

    # -- reading ---------------------------------------------------------------------

    def load(self, state: Any = None) -> None:
        """Take the state file as it is on disk (``state``: already read). Foreign
        checkpoints it names are left out: they are never swept."""
        state = read_state(self.store) if state is None else state
        self._kept, self.latest = [], None
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

    def commit(self, name: str) -> list[str]:
        """``name`` (whose files are on disk, synced) becomes the latest: the state file
        names it, then what the rules let go is deleted. Returns the names deleted."""
        self._kept = [k for k in self._kept if k.name != name]
        self._kept.append(Kept(name, time.time()))
        self.latest = name
        self._write_state()
        gone = self._sweep()
        if gone:
            self._write_state()
            for dropped in gone:
                self._delete(dropped)
        return gone

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

    def _sweep(self) -> list[str]:
        """CheckpointManager's rule: beyond ``max_to_keep``, the oldest goes, unless one
        is due to be preserved (every ``keep_checkpoint_every_n_hours``)."""
        gone: list[str] = []
        if self.max_to_keep is None:
            return gone
        while len(self._kept) > self.max_to_keep:
            oldest = self._kept.pop(0)
            every = self.keep_every_n_hours
            if every is not None and oldest.timestamp - every * 3600 >= self._last_preserved:
                self._last_preserved = oldest.timestamp  # kept on disk, no longer listed
                continue
            gone.append(oldest.name)
        return gone

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
        for file in self.store.files_of(name):
            try:
                self.store.remove(file)
            except OSError as exc:  # left behind, not fatal: the state no longer names it
                log.warning("checkpoint.not_deleted", path=self.store.path(file), error=repr(exc))
