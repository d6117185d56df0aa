"""The group's attempts: how each worker of a multi-worker job ended, on which host, in the
ledger (``<logdir>/asupervisor-ledger.jsonl``).

A session of the chief records its own start and end in the ledger (``ledger.py``); the
other workers write nothing into the logdir (the chief alone writes the history and the
ledger's commits). How every worker of one attempt ended is known to the one process that
started them all: ``asupervisor run --workers N`` on one host, or ``asupervisor run
--slurm``'s outer run, which reads each task's recorded end (``_run/slurm``). Where each
host runs one ``asupervisor run`` of one worker (a JobSet's or a TFJob's pods), no process
started them all: each records its end in the logdir, and the chief's folds them
(``_run/members``). That process appends one ``group`` line per attempt: each worker's
rank, host, status, how it ended, whether it was stopped with the group or ended on its
own, its last session and step; which worker was the first to fail (the cause of the
attempt's end); and the engine's facts, SLURM's job id and restart count. ``asupervisor
inspect`` shows them as the group's attempts.

Times are each host's own clock (``ended``): the first to fail is decided by the process
that started the group, from the order it learned of the ends, not from these times;
except for the chief's fold of a job across hosts, which has only the recorded ends: a
failure ranks before a lost peer or a stop, and among equals the earliest by these times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

EVENT = "group_attempt"


def iso_time(timestamp: float) -> str:
    """A group line's time (``time``, a worker's ``ended``): UTC, to the millisecond."""
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="milliseconds")


def engine_facts(env: Mapping[str, str]) -> dict[str, Any]:
    """What SLURM says of this process: its job, how often the job was requeued
    (``SLURM_RESTART_COUNT``) and its node; empty outside SLURM."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return {}
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return {
        "slurm_job": job,
        "slurm_restart": int(restarts) if restarts.isdigit() else 0,
        "node": env.get("SLURMD_NODENAME") or None,
    }


@dataclass(frozen=True)
class WorkerEnd:
    """How one worker of one attempt ended."""

    rank: int
    host: str  # the node it ran on
    status: int  # the exit status its end was passed on with
    how: str  # what happened, in words
    stopped: bool  # stopped with the group (another worker's end, a notice): not a cause
    first: bool  # the first of the attempt's workers to fail: the cause of its end
    ended: str | None = None  # ISO time, by its host's clock
    pid: int | None = None
    session: str | None = None  # its last session (the chief's is in the ledger too)
    step: int | None = None  # the step of its last beat


@dataclass(frozen=True)
class GroupAttempt:
    """One attempt of the group: every worker's end, the group's status and its cause."""

    run: str  # the `asupervisor run` that started the group
    attempt: int
    time: str  # ISO, when the line was written
    status: int  # the attempt's status (its cause's)
    cause: str
    workers: tuple[WorkerEnd, ...]
    slurm_job: str | None = None
    slurm_restart: int | None = None

    @property
    def first(self) -> WorkerEnd | None:
        return next((w for w in self.workers if w.first), None)

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record["workers"] = [asdict(w) for w in self.workers]
        return {"event": EVENT, "group": f"{self.run}/{self.attempt}", **record}


def groups(records: list[dict[str, Any]]) -> list[GroupAttempt]:
    """The ledger's group lines, oldest first; a line that does not read is skipped."""
    found = []
    for record in records:
        if record.get("event") != EVENT:
            continue
        try:
            found.append(_from_record(record))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def _from_record(record: dict[str, Any]) -> GroupAttempt:
    workers = tuple(
        WorkerEnd(
            rank=int(w["rank"]),
            host=str(w["host"]),
            status=int(w["status"]),
            how=str(w["how"]),
            stopped=bool(w["stopped"]),
            first=bool(w["first"]),
            ended=_str(w.get("ended")),
            pid=_opt_int(w.get("pid")),
            session=_str(w.get("session")),
            step=_opt_int(w.get("step")),
        )
        for w in record["workers"]
    )
    return GroupAttempt(
        run=str(record["run"]),
        attempt=int(record["attempt"]),
        time=str(record["time"]),
        status=int(record["status"]),
        cause=str(record["cause"]),
        workers=workers,
        slurm_job=_str(record.get("slurm_job")),
        slurm_restart=_opt_int(record.get("slurm_restart")),
    )


def _str(value: object) -> str | None:
    return None if value is None else str(value)


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
