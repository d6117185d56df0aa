"""Which of the supervisor's checkpoints a logdir keeps: small rules over one history.

Each rule looks at the same facts (``Facts``: the history, the leases, the evaluator's
results and registrations) and names the commits it keeps; what a sweep keeps is their
union (Orbax's preservation policies are the model). The rules:

- ``LatestN(max_to_keep)``: the newest ``max_to_keep`` commits on the head's line, as
  ``tf.train.CheckpointManager`` keeps them (commit order, not step order);
- ``KeepBest``: the best ``count`` healthy commits by a metric (what the commit recorded,
  or what the sidecar evaluator measured);
- ``NewestHealthy``: the last good state (the pinned newest healthy commit);
- ``RollbackWindow(lookback)``: every commit a divergence from the next step on could
  roll back to (``Rollback(lookback=...)``'s target, and the ones after it);
- ``Leased``: what a reader holds a lease on;
- ``EvaluatorBacklog``: while an evaluator is registered, the newest ``backlog`` commits
  it has not evaluated yet.

A listed commit no rule keeps leaves the list after each commit. TF's rule then decides
what happens to it: if ``keep_checkpoint_every_n_hours`` has passed since the last one
kept that way (``last_preserved``, carried across sessions), it stays on disk, no longer
listed (``preserved``); otherwise it is deleted. The history and the state file are
written before anything is deleted, so a kill in between leaves files the history calls
gone (deleted at the next sweep), never a state file that names deleted ones. Commits
rollbacks abandoned are kept by no rule but the leases', the evaluator's and
``KeepBest``'s: they go at the next commit, the first of the new branch. Only the
supervisor's own checkpoints (``<basename>-<step>[_<n>]``) directly inside the logdir are
ever deleted; ``max_to_keep=None`` keeps every one.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .catalog import Catalog, LetGo
from .files import delete_checkpoint
from .history import Commit, History
from .leases import Registration, leased, registrations
from .records import Record, read_results
from .store import Store


@dataclass(frozen=True)
class Facts:
    """What every rule sees at one sweep."""

    history: History
    leased: frozenset[str]
    results: Mapping[str, Mapping[str, Any]]  # the evaluator's, by checkpoint name
    evaluators: tuple[Registration, ...]

    def metrics(self, commit: Commit) -> dict[str, float]:
        """A commit's metrics: what it recorded, then what the evaluator measured on it."""
        result = self.results.get(commit.name)
        measured = result.get("metrics", {}) if result and _same(result, commit) else {}
        return {**commit.metrics, **measured}


def _same(result: Mapping[str, Any], commit: Commit) -> bool:
    """Whether the evaluator's result under a commit's name is of that commit."""
    seq = result.get("seq")
    return seq is None or seq == commit.seq


class Rule(Protocol):
    def keeps(self, facts: Facts) -> set[int]:
        """The ``seq`` of each commit this rule keeps."""
        ...


@dataclass(frozen=True)
class LatestN:
    count: int

    def keeps(self, facts: Facts) -> set[int]:
        own = [c for c in facts.history.line() if c.kept == "listed" and not c.foreign]
        return {c.seq for c in own[: self.count]}


class KeepBest:
    """Keep the ``count`` best checkpoints by ``metric`` (``mode``: ``"min"`` or ``"max"``),
    beside the newest ``max_to_keep``. The metric is what the commit recorded (a step's
    result, ``fit``'s epoch logs, ``save_checkpoint(metrics=...)``) or what the sidecar
    evaluator measured on the checkpoint later. A commit known to be unhealthy is never
    the best. Only a strictly better value is a new best: of equal ones, the earlier
    commit is kept.

    ``export``, a callable given a new, empty directory: called on the training thread
    right after a checkpoint that is the best so far (by the metric its commit recorded)
    is committed, with the model in that checkpoint's state, to write the model for
    serving there (``lambda path: model.export(path)`` for a SavedModel,
    ``lambda path: model.save(os.path.join(path, "model.keras"))``). Each export is
    ``<logdir>/best/<step>``, renamed into place once ``export`` returned (whole or not
    at all); the exports of the ``count`` best stay, the others are removed
    (``_logdir/exports.py``). It needs a local or mounted logdir and synchronous saves."""

    def __init__(
        self,
        metric: str,
        mode: str = "min",
        count: int = 1,
        export: Callable[[str], object] | None = None,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty string, not {metric!r}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"count must be an int >= 1, not {count!r}")
        self.metric: str = metric
        self.mode: str = mode
        self.count: int = int(count)
        if export is not None and not callable(export):
            raise ValueError(
                f"export must be a callable given a directory, or None, not {export!r}"
            )
        self.export: Callable[[str], object] | None = export

    def __repr__(self) -> str:
        return f"KeepBest({self.metric!r}, mode={self.mode!r}, count={self.count})"

    def keeps(self, facts: Facts) -> set[int]:
        scored = []
        damaged = facts.history.damaged()  # unreadable: never the best
        for commit in facts.history.committed():
            value = facts.metrics(commit).get(self.metric)
            if value is not None and commit.healthy is not False and commit.seq not in damaged:
                scored.append((-value if self.mode == "max" else value, commit.seq))
        # Best first; on a tie the earlier commit (Orbit's rule, in both modes): only a
        # strictly better value is a new best.
        scored.sort()
        return {seq for _, seq in scored[: self.count]}


@dataclass(frozen=True)
class NewestHealthy:
    def keeps(self, facts: Facts) -> set[int]:
        commit = facts.history.newest_healthy()
        return set() if commit is None else {commit.seq}


@dataclass(frozen=True)
class RollbackWindow:
    """``Rollback(lookback=N)``: a divergence at the next step goes back to the newest
    healthy commit at least N steps before it, and one later to a later commit: all of
    those, from that target to the head, are kept."""

    lookback: int

    def keeps(self, facts: Facts) -> set[int]:
        history = facts.history
        step = history.head_step()
        if step is None:
            return set()
        target = history.rollback_target(step + 1, self.lookback)
        if target is None:
            return set()
        return {
            c.seq
            for c in history.line()
            if c.seq >= target.seq and c.healthy is not False and c.step is not None
        }


@dataclass(frozen=True)
class Leased:
    def keeps(self, facts: Facts) -> set[int]:
        return {c.seq for c in facts.history.committed() if c.name in facts.leased}


@dataclass(frozen=True)
class EvaluatorBacklog:
    """The sidecar evaluator sees every commit once: while it is registered, the newest
    ``backlog`` commits it has not evaluated (nor recorded as skipped) stay."""

    def keeps(self, facts: Facts) -> set[int]:
        keep: set[int] = set()
        for reg in facts.evaluators:
            unseen = [
                c
                for c in facts.history.committed()
                if c.seq >= reg.since and not _seen(facts.results.get(c.name), c)
            ]
            keep.update(c.seq for c in unseen[max(0, len(unseen) - reg.backlog) :])
        return keep


def _seen(result: Mapping[str, Any] | None, commit: Commit) -> bool:
    return result is not None and _same(result, commit)


class Retention:
    """The rules one session sweeps its logdir by (built once from its settings)."""

    def __init__(
        self,
        store: Store,
        max_to_keep: int | None,
        keep_every_n_hours: float | None,
        keep_best: KeepBest | None = None,
        lookback: int | None = None,
    ) -> None:
        self.store = store
        self.max_to_keep, self.keep_every_n_hours = max_to_keep, keep_every_n_hours
        rules: list[Rule] = [NewestHealthy(), Leased(), EvaluatorBacklog()]
        if max_to_keep is not None:
            rules.append(LatestN(max_to_keep))
        if keep_best is not None:
            rules.append(keep_best)
        if lookback is not None:
            rules.append(RollbackWindow(lookback))
        self.rules = tuple(rules)

    def facts(self, history: History) -> Facts:
        listing = self.store.names()  # one listing for the leases and the registrations
        evaluators = tuple(registrations(self.store, listing))
        need_results = evaluators or any(isinstance(r, KeepBest) for r in self.rules)
        return Facts(
            history=history,
            leased=frozenset(leased(self.store, listing)),
            results=read_results(self.store.root) if need_results else {},
            evaluators=evaluators,
        )

    def keeps(self, facts: Facts) -> set[int]:
        keep: set[int] = set()
        for rule in self.rules:
            keep |= rule.keeps(facts)
        return keep

    def sweep(self, catalog: Catalog) -> list[str]:
        """After a commit: what no rule keeps leaves the list (kept every N hours, or
        deleted once the history and the state file say so). Returns the names deleted."""
        decided = self.decide(catalog.history)
        if decided.preserved or decided.gone:
            catalog.let_go(decided)
        return self._after_let_go(catalog, decided.gone)

    def commit(self, catalog: Catalog, name: str, record: Record) -> list[str]:
        """Commit ``name`` and sweep, the history and the state file written once for
        both (a commit's cost is one write, whatever the sweep lets go). Returns the names
        deleted."""
        decisions: list[LetGo] = []

        def decide(history: History) -> LetGo:
            decisions.append(self.decide(history))
            return decisions[-1]

        catalog.commit(name, record, sweep=decide)
        return self._after_let_go(catalog, decisions[-1].gone)

    def decide(self, history: History) -> LetGo:
        """What leaves the list of ``history``: what no rule keeps."""
        if self.max_to_keep is None:
            return LetGo([], [], history.last_preserved)
        return self._let_go(history, self.keeps(self.facts(history)))

    def _after_let_go(self, catalog: Catalog, gone: list[int]) -> list[str]:
        """Once the history that lets ``gone`` go is written: the leased ones go back on
        the list, the files of the rest are deleted."""
        listing = self.store.names()  # made after the write: the leases' protocol
        if gone:
            self._relist_leased(catalog, gone, listing)
        return self._delete_gone(catalog.history, listing)

    def _let_go(self, history: History, keep: set[int]) -> LetGo:
        """TF's rule for each listed commit no rule keeps, oldest first: kept on disk,
        unlisted, if ``keep_checkpoint_every_n_hours`` has passed since the last one kept
        that way (an abandoned one never is); else gone."""
        every, last = self.keep_every_n_hours, history.last_preserved
        preserved, gone = [], []
        for commit in history.listed():
            if commit.foreign or commit.seq in keep:
                continue
            if (
                every is not None
                and commit.abandoned_by is None
                and commit.time - every * 3600 >= last
            ):
                preserved.append(commit.seq)
                last = commit.time
            else:
                gone.append(commit.seq)
        return LetGo(preserved, gone, last)

    def _relist_leased(self, catalog: Catalog, gone: list[int], listing: list[str]) -> None:
        """Leases read again *after* the state file stopped listing ``gone``: a reader
        writes its lease, then checks that its checkpoint is still committed, so one that
        saw it committed has a lease this read sees. Those go back on the list (a later
        sweep lets them go once the lease is gone)."""
        held = leased(self.store, listing)
        back = [seq for seq in gone if (c := catalog.history.commit(seq)) and c.name in held]
        if back:
            catalog.relist(back)

    def _delete_gone(self, history: History, listing: list[str]) -> list[str]:
        """The files of every commit the history calls gone that are still on disk (this
        sweep's, and those a kill in the middle of an earlier one left); ``listing``: the
        logdir's, made after the history that calls them gone was written."""
        on_disk = set(listing)
        standing = {c.name for c in history.committed()}
        deleted = []
        for commit in history.commits:
            if commit.kept != "gone" or commit.foreign or commit.name in standing:
                continue
            if commit.name + ".index" in on_disk:
                delete_checkpoint(self.store, commit.name, on_disk)  # failures: left, logged
                deleted.append(commit.name)
        return deleted
