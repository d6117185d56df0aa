"""One history, many hosts: the group's attempts of a job whose hosts each run one
``asupervisor run`` (a JobSet's or a TFJob's pods), folded into the chief's ledger.

No process there started every worker, so none knows how each ended. Each member records
its own end in the logdir as a fact (``.asupervisor.member-host-<rank>-<run>``, the same
``MemberEnd`` a ``--slurm`` task writes); the chief's member, which alone writes the
ledger, folds them into one ``group_attempt`` line (``_logdir/groups``):

- at its own end, having waited (bounded) for every member's record;
- at its start, the records an earlier attempt left (its chief was killed with its pod, or
  a member ended after that chief had folded): one line for them, the chief's end missing.

The first to fail is the cause ``group_status`` names, from the records alone; their times
are each host's own clock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import datetime, timezone

from .._logdir import groups as _groups
from .._logdir import ledger as _ledger
from .._logdir.store import Store
from .slurm import MEMBER_PREFIX, MemberEnd, cause_rank, group_status

HOST_PREFIX = f"{MEMBER_PREFIX}host-"
LEFT_NO_END = "left no end (its host or its run was lost)"


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


def record_name(rank: int, run: str) -> str:
    return f"{HOST_PREFIX}{rank}-{run}"


def write(logdir: str, run: str, end: MemberEnd) -> None:
    """This member's end into the logdir (blocking I/O: a worker thread)."""
    store = Store(logdir)
    store.make()  # a worker that failed before its session made the logdir
    store.write(record_name(end.rank, run), end.to_json())


def _read(store: Store) -> dict[str, MemberEnd]:
    found = {}
    for name in store.names():
        if name.startswith(HOST_PREFIX):
            try:
                found[name] = MemberEnd.from_json(store.read(name))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not ours: left for a later fold
    return found


def fold(
    logdir: str,
    run: str,
    tasks: int,
    wait_tries: int,
    pause_secs: float,
    facts: Mapping[str, object] | None = None,
) -> _groups.GroupAttempt | None:
    """The members' records in ``logdir`` as one group line, appended to its ledger and
    the records removed (blocking I/O: a worker thread). Looks ``wait_tries`` times, a
    pause apart, until every one of the ``tasks`` ranks has one; then folds what there
    is (a rank without one: its host or its run was lost). ``None``: no record."""
    store = Store(logdir)
    found: dict[str, MemberEnd] = {}
    for tries in range(max(1, wait_tries)):
        found = _read(store)
        if {e.rank for e in found.values()} >= set(range(tasks)):
            break
        if tries + 1 < wait_tries:
            time.sleep(pause_secs)
    if not found:
        return None
    by_rank: dict[int, MemberEnd] = {}
    for end in sorted(found.values(), key=lambda e: e.at):
        by_rank[end.rank] = end  # one per rank: its newest
    ends = list(by_rank.values())
    status, cause = group_status(ends, tasks, max(e.status for e in ends))
    first = cause_rank(ends, tasks, status)
    workers = []
    for rank in range(max(tasks, 1 + max(by_rank))):
        e = by_rank.get(rank)
        if e is None:
            workers.append(_groups.WorkerEnd(rank, "?", 1, LEFT_NO_END, False, rank == first))
            continue
        workers.append(
            _groups.WorkerEnd(
                rank=rank,
                host=e.host,
                status=e.status,
                how=e.why,
                stopped=e.stopped,
                first=rank == first,
                ended=_iso(e.at),
                pid=e.pid,
                session=e.session,
                step=e.step,
            )
        )
    records = _ledger.read(store)
    facts = facts or {}
    group = _groups.GroupAttempt(
        run=run,
        attempt=1 + len(_groups.groups(records)),  # the chief alone writes them, in turn
        time=_iso(time.time()),
        status=status,
        cause=cause,
        workers=tuple(workers),
        slurm_job=_str(facts.get("slurm_job")),
        slurm_restart=_int(facts.get("slurm_restart")),
    )
    _ledger.append(store, group.to_record())
    for name in found:
        store.remove(name)
    return group


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="milliseconds")


def _str(value: object) -> str | None:
    return None if value is None else str(value)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
