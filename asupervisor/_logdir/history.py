"""One history per logdir: every commit of the run, in order, with its parent; the head.

``<logdir>/.asupervisor.history`` (JSON, one writer: the chief holding the logdir's lock,
replaced whole at each change) is what every part reads to know which checkpoints the
run has, in which order, which is the latest and which are good:

- **Commits.** Each commit has a sequence number (``seq``, the commit order, decided
  once), its ``parent`` (the commit the saved state descends from: the head when it was
  made), its name and step, when it was made, its health (``True``: its loss and the
  state it saved were finite; ``False``: one was not; ``None``: not known, a checkpoint
  adopted from disk or an older logdir's), its metrics, and who made it (the session, and
  ``asupervisor run``'s run and attempt: what the runner reads as an attempt's progress;
  ``adopted``: a restore committed files a kill had left uncommitted, no save of its
  own). ``kept`` says where it is: ``listed`` (named by the state file), ``preserved``
  (kept every N hours: on disk, no longer listed, as ``tf.train.CheckpointManager``
  keeps it) or ``gone`` (swept).
- **The head** is the latest: what a restart restores first, what the state file names
  as ``model_checkpoint_path`` (so ``tf.train.latest_checkpoint`` agrees), never "the
  highest step".
- **Rollbacks.** A rollback moves the head back to the commit it restored: the commits
  after it on the head's line are *abandoned* (``abandoned_by`` is the rollback's number)
  and are never restored again; the next commit starts a new branch from it. The line of
  the head is then exactly the commits not abandoned, in ``seq`` order. A restore that
  falls back past a damaged head is recorded the same way (kind ``fallback``); only
  divergences count against ``max_rollbacks``.
- **Names** (``NameFormat``): the supervisor's own ``<basename>-<step>`` or
  ``<basename>-<step>_<n>`` (a later checkpoint of the same step, never written over an
  earlier one, nor given the name of one the history remembers); any other is foreign
  (``ckpt-1`` from ``tf.train.CheckpointManager``): restored from, never swept.

A logdir written before the history existed (the state file and
``.asupervisor.checkpoints`` only) is read as a history derived once from them
(``derive``); the chief writes it down. Reading a history needs no TensorFlow for a
local logdir (``asupervisor run`` and ``inspect`` read it so).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any, Literal

from . import statefile
from .heartbeat import ENV_ATTEMPT, ENV_RUN
from .records import finite_numbers, read_legacy_records, read_results
from .statefile import StateFile
from .store import Store

HISTORY = ".asupervisor.history"
HISTORY_COPY = HISTORY + ".backup"  # the second copy, written after the first
VERSION = 1
READ_LIMIT = 32 << 20
SEP = (",", ":")  # the history file's JSON: compact
DEFAULT_BASENAME = "model.ckpt"

Kept = Literal["listed", "preserved", "gone"]
RollbackKind = Literal["divergence", "fallback"]


class NameFormat:
    """The one place checkpoint names are built and parsed."""

    def __init__(self, basename: str) -> None:
        self.basename = basename

    def pattern(self, suffix: str = "") -> re.Pattern[str]:
        """``<basename>-<step>`` or ``<basename>-<step>_<n>``, then ``suffix``."""
        return re.compile(re.escape(self.basename) + r"-(\d+)(?:_(\d+))?" + suffix + "$")

    def order(self, name: str) -> tuple[int, int] | None:
        """``(step, n)`` of one of the supervisor's own names, else ``None`` (foreign)."""
        found = self.pattern().match(os.path.basename(name))
        return None if found is None else (int(found[1]), int(found[2] or 0))

    def is_own(self, name: str) -> bool:
        return self.order(name) is not None

    def build(self, step: int, taken: Iterable[str]) -> str:
        """A new name at ``step``: ``<basename>-<step>``, or the next ``_<n>`` after every
        name of that step in ``taken`` (on disk, or remembered by the history)."""
        name = f"{self.basename}-{step}"
        # Only names that begin with this step's are parsed: a history remembers hundreds.
        revisions = [
            order[1]
            for n in taken
            if n.startswith(name) and (order := self.order(n)) is not None and order[0] == step
        ]
        return name if not revisions else f"{name}_{max(revisions) + 1}"


@dataclass(frozen=True)
class Provenance:
    """Who commits: the session's id, and ``asupervisor run``'s run and attempt."""

    session: str | None = None
    run: str | None = None
    attempt: int | None = None

    @classmethod
    def of_session(cls, session: str | None) -> Provenance:
        """A session's, with the run and attempt ``asupervisor run`` gave its process."""
        try:
            attempt: int | None = int(os.environ.get(ENV_ATTEMPT, ""))
        except ValueError:
            attempt = None
        return cls(session, os.environ.get(ENV_RUN) or None, attempt)


@dataclass(frozen=True)
class Commit:
    seq: int
    parent: int | None
    name: str
    step: int | None  # None: a foreign checkpoint's (its name does not say)
    time: float
    healthy: bool | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    kept: Kept = "listed"
    branch: int = 0  # how many rollbacks came before it: its branch
    abandoned_by: int | None = None  # the number of the rollback that left it behind
    foreign: bool = False
    session: str | None = None
    run: str | None = None
    attempt: int | None = None
    adopted: bool = False  # committed by a restore (files a kill left uncommitted): no save

    @property
    def on_disk(self) -> bool:
        """Listed or preserved: its commit stands (its files may still be damaged)."""
        return self.kept != "gone"

    @cached_property
    def json_text(self) -> str:
        """Its entry in the history file, encoded once: a commit never changes (a change
        makes a new one), so a history written at every commit encodes only the new
        entries, not the hundreds it remembers."""
        return _encode(self)


@dataclass(frozen=True)
class RollbackRecord:
    number: int  # 1, 2, ... in the logdir's history
    kind: RollbackKind
    at_step: int | None  # the step that diverged (None: a fallback)
    left: int | None  # the head it left (its seq): it and its line after `to` are abandoned
    to: int  # the commit restored (its seq)
    time: float
    reason: str
    loss: float | None = None
    batches_dropped: int = 0
    session: str | None = None
    run: str | None = None
    attempt: int | None = None
    # The data position (epoch, batch) the rollback moved to, written with the record: a
    # kill before the new branch's first commit must not leave it only in memory.
    position: tuple[int, int] | None = None

    @cached_property
    def json_text(self) -> str:
        """Its entry in the history file, encoded once (as a commit's)."""
        return _encode(self)


def _encode(record: Commit | RollbackRecord) -> str:
    """One entry of the history file: its fields in order, as ``json.dumps`` of the
    dataclass's dict writes them (no deep copy: the values are plain), less those at their
    default, which a reader takes for a missing field (as from an older history). The file
    is written whole and fsynced at every commit, remembering hundreds of swept ones: most
    of their fields are at the default, and writing them doubled its size."""
    return json.dumps(
        {
            f.name: value
            for f in fields(record)
            if not _default(f, value := getattr(record, f.name))
        },
        separators=SEP,
    )


def _default(f: Any, value: Any) -> bool:
    """Whether ``value`` is field ``f``'s default (a field with none is always written)."""
    if f.default is not MISSING:
        return bool(value == f.default and type(value) is type(f.default))
    return f.default_factory is not MISSING and value == f.default_factory()


@dataclass(frozen=True)
class History:
    """One logdir's history at one moment (immutable: the ``Catalog`` makes new ones)."""

    basename: str = DEFAULT_BASENAME
    commits: tuple[Commit, ...] = ()  # in seq order; the newest gone ones too
    head: int | None = None
    rollbacks: tuple[RollbackRecord, ...] = ()
    last_preserved: float = 0.0
    next_seq: int = 1
    derived: bool = False  # made from an older logdir's files, not read from a history

    # -- looking ---------------------------------------------------------------------

    def commit(self, seq: int | None) -> Commit | None:
        for commit in self.commits:
            if commit.seq == seq:
                return commit
        return None

    def by_name(self, name: str) -> Commit | None:
        """The newest commit of ``name`` (a name is reused only after it is forgotten)."""
        for commit in reversed(self.commits):
            if commit.name == name:
                return commit
        return None

    def head_commit(self) -> Commit | None:
        return self.commit(self.head)

    def committed(self) -> list[Commit]:
        """The commits that stand (listed or preserved), oldest first."""
        return [c for c in self.commits if c.on_disk]

    def listed(self) -> list[Commit]:
        """What the state file names, oldest first."""
        return [c for c in self.commits if c.kept == "listed"]

    def line(self) -> list[Commit]:
        """The head and the commits it descends from that stand, newest first."""
        return [c for c in reversed(self.commits) if c.abandoned_by is None and c.on_disk]

    def abandoned(self) -> list[Commit]:
        """The commits rollbacks left behind, oldest first (any ``kept``)."""
        return [c for c in self.commits if c.abandoned_by is not None]

    def newest_healthy(self) -> Commit | None:
        """The last good state on the head's line: the newest known healthy commit (or,
        when none is known healthy, the newest of unknown health)."""
        line = self.line()
        return next((c for c in line if c.healthy is True), None) or next(
            (c for c in line if c.healthy is None and not c.foreign), None
        )

    def rollback_target(
        self, step: int, lookback: int, excluding: Iterable[int] = ()
    ) -> Commit | None:
        """Where a divergence at ``step`` rolls back to: the newest commit on the head's
        line at least ``lookback`` steps before it that is not known to be unhealthy
        (one of unknown health is checked when restored), past ``excluding``."""
        skip = set(excluding)
        for commit in self.line():
            if commit.seq in skip or commit.healthy is False or commit.step is None:
                continue
            if commit.step <= step - lookback:
                return commit
        return None

    def damaged(self) -> set[int]:
        """The commits a restore skipped as damaged (a fallback abandoned them)."""
        fallbacks = {r.number for r in self.rollbacks if r.kind == "fallback"}
        return {c.seq for c in self.commits if c.abandoned_by in fallbacks}

    def pending_position(self) -> tuple[int, int] | None:
        """The data position the newest rollback moved to, while no commit holds it yet
        (the head is still the commit it restored: a kill came before the new branch's
        first commit); ``None`` otherwise."""
        if not self.rollbacks:
            return None
        newest = max(self.rollbacks, key=lambda r: r.number)
        return newest.position if newest.to == self.head else None

    def divergences(self) -> list[RollbackRecord]:
        """The rollbacks of the run after a divergence (what ``max_rollbacks`` counts)."""
        return [r for r in self.rollbacks if r.kind == "divergence"]

    def saved_by(self, run: str, attempt: int) -> list[Commit]:
        """The commits ``asupervisor run``'s ``run`` made in its ``attempt`` by saving
        (any ``kept``, abandoned too; never an orphan a restore adopted): its progress."""
        return [c for c in self.commits if c.run == run and c.attempt == attempt and not c.adopted]

    def head_step(self) -> int | None:
        head = self.head_commit()
        return None if head is None else head.step

    # -- writing it down ---------------------------------------------------------------

    def json_text(self) -> str:
        """The history file's text: the header, then each entry's own encoding (made once
        per entry), so writing it costs a join, not an encoding of every entry."""
        header = {
            "version": VERSION,
            "basename": self.basename,
            "head": self.head,
            "next_seq": self.next_seq,
            "last_preserved": self.last_preserved,
        }
        commits = ",".join(c.json_text for c in self.commits)
        rollbacks = ",".join(r.json_text for r in self.rollbacks)
        head = json.dumps(header, separators=SEP)[:-1]
        return f'{head},"commits":[{commits}],"rollbacks":[{rollbacks}]}}'

    def state_file(self) -> StateFile | None:
        """The state file that follows this history: the listed commits of the
        supervisor's own, oldest first with the head last (whatever it is); ``None`` when
        there is no head. A foreign checkpoint (migrated from) stays in the history, never
        swept, but is not listed beside the head: TF's manager over the logdir sees the
        ``max_to_keep`` the supervisor keeps, as it would its own."""
        head = self.head_commit()
        if head is None:
            return None
        listed = [c for c in self.listed() if c.seq != head.seq and not c.foreign]
        if head.kept == "listed":
            listed.append(head)
        return StateFile(
            latest=head.name,
            listed=tuple(c.name for c in listed),
            timestamps=tuple(c.time for c in listed),
            last_preserved=self.last_preserved,
        )


def _commit_of(raw: Mapping[str, Any]) -> Commit:
    healthy = raw.get("healthy")
    kept = raw.get("kept", "listed")
    if kept not in ("listed", "preserved", "gone"):
        raise ValueError(f"kept {kept!r}")
    return Commit(
        seq=int(raw["seq"]),
        parent=None if raw.get("parent") is None else int(raw["parent"]),
        name=str(raw["name"]),
        step=None if raw.get("step") is None else int(raw["step"]),
        time=float(raw["time"]),
        healthy=None if healthy is None else bool(healthy),
        metrics=finite_numbers(dict(raw.get("metrics") or {})),
        kept=kept,
        branch=int(raw.get("branch", 0)),
        abandoned_by=None if raw.get("abandoned_by") is None else int(raw["abandoned_by"]),
        foreign=bool(raw.get("foreign", False)),
        session=None if raw.get("session") is None else str(raw["session"]),
        run=None if raw.get("run") is None else str(raw["run"]),
        attempt=None if raw.get("attempt") is None else int(raw["attempt"]),
        adopted=bool(raw.get("adopted", False)),
    )


def _rollback_of(raw: Mapping[str, Any]) -> RollbackRecord:
    kind = raw.get("kind", "divergence")
    if kind not in ("divergence", "fallback"):
        raise ValueError(f"kind {kind!r}")
    loss = raw.get("loss")
    position = raw.get("position")
    return RollbackRecord(
        number=int(raw["number"]),
        kind=kind,
        at_step=None if raw.get("at_step") is None else int(raw["at_step"]),
        left=None if raw.get("left") is None else int(raw["left"]),
        to=int(raw["to"]),
        time=float(raw["time"]),
        reason=str(raw.get("reason", "")),
        loss=None if loss is None else float(loss),
        batches_dropped=int(raw.get("batches_dropped", 0)),
        session=None if raw.get("session") is None else str(raw["session"]),
        run=None if raw.get("run") is None else str(raw["run"]),
        attempt=None if raw.get("attempt") is None else int(raw["attempt"]),
        position=None if position is None else (int(position[0]), int(position[1])),
    )


def parse_history(data: bytes) -> History:
    """A history file's contents; ``ValueError`` for a damaged one."""
    raw = json.loads(data)
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        raise ValueError("not a history of this version")
    try:
        commits = tuple(sorted((_commit_of(c) for c in raw["commits"]), key=lambda c: c.seq))
        rollbacks = tuple(_rollback_of(r) for r in raw.get("rollbacks", []))
        head = None if raw.get("head") is None else int(raw["head"])
        next_seq = max(int(raw.get("next_seq", 1)), 1 + max((c.seq for c in commits), default=0))
        return History(
            basename=str(raw.get("basename") or DEFAULT_BASENAME),
            commits=commits,
            head=head,
            rollbacks=rollbacks,
            last_preserved=min(float(raw.get("last_preserved", 0.0)), time.time()),
            next_seq=next_seq,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"a damaged history: {type(exc).__name__}: {exc}") from None


def index_names(store: Store) -> set[str]:
    return {n[: -len(".index")] for n in store.names() if n.endswith(".index")}


def derive(
    store: Store, basename: str, state: StateFile | None, on_disk: set[str] | None = None
) -> History:
    """The history of a logdir that has none (written before it existed, or by another
    tool): the state file's checkpoints in its order (the latest last: the head), each
    with what ``.asupervisor.checkpoints`` recorded; older checkpoints of the supervisor's
    own on disk that it does not list are kept every N hours (written no later than the
    last one kept that way) or leftovers of a sweep a kill cut short (gone: deleted at the
    next sweep); but those newer than every listed one whose files are here are listed
    (the state file names files that are gone: they are what a restore falls back to).
    Newer ones are not in it: complete files a kill left uncommitted, which
    a restore may adopt (``Catalog.orphans``)."""
    names = NameFormat(basename)
    disk = index_names(store) if on_disk is None else on_disk
    records = read_legacy_records(store)
    measured = read_results(store.root)  # the evaluator matches its results by seq
    now = time.time()
    listed: list[tuple[str, float | None]] = []
    last_preserved = now - 1  # as a CheckpointManager over a new directory
    if state is not None:
        last_preserved = min(state.last_preserved, now)
        stamps = list(state.timestamps)
        for i, path in enumerate(state.listed):
            name = store.name_of(path)
            if name is not None and name not in (n for n, _ in listed):
                listed.append((name, min(stamps[i], now) if i < len(stamps) else None))
        latest = store.name_of(state.latest)
        if latest is not None:
            stamp = next((s for n, s in listed if n == latest), None)
            listed = [(n, s) for n, s in listed if n != latest] + [(latest, stamp)]
    head_order = names.order(listed[-1][0]) if listed else None
    older: list[tuple[str, Kept]] = []
    if head_order is not None:
        known = {n for n, _ in listed}
        # The newest listed one of the supervisor's own whose files are here: an unlisted
        # one older than it may be a sweep's leftover; one newer than it, when the state
        # file names only files that are gone, is a whole checkpoint a restore must be
        # able to fall back to (the newest that reads back whole is restored).
        present = [o for n, _ in listed if n in disk and (o := names.order(n)) is not None]
        floor = max(present, default=None)
        for name in sorted(disk - known, key=lambda n: names.order(n) or (0, 0)):
            order = names.order(name)
            if order is None or order >= head_order:
                continue
            if floor is None or order > floor:
                listed = _listed_in_order(listed, name, names)
                continue
            preserved = _maybe_preserved(store, name, last_preserved)
            older.append((name, "preserved" if preserved else "gone"))
    commits: list[Commit] = []
    entries = [(n, k, None) for n, k in older] + [(n, "listed", s) for n, s in listed]
    seq = 0
    for name, kept, stamp in entries:
        # The seq the evaluator's result under this name gives (the history it was
        # matched against is lost), when it keeps the commit order; else the next one.
        result = measured.get(name)
        named = result.get("seq") if result else None
        seq = named if isinstance(named, int) and named > seq else seq + 1
        record = records.get(name)
        order = names.order(name)
        when = stamp if stamp is not None else (record.time if record else mtime_of(store, name))
        commits.append(
            Commit(
                seq=seq,
                parent=commits[-1].seq if commits else None,
                name=name,
                step=order[0] if order is not None else None,
                time=when,
                healthy=None if record is None else record.healthy,
                metrics=dict(record.metrics) if record else {},
                kept=kept,  # type: ignore[arg-type]
                foreign=order is None,
            )
        )
    # A new commit takes a seq no result names: none is taken for one it is not of.
    used = [r["seq"] for r in measured.values() if isinstance(r.get("seq"), int)]
    return History(
        basename=basename,
        commits=tuple(commits),
        head=commits[-1].seq if listed else None,
        last_preserved=last_preserved,
        next_seq=max([seq, *used]) + 1,
        derived=True,
    )


def _listed_in_order(
    listed: list[tuple[str, float | None]], name: str, names: NameFormat
) -> list[tuple[str, float | None]]:
    """``listed`` with ``name`` (of unknown time) before the first of the supervisor's own
    that is newer than it, the head (last) staying last."""
    order = names.order(name)
    assert order is not None
    at = len(listed) - 1
    for i, (other, _) in enumerate(listed[:-1]):
        other_order = names.order(other)
        if other_order is not None and other_order > order:
            at = i
            break
    return [*listed[:at], (name, None), *listed[at:]]


def mtime_of(store: Store, name: str) -> float:
    try:
        return store.mtime(name + ".index")
    except OSError:
        return 0.0


def _maybe_preserved(store: Store, name: str, last_preserved: float) -> bool:
    """Whether ``keep_checkpoint_every_n_hours`` may have kept ``name``: its files were
    written no later than the last checkpoint kept that way."""
    written = mtime_of(store, name)
    return 0 < written <= last_preserved


def _guess_basename(state: StateFile | None, store: Store) -> str:
    """The basename of a logdir's own checkpoints for a reader that was not told it: the
    state file's latest's (``<basename>-<step>[_<n>]``), else the default."""
    if state is not None:
        name = store.name_of(state.latest)
        found = re.match(r"^(.+)-\d+(?:_\d+)?$", name or "")
        if found:
            return found[1]
    return DEFAULT_BASENAME


def read_history(store: Store, basename: str | None = None) -> History:
    """The logdir's history, for any reader (no TensorFlow for a local logdir): the
    history file, or one derived from an older logdir's state file (``derived``); an
    empty one when there is neither."""
    history, _, _ = load_history(store, basename)
    return history


def load_history(
    store: Store, basename: str | None = None
) -> tuple[History, StateFile | None, BaseException | None]:
    """The history, the state file, and why the state file could not be read (``None``:
    it could, or there is none). A damaged history file is read from its second copy, or
    derived again from the rest."""
    history, state, damage, _ = load_history_noting(store, basename)
    return history, state, damage


@dataclass(frozen=True)
class HistoryDamage:
    """Why the history file could not be read, and what was read instead (its second
    copy's name, or ``None``: derived from the state file and the disk)."""

    reason: str
    read_from: str | None


def load_history_noting(
    store: Store, basename: str | None = None
) -> tuple[History, StateFile | None, BaseException | None, HistoryDamage | None]:
    """``load_history``, and what happened to the history file (``None``: it was read,
    or the logdir has no history and no state file: nothing was lost)."""
    state: StateFile | None = None
    damage: BaseException | None = None
    try:
        state = statefile.read(store)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        damage = exc
    reason = None
    for name in (HISTORY, HISTORY_COPY):
        try:
            data = store.read_if_there(name, READ_LIMIT)
            if data is None:
                reason = reason or f"{name} is missing"
                continue
            history = parse_history(data)
        except (OSError, ValueError) as exc:
            reason = reason or f"{name} is damaged: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        note = None if name == HISTORY else HistoryDamage(str(reason), store.path(name))
        return history, state, damage, note
    # Neither copy: what the state file and the disk say is derived again.
    history = derive(store, basename or _guess_basename(state, store), state)
    lost = any(not c.foreign for c in history.commits) or damage is not None
    note = HistoryDamage(str(reason), None) if lost else None
    return history, state, damage, note


def head_step(logdir: str) -> int | None:
    """The step of the logdir's head (its latest commit), from its history, or ``None``
    when it has none (or a foreign one). No TensorFlow for a local logdir: this is what
    ``asupervisor run`` reads to see progress."""
    return read_history(Store(logdir)).head_step()


def write_history(store: Store, history: History) -> None:
    """Both copies, the first first: a kill in between leaves the second one change
    behind, and either one read alone is a whole history. The second is not fsynced: it
    stands in for a first copy removed or overwritten, not for a lost disk cache (the
    first is fsynced), and a commit pays one fsync less for it."""
    data = history.json_text().encode()
    store.write(HISTORY, data)
    store.write(HISTORY_COPY, data, durable=False)
