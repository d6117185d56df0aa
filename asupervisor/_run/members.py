"""One history, many hosts: the group's attempts of a job whose hosts each run one
``asupervisor run`` (a JobSet's or a TFJob's pods), folded into the chief's ledger.

No process there started every worker, so none knows how each ended. Each member records
its own end in the logdir as a fact (``.asupervisor.member-host-<rank>-<run>``, the same
``MemberEnd`` a ``--slurm`` task writes); the chief's member, which alone writes the
ledger, folds them into one ``group_attempt`` line (``_logdir/groups``):

- at its own end, having waited (bounded) for every member's record;
- at its start, the records an earlier attempt left (its chief was killed with its pod):
  one line for them, the chief's end missing.

A member also records that a stop reached it (``.stopping``), in case it is killed before
its end; its end, when it comes, wins. A folded record leaves a mark (``.folded``), so an
end that comes after its member's stop was folded is dropped, not taken for an attempt.

The first to fail is the cause ``group_status`` names, from the records alone; their times
are each host's own clock.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping

from .._logdir import groups as _groups
from .._logdir import ledger as _ledger
from .._logdir.store import Store
from .slurm import MEMBER_PREFIX, MemberEnd, cause_rank, group_status

HOST_PREFIX = f"{MEMBER_PREFIX}host-"
STOPPING = ".stopping"  # a member's record of its stop, which its end replaces
FOLDED = ".folded"  # the mark a folded record leaves
LEFT_NO_END = "left no end (its host or its run was lost)"
# A member's record (rank, run), its record of a stop, or the mark of a folded one; never
# a record being written (``Store.write``'s temporary name beside it).
_RECORD = re.compile(
    rf"{re.escape(HOST_PREFIX)}\d+-[^.]+(?:{re.escape(STOPPING)}|{re.escape(FOLDED)})?"
)


def rank_in(tf_config: str) -> tuple[int, int] | None:
    """This task's rank among the workers its ``TF_CONFIG`` names, and how many there are
    (the chief first, as MultiWorkerMirroredStrategy ranks them); ``None`` unless it names
    more than one task and this one among them."""
    try:
        found = json.loads(tf_config)
        cluster, task = found["cluster"], found["task"]
        kind, index = str(task["type"]), int(task["index"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(cluster, dict):
        return None
    chiefs = len(cluster.get("chief") or [])
    workers = len(cluster.get("worker") or [])
    if chiefs + workers < 2:
        return None
    if kind == "chief" and index < chiefs:
        return index, chiefs + workers
    if kind == "worker" and index < workers:
        return chiefs + index, chiefs + workers
    return None


def host_member(env: Mapping[str, str]) -> tuple[int, int] | None:
    """This run as one member of a job across hosts that no outer run started: its rank
    and the job's worker count, from ``TF_CONFIG``."""
    return rank_in(env.get("TF_CONFIG", ""))


def record_name(rank: int, run: str, stopping: bool = False) -> str:
    """A member's record: its end, or (``stopping``) the one it writes as the stop reaches
    it, in case it is killed before its end (which then wins)."""
    return f"{HOST_PREFIX}{rank}-{run}{STOPPING if stopping else ''}"


def write(logdir: str, run: str, end: MemberEnd, stopping: bool = False) -> None:
    """This member's end into the logdir (blocking I/O: a worker thread)."""
    store = Store(logdir)
    store.make()  # a worker that failed before its session made the logdir
    store.write(record_name(end.rank, run, stopping), end.to_json())


def _looked(store: Store) -> tuple[dict[str, MemberEnd], dict[str, MemberEnd], set[str]]:
    """The members' ends, their records of a stop, and the records already folded, each
    by its record's name without suffix."""
    ends: dict[str, MemberEnd] = {}
    stops: dict[str, MemberEnd] = {}
    folded = set()
    for name in store.names():
        if not _RECORD.fullmatch(name):  # not ours, or a write's temporary name
            continue
        if name.endswith(FOLDED):
            folded.add(name.removesuffix(FOLDED))
            continue
        base = name.removesuffix(STOPPING)
        try:
            (stops if base != name else ends)[base] = MemberEnd.from_json(store.read(name))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours: left for a later fold
    return ends, stops, folded


def fold(
    logdir: str,
    run: str,
    tasks: int,
    wait_tries: int,
    pause_secs: float,
    facts: Mapping[str, object] | None = None,
) -> _groups.GroupAttempt | None:
    """The members' records in ``logdir`` as one group line, appended to its ledger
    (blocking I/O: a worker thread). Looks ``wait_tries`` times, a pause apart, until
    every one of the ``tasks`` ranks has its end; then folds what there is (a member that
    recorded only its stop: killed before its end; a rank with neither: its host or its
    run was lost). ``None``: nothing to fold.

    A folded record is replaced by a mark (``.folded``): an end that comes after the fold
    took the member's record of its stop is removed with it, never folded as an attempt of
    its own. A chief's end (``wait_tries`` > 1) removes the marks found as it began: those
    of the attempt before, whose members have all ended since."""
    store = Store(logdir)
    ends, stops, folded = _looked(store)
    old_marks = set(folded)
    for _ in range(1, max(1, wait_tries)):
        if {e.rank for b, e in ends.items() if b not in folded} >= set(range(tasks)):
            break
        time.sleep(pause_secs)
        ends, stops, folded = _looked(store)
        folded |= old_marks
    for base in folded & (set(ends) | set(stops)):  # came after their member was folded
        for name in (base, base + STOPPING):
            store.remove(name)
    taken = {b: e for b, e in {**stops, **ends}.items() if b not in folded}
    group = _group(store, run, tasks, list(taken.values()), facts or {}) if taken else None
    for base in taken:
        store.write(base + FOLDED, b"", durable=False)
        for name in (base, base + STOPPING):
            store.remove(name)
    if wait_tries > 1:
        for base in old_marks:
            store.remove(base + FOLDED)
    return group


def fold_lost_steps(
    logdir: str, tasks: int, facts: Mapping[str, object] | None = None
) -> list[_groups.GroupAttempt]:
    """``--slurm``: the records of steps whose outer run was ended before it read them (SLURM
    ends the batch script with a lost node, then requeues it), one group line each, oldest
    first; called at the next outer run's start (blocking I/O: a worker thread). An outer
    run removes its step's records once it has written the step's line, so a record left
    here is of an attempt no group line holds yet (or it came late, or its removal failed:
    then it is only removed).
    The requeue that started this run came after that attempt, so its line carries the
    restart count before this run's."""
    store = Store(logdir)
    found: dict[str, list[tuple[str, MemberEnd]]] = {}
    for name in store.names():
        if not name.startswith(MEMBER_PREFIX) or name.startswith(HOST_PREFIX):
            continue
        base, _, rank = name.rpartition("-")
        if not rank.isdigit():
            continue
        try:
            found.setdefault(base, []).append((name, MemberEnd.from_json(store.read(name))))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
    earlier = dict(facts or {})
    restart = earlier.get("slurm_restart")
    if isinstance(restart, int) and restart > 0:
        earlier["slurm_restart"] = restart - 1
    # A record that came after its outer run had read its step's (and written the line)
    # is late, not an attempt of its own.
    written = {(g.run, str(g.attempt)) for g in _groups.groups(_ledger.read(store))}
    folded = []
    for base, records in sorted(found.items(), key=lambda item: min(e.at for _, e in item[1])):
        run, _, attempt = base.removeprefix(MEMBER_PREFIX).rpartition("-")
        if (run, attempt) not in written:
            folded.append(_group(store, run, tasks, [end for _, end in records], earlier))
        for name, _ in records:
            store.remove(name)
    return folded


def _group(
    store: Store, run: str, tasks: int, found: list[MemberEnd], facts: Mapping[str, object]
) -> _groups.GroupAttempt:
    """The group line of one attempt's recorded ends, appended to the ledger."""
    by_rank: dict[int, MemberEnd] = {}
    for end in sorted(found, key=lambda e: e.at):
        by_rank[end.rank] = end  # one per rank: its newest
    ends = list(by_rank.values())
    status, cause = group_status(ends, tasks, max(e.status for e in ends))
    first = cause_rank(ends, tasks, status)
    workers = worker_ends(by_rank, tasks, first, LEFT_NO_END)
    group = _groups.GroupAttempt(
        run=run,
        attempt=1 + len(_groups.groups(_ledger.read(store))),  # the chief alone writes them
        time=_groups.iso_time(time.time()),
        status=status,
        cause=cause,
        workers=tuple(workers),
        slurm_job=_str(facts.get("slurm_job")),
        slurm_restart=_int(facts.get("slurm_restart")),
    )
    _ledger.append(store, group.to_record())
    return group


def worker_ends(
    by_rank: Mapping[int, MemberEnd], tasks: int, first: int | None, missing: str
) -> list[_groups.WorkerEnd]:
    """Each rank's recorded end as a worker of the group line, in rank order; a rank that
    left none is there too, with ``missing`` as how it ended."""
    workers = []
    for rank in range(max(tasks, 1 + max(by_rank, default=-1))):
        e = by_rank.get(rank)
        if e is None:
            workers.append(_groups.WorkerEnd(rank, "?", 1, missing, False, first=rank == first))
            continue
        workers.append(
            _groups.WorkerEnd(
                rank=rank,
                host=e.host,
                status=e.status,
                how=e.why,
                stopped=e.stopped,
                first=rank == first,
                ended=_groups.iso_time(e.at),
                pid=e.pid,
                session=e.session,
                step=e.step,
            )
        )
    return workers


def _str(value: object) -> str | None:
    return None if value is None else str(value)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
