"""What each restart of a run cost, and the run's goodput, from the ledger's facts.

A run is one or more segments: a person who starts it again after it ended done or
preempted (``make demo`` twice) begins a new segment, not a restart, and the time between
the two is no one's loss. Within a segment, every new session is a restart.

Every time is one the ledger recorded: when a session began (restored), when its first
step ended, when the checkpoint it restored had been committed, when it ended. The time
a restart lost runs from the commit of the checkpoint the next session restored to that
session's first step: the steps trained after that commit (thrown away), noticing the
fault, the new process, its imports, the restore, the first step's tracing. Goodput is
the share of the wall time (each segment's first start to its last record) that is not
lost so: the time that went into steps that were kept. A session's own start-up (its
restore and first step) counts as lost too; overlapping losses count once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from .ledger import SessionRecord

_CLEAN = {"done", "preempted"}


@dataclass(frozen=True)
class RestartCost:
    """One restart: the session before it ended, this one began."""

    after: str  # how the session before it ended ("no end recorded": killed)
    reached: int | None  # the step the session before ended at (None: not known)
    restored: int | None  # the step this session began from
    lost_steps: int | None  # steps trained and not kept (None: unknown)
    lost_secs: float | None  # the commit it restored to its first step (None: no step)
    down_secs: float | None  # the end of the one before to its first step (None: not known)


@dataclass(frozen=True)
class Goodput:
    wall_secs: float  # each segment's first start to its newest record, summed
    lost_secs: float  # start-ups and restarts, each second once
    restarts: tuple[RestartCost, ...]
    segments: int = 1  # a person's new starts after a clean end, and the first

    @property
    def fraction(self) -> float:
        return 0.0 if self.wall_secs <= 0 else 1 - self.lost_secs / self.wall_secs


def _epoch(value: object) -> float | None:
    """A ledger time (ISO text or seconds since the epoch) as seconds; ``None`` if not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _after(before: SessionRecord) -> str:
    if before.ended is None:
        return "no end recorded (killed)"
    if before.recorded_by == "runner":  # its process died before its session could say
        return f"killed ({before.exit_status})"
    return f"{before.outcome or '?'} ({before.exit_status})"


def _restart(before: SessionRecord, after: SessionRecord, since: float | None) -> RestartCost:
    first = _epoch(after.first_step_at)
    reached = _int(before.step) if before.ended is not None else None
    restored = _int(after.restored_step)
    ended = _epoch(before.ended)
    lost = None if reached is None or restored is None else max(reached - restored, 0)
    return RestartCost(
        after=_after(before),
        reached=reached,
        restored=restored,
        lost_steps=lost,
        lost_secs=None if first is None or since is None else max(first - since, 0.0),
        down_secs=None if first is None or ended is None else max(first - ended, 0.0),
    )


def _last_time(sessions: list[SessionRecord]) -> float | None:
    times = [
        _epoch(value)
        for s in sessions
        for value in (s.started, s.first_step_at, s.committed_at, s.ended)
    ]
    return max((t for t in times if t is not None), default=None)


def _segments(sessions: list[SessionRecord]) -> list[list[SessionRecord]]:
    """The run's segments, oldest first: a session that a person started again after
    one that ended done or preempted (outside any ``asupervisor run`` of the one before)
    begins a new one. Within a segment each new session is a restart."""
    found: list[list[SessionRecord]] = []
    for session in sessions:
        if found and not _new_segment(found[-1][-1], session):
            found[-1].append(session)
        else:
            found.append([session])
    return found


def _new_segment(before: SessionRecord, after: SessionRecord) -> bool:
    """``after`` is a person's new start, not a restart: the one before ended well, and
    no runner that started it started ``after`` too."""
    ended_well = before.ended is not None and before.outcome in _CLEAN
    return ended_well and (after.run is None or after.run != before.run)


def goodput(sessions: list[SessionRecord]) -> Goodput | None:
    """What the ledger's sessions (oldest first) say; ``None`` without a timed start.

    The wall time is each segment's (``_segments``), from its first session's start to
    its last record: the time between a segment's clean end and a person's next start is
    no one's loss."""
    wall, lost, segments = 0.0, 0.0, 0
    restarts: list[RestartCost] = []
    for segment in _segments(sessions):
        found = _segment_goodput(segment)
        if found is None:
            continue
        wall, lost = wall + found.wall_secs, lost + found.lost_secs
        restarts += found.restarts
        segments += 1
    if not segments:
        return None
    return Goodput(wall, lost, tuple(restarts), segments)


def _segment_goodput(sessions: list[SessionRecord]) -> Goodput | None:
    """One segment's goodput: its restarts, and the time its start-ups and restarts lost."""
    begin, end = _begin(sessions), _last_time(sessions)
    if begin is None or end is None:
        return None
    losses: list[tuple[float, float]] = []  # (from, to): time that made no kept step
    for index, session in enumerate(sessions):
        first, since = _epoch(session.first_step_at), _since(sessions, index, begin)
        if first is not None and since is not None:
            losses.append((since, first))
    last = sessions[-1]
    if last.ended is not None and last.outcome not in _CLEAN:
        # Its steps after its last commit were thrown away with it.
        kept = _epoch(last.committed_at) or _epoch(last.first_step_at)
        ended = _epoch(last.ended)
        if kept is not None and ended is not None:
            losses.append((kept, ended))
    restarts = [r for r in _segment_restarts(sessions, begin) if r is not None]
    return Goodput(max(end - begin, 0.0), _union(losses, begin, end), tuple(restarts))


def restarts_of(sessions: list[SessionRecord]) -> list[RestartCost | None]:
    """Each of the ledger's sessions (oldest first) with the restart that began it, or
    ``None`` where it began a run segment (the run's first start, or a person's new start
    after a clean end: nothing of the session before was lost). Every segment's, timed
    or not: ``goodput`` leaves out a segment with no start it can read."""
    found: list[RestartCost | None] = []
    for segment in _segments(sessions):
        found += _segment_restarts(segment, _begin(segment))
    return found


def _segment_restarts(
    sessions: list[SessionRecord], begin: float | None
) -> list[RestartCost | None]:
    """A segment's sessions' restarts: ``None`` for its first, each other a restart."""
    return [None] + [
        _restart(sessions[i - 1], sessions[i], _since(sessions, i, begin))
        for i in range(1, len(sessions))
    ]


def _begin(sessions: list[SessionRecord]) -> float | None:
    """A segment's start: its first session start that can be read."""
    return next((t for s in sessions if (t := _epoch(s.started)) is not None), None)


def _since(sessions: list[SessionRecord], index: int, begin: float | None) -> float | None:
    """When the time a segment's session lost before its first step began: from the commit
    of what it restored (fresh: from the segment's start ``begin``); a session that restored
    a checkpoint of unknown time loses from its own start."""
    session = sessions[index]
    if index == 0:
        return _epoch(session.started)
    if session.source != "checkpoint":
        return begin
    return _epoch(session.restored_commit_at) or _epoch(session.started)


def _union(spans: list[tuple[float, float]], begin: float, end: float) -> float:
    """The length of the union of ``spans`` within ``[begin, end]``."""
    total, reach = 0.0, begin
    for start, stop in sorted((max(a, begin), min(b, end)) for a, b in spans):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total
