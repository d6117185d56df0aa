"""What is in a logdir: checkpoints, the latest step, scalar tags, events files.

Used by ``asupervisor inspect``. TensorFlow is imported only when there is a
checkpoint to verify or an events file to read. Any directory is safe to inspect:
files are read through the logdir's store (regular files only, bounded reads, no
symlink followed out of the logdir), so a FIFO, a device or a link loop is reported
as damage instead of hanging or crashing the command.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import heartbeat as _heartbeat
from . import ledger as _ledger
from .files import RUNS, STATE, checkpoint_bytes, checkpoint_problem, files_problem
from .records import read_evaluated, read_records
from .store import Store, is_object_store, no_file_system

_INDEX = re.compile(r"^(?P<base>.+)-(?P<step>\d+)(?:_\d+)?\.index$")


@dataclass
class CheckpointInfo:
    path: str
    step: int
    saved: str
    bytes: int
    readable: bool
    problem: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # what its commit recorded
    healthy: bool | None = None  # its loss was finite (None: no record)


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
    heartbeat: dict[str, Any] | None = None  # the chief's last beat
    heartbeat_problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="seconds")


def _latest_from_state_file(store: Store) -> str | None:
    """The `checkpoint` state file's model_checkpoint_path, read without TensorFlow."""
    try:
        text = store.read(STATE).decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("model_checkpoint_path:"):
            path = line.split(":", 1)[1].strip().strip('"')
            return path if os.path.isabs(path) or "://" in path else store.path(path)
    return None


def find_checkpoints(store: Store, names: list[str], verify: bool) -> list[CheckpointInfo]:
    found = []
    records = read_records(store)
    evaluated = read_evaluated(store.root)
    for name in names:
        match = _INDEX.match(name)
        if match is None:
            continue
        prefix = store.path(name[: -len(".index")])
        problem = checkpoint_problem(store, prefix) if verify else files_problem(store, prefix)
        try:
            saved = _iso(store.mtime(name))
        except OSError:
            saved = "unknown"
        record = records.get(name[: -len(".index")])
        found.append(
            CheckpointInfo(
                path=prefix,
                step=int(match["step"]),
                saved=saved,
                bytes=checkpoint_bytes(store, prefix),
                readable=problem is None,
                problem=problem,
                metrics={
                    **(record.metrics if record else {}),
                    **evaluated.get(name[: -len(".index")], {}),
                },
                healthy=None if record is None else record.healthy,
            )
        )
    return sorted(found, key=lambda c: c.step)


def _record(
    tags: dict[str, TagInfo], kinds: dict[str, str], event: Any, value: Any, run: str
) -> None:
    import tensorflow as tf

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
            array = tf.make_ndarray(value.tensor) if value.HasField("tensor") else None
            tag.last_value = float(value.simple_value if array is None else array)


def read_events(
    store: Store, names: list[str], tags: dict[str, TagInfo], run: str = ""
) -> list[EventsFileInfo]:
    """The events files among ``names``; their tags into ``tags``. ``run``: the
    TensorBoard run's directory (``train/``) before each tag and file name."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    files = []
    for name in sorted(n for n in names if n.startswith("events.out.tfevents.")):
        if store.kind(name) != "file":
            files.append(EventsFileInfo(run + name, 0, 0, "not a regular file inside the logdir"))
            continue
        path = store.path(name)
        info = EventsFileInfo(name=run + name, bytes=store.size(name), events=0)
        kinds: dict[str, str] = {}
        try:
            for record in tf.data.TFRecordDataset(path):
                event = event_pb2.Event.FromString(record.numpy())
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
    latest = _latest_from_state_file(store)
    match = _INDEX.match(os.path.basename(latest) + ".index") if latest else None
    report = LogdirReport(logdir, latest, int(match["step"]) if match else None)
    report.checkpoints = find_checkpoints(store, names, verify)
    report.sessions = _ledger.sessions(_ledger.read(store))
    try:
        beat = _heartbeat.read(store.path(_heartbeat.NAME))
        report.heartbeat = None if beat is None else beat.as_dict()
    except (OSError, ValueError) as exc:
        report.heartbeat_problem = f"{type(exc).__name__}: {exc}"[:200]
    report.events_files = _all_events(store, names, report.tags)
    return report


def _all_events(store: Store, names: list[str], tags: dict[str, TagInfo]) -> list[EventsFileInfo]:
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
            files += read_events(where, inside, tags, prefix)
    return files
