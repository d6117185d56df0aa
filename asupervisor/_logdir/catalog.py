"""The Catalog: one logdir's history as a session sees it, and the chief's changes to it.

The chief (the holder of the logdir's lock, ``writer``) is the one writer: each change
makes a new ``History`` (``_history``), written down whole, the history first (the
truth: held in memory once it is on disk), then the state file that follows it, before
anything is deleted. A reader beside a live chief reads it again when it looks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import NamedTuple

from .._log import log
from . import statefile
from .history import (
    HISTORY,
    Commit,
    History,
    Kept,
    NameFormat,
    Provenance,
    RollbackKind,
    RollbackRecord,
    index_names,
    load_history,
    load_history_noting,
    mtime_of,
    write_history,
)
from .records import RECORD, Record
from .store import Store

KEEP_GONE = 500  # swept commits remembered (the newest): for readers behind, and names


class LetGo(NamedTuple):
    """A sweep's decision: ``preserved`` stay on disk unlisted, ``gone`` are to be
    deleted; ``last_preserved`` is the time of the last commit kept every N hours."""

    preserved: list[int]
    gone: list[int]
    last_preserved: float


class Catalog:
    """The history of one logdir as a session sees it; the chief (``writer``) changes it,
    each change written down whole (the history, then the state file that follows it)
    before anything is deleted."""

    def __init__(
        self, store: Store, basename: str, *, writer: bool, provenance: Provenance | None = None
    ) -> None:
        self.store = store
        self.names = NameFormat(basename)
        self.writer = writer
        self.provenance = provenance or Provenance()
        self.history = History(basename=basename)
        self.damaged_state: tuple[str, str] | None = None  # (state file, why it was skipped)

    # -- reading ---------------------------------------------------------------------

    def load(self) -> None:
        """Read the logdir's history (or derive it once from an older logdir's files); the
        chief writes it down, and a state file that follows it, unless both were read as
        they are (on an object store that is a dozen requests less at every start). An
        unreadable state file is skipped like a damaged checkpoint (the chief puts it
        aside)."""
        history, state, damage, lost = load_history_noting(self.store, self.names.basename)
        if damage is not None:
            self.damaged_state = statefile.put_aside(self.store, damage, move=self.writer)
        if lost is not None:
            # Read from its second copy, whole; or derived from the state file and the
            # disk: the rollback records and health marks are then gone (said here).
            log.warning(
                "history.damaged",
                path=self.store.path(HISTORY),
                reason=lost.reason,
                read_from=lost.read_from,
                commits=len(history.commits),
            )
        same = (
            not history.derived
            and lost is None
            and damage is None
            and history.basename == self.names.basename
            and state == history.state_file()
        )
        writes = self.writer and history.head is not None and not same
        self.history = replace(
            history, basename=self.names.basename, derived=history.derived and not writes
        )
        if writes:
            self._write(self.history)
            if history.derived:
                self.store.remove(RECORD)  # read into the history: the history is the record

    def reload(self) -> None:
        """A reader beside a live chief: the history as it is now."""
        if not self.writer:
            self.history, _, _ = load_history(self.store, self.names.basename)

    def orphans(self) -> list[str]:
        """The supervisor's own complete checkpoints on disk that no commit names and that
        are newer than the head (a kill came between their files and their commit), newest
        first: a chief's restore may adopt them."""
        history, names = self.history, self.names
        known = {c.name for c in history.commits}
        head = history.head_commit()
        floor = None if head is None else names.order(head.name)
        found = []
        for name in index_names(self.store) - known:
            order = names.order(name)
            if order is not None and (floor is None or order > floor):
                found.append((order, name))
        return [name for _, name in sorted(found, reverse=True)]

    def candidates(self, committed_only: bool) -> list[str]:
        """What a restore tries, in order: orphans newer than the head (not for a reader
        beside a live chief: those may be half written), then the head and the commits
        it descends from, newest first. Never an abandoned commit."""
        line = [c.name for c in self.history.line()]
        return line if committed_only else [*self.orphans(), *line]

    def listed_without_files(self) -> list[str]:
        """Committed checkpoints whose ``.index`` is gone, newest first."""
        disk = index_names(self.store)
        return [c.name for c in self.history.line() if c.name not in disk]

    def next_name(self, step: int) -> str:
        taken = index_names(self.store) | {c.name for c in self.history.commits}
        return self.names.build(step, taken)

    # -- writing ---------------------------------------------------------------------

    def commit(
        self, name: str, record: Record, sweep: Callable[[History], LetGo] | None = None
    ) -> Commit:
        """``name`` (its files on disk, synced) is committed: the new head, a child of the
        old one. ``sweep`` decides, on the history with the commit in it, what leaves the
        list: it does so in the same write (one write of the history and the state file
        per commit, not two; the files let go are deleted after it, by the sweep)."""
        history = self.history
        commit = Commit(
            seq=history.next_seq,
            parent=history.head,
            name=name,
            step=record.step,
            time=record.time,
            healthy=record.healthy,
            metrics=dict(record.metrics),
            branch=len(history.rollbacks),
            foreign=not self.names.is_own(name),
            **asdict(self.provenance),
        )
        commits = tuple(c for c in history.commits if c.name != name)  # names are unique
        history = replace(
            history, commits=(*commits, commit), head=commit.seq, next_seq=commit.seq + 1
        )
        if sweep is not None:
            history = _let_go(history, sweep(history))
        self._change(history)
        return commit

    def adopt(self, names: list[str]) -> None:
        """A restore took ``names[-1]``, an orphan: it and the orphans older than it
        (oldest first) are committed, of unknown health, the last one the head."""
        history = self.history
        commits, head = list(history.commits), history.head
        for seq, name in enumerate(names, start=history.next_seq):
            order = self.names.order(name)
            commits.append(
                Commit(
                    seq=seq,
                    parent=head,
                    name=name,
                    step=None if order is None else order[0],
                    time=mtime_of(self.store, name) or time.time(),
                    branch=len(history.rollbacks),
                    foreign=order is None,
                    **asdict(self.provenance),
                    adopted=True,
                )
            )
            head = seq
        next_seq = history.next_seq + len(names)
        self._change(replace(history, commits=tuple(commits), head=head, next_seq=next_seq))

    def roll_back(
        self,
        to: int,
        *,
        kind: RollbackKind,
        reason: str,
        at_step: int | None = None,
        loss: float | None = None,
        batches_dropped: int = 0,
        position: tuple[int, int] | None = None,
    ) -> RollbackRecord:
        """The head goes back to commit ``to`` (restored): every commit after it on the
        head's line is abandoned, never restored again (and swept by the usual rules).
        A ``fallback`` abandons what the restore skipped as damaged: those whose files
        are still there stay on disk, unlisted (``preserved``), as the run's record, and
        no sweep deletes them."""
        history = self.history
        record = RollbackRecord(
            number=len(history.rollbacks) + 1,
            kind=kind,
            at_step=at_step,
            left=history.head,
            to=to,
            time=time.time(),
            reason=reason,
            loss=loss,
            batches_dropped=batches_dropped,
            **asdict(self.provenance),
            position=position,
        )
        disk = index_names(self.store) if kind == "fallback" else set()
        commits = tuple(
            replace(
                c,
                abandoned_by=record.number,
                kept="preserved" if c.kept == "listed" and c.name in disk else c.kept,
            )
            if c.seq > to and c.abandoned_by is None
            else c
            for c in history.commits
        )
        self._change(
            replace(history, commits=commits, head=to, rollbacks=(*history.rollbacks, record))
        )
        return record

    def judged(self, seq: int, healthy: bool) -> None:
        """A commit's health became known (its state was read back)."""
        commits = tuple(
            replace(c, healthy=healthy) if c.seq == seq else c for c in self.history.commits
        )
        self._change(replace(self.history, commits=commits))

    def mark_foreign(self, seqs: list[int]) -> None:
        """Commits found to be another tool's checkpoints (no global step): restored
        from, never swept, their number not a step."""
        marked = set(seqs)
        commits = tuple(
            replace(c, foreign=True, step=None) if c.seq in marked else c
            for c in self.history.commits
        )
        self._change(replace(self.history, commits=commits))

    def let_go(self, decided: LetGo) -> None:
        """A sweep: ``preserved`` stay on disk unlisted, ``gone`` are to be deleted."""
        self._change(_let_go(self.history, decided))

    def relist(self, seqs: list[int]) -> None:
        """Commits a sweep let go that a reader holds a lease on go back on the list."""
        back = set(seqs)
        commits = tuple(
            replace(c, kept="listed") if c.seq in back else c for c in self.history.commits
        )
        self._change(replace(self.history, commits=commits))

    def _change(self, history: History) -> None:
        self._write(_forget_gone(replace(history, derived=False)))

    def _write(self, history: History) -> None:
        """The history first (it is the truth: held in memory once it is on disk), then
        the state file that follows it."""
        write_history(self.store, history)
        self.history = history
        state = history.state_file()
        if state is not None:
            statefile.write(self.store, state)


def _let_go(history: History, decided: LetGo) -> History:
    """``history`` with a sweep's decision in it (unchanged when it lets nothing go)."""
    if not decided.preserved and not decided.gone:
        return history
    kept: dict[int, Kept] = dict.fromkeys(decided.preserved, "preserved")
    kept.update(dict.fromkeys(decided.gone, "gone"))
    commits = tuple(replace(c, kept=kept[c.seq]) if c.seq in kept else c for c in history.commits)
    return replace(history, commits=commits, last_preserved=decided.last_preserved)


def _forget_gone(history: History) -> History:
    """At most ``KEEP_GONE`` swept commits are remembered (the newest)."""
    gone = [c.seq for c in history.commits if c.kept == "gone"]
    if len(gone) <= KEEP_GONE:
        return history
    forget = set(gone[: len(gone) - KEEP_GONE])
    return replace(history, commits=tuple(c for c in history.commits if c.seq not in forget))
