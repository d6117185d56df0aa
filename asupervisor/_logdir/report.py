"""What is in a logdir: checkpoints, the latest step, scalar tags, events files.

Used by ``asupervisor inspect``. TensorFlow is imported only when there is a
checkpoint to verify or an events file to verify, or for an object store's logdir:
``--no-verify`` on a local logdir needs none. Any directory is safe to inspect:
files are read through the logdir's store (regular files only, bounded reads, no
symlink followed out of the logdir), so a FIFO, a device or a link loop is reported
as damage instead of hanging or crashing the command.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import events as _events
from . import groups as _groups
from . import heartbeat as _heartbeat
from . import ledger as _ledger
from .files import RUNS, checkpoint_bytes, checkpoint_problem, files_problem
from .history import History, NameFormat, read_history
from .records import read_evaluated
from .store import Store, is_object_store, no_file_system


@dataclass
class CheckpointInfo:
    path: str
    step: int | None  # None: another tool's checkpoint, whose name does not say
    saved: str
    bytes: int
    readable: bool
    problem: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # what its commit recorded
    healthy: bool | None = None  # its loss and saved state were finite (None: not known)
    seq: int | None = None  # its commit in the history (None: no commit names it)


@dataclass
class CommitInfo:
    """One commit of the history, as ``inspect`` shows it."""

    seq: int
    parent: int | None
    name: str
    step: int | None
    branch: int
    kept: str  # listed, preserved, gone
    healthy: bool | None
    abandoned_by: int | None  # the rollback that left it behind
    head: bool
    run: str | None
    attempt: int | None
    session: str | None


@dataclass
class RollbackInfo:
    number: int
    kind: str  # divergence, fallback
    at_step: int | None
    left: str | None  # the head it left behind (its name)
    to: str  # the commit restored (its name)
    abandoned: list[str]  # the commits it left behind
    reason: str
    batches_dropped: int


@dataclass
class TagInfo:
    kind: str  # "scalar", "histogram" or another plugin's name
    points: int = 0
    first_step: int | None = None
    last_step: int | None = None
    last_value: float | None = None


@dataclass
class EventsFileInfo:
    name: str
    bytes: int
    events: int
    damaged: str | None = None


@dataclass
class LogdirReport:
    logdir: str
    latest_checkpoint: str | None
    latest_step: int | None
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    tags: dict[str, TagInfo] = field(default_factory=dict)
    events_files: list[EventsFileInfo] = field(default_factory=list)
    sessions: list[_ledger.SessionRecord] = field(default_factory=list)  # the run ledger
    groups: list[_groups.GroupAttempt] = field(default_factory=list)  # each worker's end
    heartbeat: dict[str, Any] | None = None  # the chief's last beat
    heartbeat_problem: str | None = None
    commits: list[CommitInfo] = field(default_factory=list)  # the history, oldest first
    rollbacks: list[RollbackInfo] = field(default_factory=list)
    history_derived: bool = False  # no history file: derived from an older logdir's files
    # Commits made in the run: more than ``commits`` once the oldest swept ones are
    # forgotten (the history remembers the newest; its sequence counts every one).
    commits_made: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="seconds")


def find_checkpoints(
    store: Store, names: list[str], verify: bool, history: History
) -> list[CheckpointInfo]:
    """Every checkpoint on disk (an ``.index``), with what its commit says, in commit
    order (those no commit names after, by name). ``names`` is the logdir's listing: it
    is listed once, whatever the number of checkpoints."""
    found = []
    evaluated = read_evaluated(store.root)
    own = NameFormat(history.basename)
    newest = {c.name: c for c in history.commits}  # a name's newest commit (by_name's)
    for name in (n[: -len(".index")] for n in names if n.endswith(".index")):
        prefix = store.path(name)
        problem = (
            checkpoint_problem(store, prefix, names)
            if verify
            else files_problem(store, prefix, names)
        )
        try:
            saved = _iso(store.mtime(name + ".index"))
        except OSError:
            saved = "unknown"
        commit = newest.get(name)
        order = own.order(name)
        found.append(
            CheckpointInfo(
                path=prefix,
                step=commit.step if commit else (order[0] if order else None),
                saved=saved,
                bytes=checkpoint_bytes(store, prefix, names),
                readable=problem is None,
                problem=problem,
                metrics={**(commit.metrics if commit else {}), **evaluated.get(name, {})},
                healthy=None if commit is None else commit.healthy,
                seq=None if commit is None else commit.seq,
            )
        )
    last = 1 + max((c.seq or 0 for c in found), default=0)
    return sorted(found, key=lambda c: (c.seq or last, os.path.basename(c.path)))


def history_of(history: History) -> tuple[list[CommitInfo], list[RollbackInfo]]:
    """The history's commits and rollbacks, as ``inspect`` shows them."""
    commits = [
        CommitInfo(
            seq=c.seq,
            parent=c.parent,
            name=c.name,
            step=c.step,
            branch=c.branch,
            kept=c.kept,
            healthy=c.healthy,
            abandoned_by=c.abandoned_by,
            head=c.seq == history.head,
            run=c.run,
            attempt=c.attempt,
            session=c.session,
        )
        for c in history.commits
    ]

    by_seq = {c.seq: c.name for c in history.commits}

    def name(seq: int | None) -> str | None:
        return None if seq is None else by_seq.get(seq)

    left_behind: dict[int, list[str]] = {}
    for c in history.commits:
        if c.abandoned_by is not None:
            left_behind.setdefault(c.abandoned_by, []).append(c.name)
    rollbacks = [
        RollbackInfo(
            number=r.number,
            kind=r.kind,
            at_step=r.at_step,
            left=name(r.left),
            to=name(r.to) or f"#{r.to}",
            abandoned=left_behind.get(r.number, []),
            reason=r.reason,
            batches_dropped=r.batches_dropped,
        )
        for r in history.rollbacks
    ]
    return commits, rollbacks


def _record(
    tags: dict[str, TagInfo], kinds: dict[str, str], event: Any, value: Any, run: str
) -> None:
    plugin = value.metadata.plugin_data.plugin_name
    if plugin:
        kinds[value.tag] = {"scalars": "scalar", "histograms": "histogram"}.get(plugin, plugin)
    kind = kinds.get(value.tag, "scalar" if value.HasField("simple_value") else "other")
    tag = tags.setdefault(run + value.tag, TagInfo(kind))
    tag.points += 1
    tag.first_step = event.step if tag.first_step is None else min(tag.first_step, event.step)
    if tag.last_step is None or event.step >= tag.last_step:
        tag.last_step = event.step
        if kind == "scalar":
            tag.last_value = _scalar(value)


def _scalar(value: Any) -> float:
    """A scalar summary's value: TF 1's ``simple_value``, or TF 2's one-element tensor."""
    if not value.HasField("tensor"):
        return float(value.simple_value)
    from tensorboard.util.tensor_util import make_ndarray

    return float(make_ndarray(value.tensor))


def _records(store: Store, name: str, verify: bool) -> Iterator[bytes]:
    """An events file's records: through TensorFlow's reader when verifying (every
    record's checksum), else read here without TensorFlow (``_logdir/events``)."""
    if verify or not store.local:
        import tensorflow as tf

        for record in tf.data.TFRecordDataset(store.path(name)):
            yield record.numpy()
        return
    fd = os.open(store.path(name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        yield from _events.records(file)


def read_events(
    store: Store,
    names: list[str],
    tags: dict[str, TagInfo],
    run: str = "",
    verify: bool = True,
) -> list[EventsFileInfo]:
    """The events files among ``names``; their tags into ``tags``. ``run``: the
    TensorBoard run's directory (``train/``) before each tag and file name."""
    from tensorboard.compat.proto import event_pb2

    files = []
    for name in sorted(n for n in names if n.startswith("events.out.tfevents.")):
        if store.kind(name) != "file":
            files.append(EventsFileInfo(run + name, 0, 0, "not a regular file inside the logdir"))
            continue
        info = EventsFileInfo(name=run + name, bytes=store.size(name), events=0)
        kinds: dict[str, str] = {}
        try:
            for record in _records(store, name, verify):
                event = event_pb2.Event.FromString(record)
                info.events += 1
                for value in event.summary.value:
                    _record(tags, kinds, event, value, run)
        except Exception as exc:  # a truncated last record: keep what was read
            info.damaged = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"[:200]
        files.append(info)
    return files


def inspect_logdir(logdir: str, verify: bool = True) -> LogdirReport:
    """Read a logdir. Raises FileNotFoundError or NotADirectoryError for a bad path."""
    if is_object_store(logdir):
        import tensorflow as tf

        try:
            is_dir, exists = tf.io.gfile.isdir(logdir), tf.io.gfile.exists(logdir)
        except tf.errors.UnimplementedError as exc:
            raise ValueError(no_file_system(logdir)) from exc
    else:
        is_dir, exists = os.path.isdir(logdir), os.path.exists(logdir)
    if not exists:
        raise FileNotFoundError(f"logdir {logdir!r} does not exist")
    if not is_dir:
        raise NotADirectoryError(f"logdir {logdir!r} is not a directory")
    store = Store(logdir)
    names = sorted(store.names())
    history = read_history(store)
    head = history.head_commit()
    latest = None if head is None else store.path(head.name)
    report = LogdirReport(logdir, latest, history.head_step())
    report.checkpoints = find_checkpoints(store, names, verify, history)
    report.commits, report.rollbacks = history_of(history)
    report.commits_made = max(history.next_seq - 1, len(report.commits))
    report.history_derived = history.derived
    records = _ledger.read(store)
    report.sessions = _ledger.sessions(records)
    report.groups = _groups.groups(records)
    try:
        beat = _heartbeat.read(store.path(_heartbeat.NAME))
        report.heartbeat = None if beat is None else beat.as_dict()
    except (OSError, ValueError) as exc:
        report.heartbeat_problem = f"{type(exc).__name__}: {exc}"[:200]
    report.events_files = _all_events(store, names, report.tags, verify)
    return report


def _all_events(
    store: Store, names: list[str], tags: dict[str, TagInfo], verify: bool
) -> list[EventsFileInfo]:
    """The logdir's own events files, then those of the runs beside them (``fit``'s
    ``train/`` and ``validation/``), whose tags are named with their run's."""
    found: list[tuple[Store, list[str], str]] = [(store, names, "")]
    for run in RUNS:
        if run in names and store.kind(run) == "dir":
            inner = Store(store.path(run))
            found.append((inner, sorted(inner.names()), run + "/"))
    files = []
    for where, inside, prefix in found:
        if any(n.startswith("events.out.tfevents.") for n in inside):
            files += read_events(where, inside, tags, prefix, verify)
    return files
