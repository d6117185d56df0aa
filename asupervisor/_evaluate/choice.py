"""What the sidecar evaluator does next, decided from the history and its results alone.

Pure (no I/O, no TensorFlow): every commit from ``since`` on is evaluated once or
recorded as skipped once, in commit order. One that is gone (swept before it was
evaluated: the chief kept it only within the evaluator's backlog) is skipped; with
``latest_only`` every one but the newest committed is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._logdir.history import Commit, History

BACKLOG = 10  # commits retention keeps for an evaluator that has not seen them yet
SAME_FILE_SECS = 1.0  # index times within this are the same checkpoint (coarse mtimes)


@dataclass(frozen=True)
class Choice:
    evaluate: Commit | None = None
    skip: list[tuple[Commit, str]] = field(default_factory=list)


def seen(
    commit: Commit,
    results: Mapping[str, Mapping[str, Any]],
    history: History,
    written: float | None = None,
) -> bool:
    """Whether the results hold this commit (evaluated or skipped). By its ``seq``; an
    older result without one (or a history derived from an older logdir, whose numbers
    are not the chief's): by name, and by the time its index was written when known (a
    new checkpoint under an old name is another one)."""
    entry = results.get(commit.name)
    if entry is None:
        return False
    if entry.get("seq") is not None and not history.derived:
        return bool(entry["seq"] == commit.seq)
    before = entry.get("written")
    if not isinstance(before, (int, float)) or written is None:
        return True
    return abs(float(before) - written) <= SAME_FILE_SECS


def unseen(
    history: History,
    results: Mapping[str, Mapping[str, Any]],
    since: int,
    written: Mapping[str, float | None] | None = None,
) -> list[Commit]:
    """The commits from ``since`` on that the results do not hold, oldest first."""
    times = written or {}
    return [
        c
        for c in history.commits
        if c.seq >= since and not seen(c, results, history, times.get(c.name))
    ]


def choose(todo: list[Commit], history: History, latest_only: bool, backlog: int) -> Choice:
    """Of the unseen commits ``todo``: which to evaluate next, and which to record as
    skipped now (with why)."""
    skip = [
        (c, f"swept before it was evaluated (past the evaluator's backlog of {backlog})")
        for c in todo
        if not c.on_disk
    ]
    left = [c for c in todo if c.on_disk]
    if latest_only and left:
        newest = history.committed()[-1]
        skip += [(c, "latest_only: a newer checkpoint is committed") for c in left if c != newest]
        left = [c for c in left if c == newest]
    return Choice(left[0] if left else None, skip)


def since_of(
    history: History, results: Mapping[str, Mapping[str, Any]], registered: int | None
) -> int:
    """The first commit an evaluator is to see: where its registration said (unless the
    history began again since), else the oldest it has a result for, else the oldest
    committed now (or the next one)."""
    if registered is not None and registered <= history.next_seq:
        return registered
    seqs = [int(e["seq"]) for e in results.values() if e.get("seq") is not None]
    if seqs and not history.derived and min(seqs) <= history.next_seq:
        return min(seqs)
    committed = history.committed()
    return committed[0].seq if committed else history.next_seq
