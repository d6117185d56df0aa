"""The ends the sessions could not record: the runner writes them into the ledger.

A session records its own end in the logdir's ledger (``_logdir/ledger``) as it closes; a
process killed outright (SIGKILL, the OOM killer) never does, and ``inspect`` would know
neither the step it reached nor the steps its death threw away. The runner heard the
child's last beat on its channel: once the process is gone, it appends for each chief
session that began and has no end in the ledger an end line of its own (``recorded_by``:
``runner``) with the step of that beat and the status the process died with. The ledger
is read first: a session's own end is the fact, and is never overwritten.

Called between two attempts, when no child of the run holds the logdir; a warm standby
may, but it appends too (``O_APPEND``: whole lines).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from .._logdir import ledger as _ledger
from .._logdir.store import Store
from .attempt import Child
from .slurm import MemberEnd
from .statuses import shell_status


def unrecorded(children: list[Child]) -> list[dict[str, Any]]:
    """The end lines the runner can write for its children's chief sessions, from each
    one's last beat (a child that never beat as a chief has none)."""
    lines = []
    for child in children:
        beat, proc = child.proc.heard.beat, child.proc
        if beat is None or not beat.chief or beat.ended or proc.returncode is None:
            continue
        status = shell_status(proc.returncode)
        died = time.time() - (time.monotonic() - (proc.exited_at or time.monotonic()))
        lines.append(
            {
                "event": "end_seen",
                "session": beat.session,
                "time": _iso(time.time()),
                "ended": _iso(died),
                "host": beat.host,
                "pid": beat.pid,
                "exit_status": status,
                "step": beat.step,
                "reason": _reason(child),
                "recorded_by": "runner",
                "last_beat_at": beat.written_at,
                "committed_step": beat.last_commit_step,
                "committed_at": beat.last_commit_at,
            }
        )
    return lines


def member_line(end: MemberEnd) -> dict[str, Any]:
    """The end line of a task's worker session as its recorded end tells it (a task of a
    ``--slurm`` step, whose run may have been killed with it: the outer run writes it)."""
    return {
        "event": "end_seen",
        "session": end.session,
        "time": _iso(time.time()),
        "ended": _iso(end.at),
        "host": end.host,
        "pid": end.pid,
        "exit_status": end.status,
        "step": end.step,
        "reason": end.why,
        "recorded_by": "runner",
    }


def _reason(child: Child) -> str:
    """Why it ended, as the runner knows it (its status is the line's own field)."""
    why = f"judged stuck ({child.stuck}); " if child.stuck is not None else ""
    return f"{why}the step of its last beat"


def record(logdir: str, lines: list[dict[str, Any]]) -> None:
    """Append the ``lines`` whose session has no end in the ledger (blocking I/O: run it
    in a worker thread)."""
    store = Store(logdir)
    ended = {r.get("session") for r in _ledger.read(store) if r.get("ended") is not None}
    for line in lines:
        if line["session"] not in ended:
            _ledger.append(store, line)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()
