"""``asupervisor inspect``'s table: what a logdir holds, for people (``--json`` is the
report itself). Every table's columns are as wide as their widest cell."""

from __future__ import annotations

import json
import time

from .._kinds import RestoreSource
from .._logdir import ledger as _ledger
from .._logdir.costs import Goodput, goodput
from .._logdir.heartbeat import Beat
from .._logdir.ledger import SessionRecord
from .._logdir.report import LogdirReport
from .text import columns, shown, size

REASON_CHARS = 80  # a session's reason (its error) is cut here: the last column


def render(report: LogdirReport) -> str:
    lines = [f"logdir: {shown(report.logdir)}"]
    latest = shown(report.latest_checkpoint or "none")
    lines.append(f"latest checkpoint: {latest}  (step {report.latest_step})")
    lines.append("")
    lines.append(f"checkpoints ({len(report.checkpoints)}):")
    rows = []
    for c in report.checkpoints:
        readable = "yes" if c.readable else f"NO  {shown(c.problem)}"
        metrics = " ".join(f"{shown(k)}={v:.6g}" for k, v in sorted(c.metrics.items()))
        if c.healthy is False:
            metrics = "NOT HEALTHY (loss or state not finite) " + metrics
        if c.seq is None:
            metrics = "(no commit names it) " + metrics
        step = "?" if c.step is None else str(c.step)
        rows.append([step, c.saved, size(c.bytes), readable, metrics])
    header = ["step", "saved (UTC)", "size", "readable", "metrics"]
    lines += _indented(columns(header, rows, right={0, 2}))
    lines += ["", *history_lines(report)]
    lines.append("")
    lines.append(f"tags ({len(report.tags)}):")
    rows = []
    for name, t in sorted(report.tags.items()):
        value = "" if t.last_value is None else f"{t.last_value:.6g}"
        steps = f"{t.first_step}..{t.last_step}"
        rows.append([shown(name), shown(t.kind), value, steps, str(t.points)])
    lines += _indented(columns(["tag", "kind", "last value", "steps", "points"], rows, {2, 4}))
    lines.append("")
    lines.append(f"events files ({len(report.events_files)}):")
    for f in report.events_files:
        damage = f"  DAMAGED: {shown(f.damaged)}" if f.damaged else ""
        lines.append(f"  {shown(f.name)}  {size(f.bytes)}  {f.events} events{damage}")
    lines += ["", *ledger_lines(report)]
    return "\n".join(lines)


def _indented(table: list[str]) -> list[str]:
    return ["  " + line for line in table]


def history_lines(report: LogdirReport) -> list[str]:
    """``asupervisor inspect``'s history: each commit in commit order with its parent and
    branch, where it is, and each rollback (which commits it abandoned, for which)."""
    derived = "  (derived from an older logdir's state file)" if report.history_derived else ""
    lines = [
        f"history ({len(report.commits)} commits, {len(report.rollbacks)} rollbacks){derived}:"
    ]
    rows = []
    for c in report.commits:
        healthy = {True: "yes", False: "NO", None: "?"}[c.healthy]
        made = f"{c.run or '-'}/{c.attempt if c.attempt is not None else '-'}"
        notes = ("  HEAD" if c.head else "") + (
            f"  abandoned by rollback {c.abandoned_by}" if c.abandoned_by is not None else ""
        )
        step = "?" if c.step is None else str(c.step)
        parent = "-" if c.parent is None else f"#{c.parent}"
        rows.append(
            [
                f"#{c.seq}",
                parent,
                str(c.branch),
                step,
                c.kept,
                healthy,
                shown(made),
                shown(c.name) + notes,
            ]
        )
    if rows:
        header = ["commit", "parent", "branch", "step", "kept", "healthy", "run/attempt", "name"]
        lines += _indented(columns(header, rows, right={0, 1, 2, 3}))
    for r in report.rollbacks:
        at = "" if r.at_step is None else f" at step {r.at_step}"
        dropped = f", {r.batches_dropped} batches dropped" if r.batches_dropped else ""
        left = ", ".join(shown(n) for n in r.abandoned) or "nothing"
        lines.append(
            f"  rollback {r.number} ({r.kind}{at}: {shown(r.reason)[:60]}): back to "
            f"{shown(r.to)}, abandoning {left}{dropped}"
        )
    return lines


def ledger_lines(report: LogdirReport) -> list[str]:
    """``asupervisor inspect``'s last sections: the sessions of the ledger, what each
    restart cost, the heartbeat."""
    lines = ledger_table(report.sessions)
    lines += changed_lines(report.sessions)
    lines += restart_lines(report.sessions)
    if report.heartbeat is not None:
        beat = Beat.from_json(json.dumps(report.heartbeat).encode())
        lines += ["", f"heartbeat: {shown(describe_beat(beat, time.time()))}"]
    elif report.heartbeat_problem is not None:
        lines += ["", f"heartbeat: unreadable: {shown(report.heartbeat_problem)}"]
    return lines


def changed_lines(entries: list[SessionRecord]) -> list[str]:
    """Where the run was changed: a line per difference a session found between the
    commit it restored and the run it was (``run.changed``)."""
    lines = []
    for e in entries:
        started = shown((e.started or "?")[:19].replace("T", " "))
        for change in e.changed if isinstance(e.changed, list) else []:
            at = "?" if e.restored_step is None else e.restored_step
            lines.append(f"  changed at {started} (step {at}): {shown(change)}")
    return lines


def ledger_table(entries: list[SessionRecord]) -> list[str]:
    """The ledger's sessions as table lines."""
    lines = [f"sessions ({len(entries)}, from {_ledger.NAME}):"]
    if not entries:
        return lines
    rows = []
    for e in entries:
        where = shown(f"{e.host}:{e.pid}")
        started = shown((e.started or "?")[:19].replace("T", " "))  # UTC, to the second
        origin = _origin(e)
        if e.ended is None:
            to, outcome, status, reason = "?", "no end recorded", "", "killed or still running"
        else:
            to = "?" if e.step is None else str(e.step)  # None: ended before its restore
            outcome, status = shown(e.outcome or "?"), str(e.exit_status)
            reason = shown(e.reason or "") + (f": {shown(e.error)}" if e.error else "")
            if e.source == RestoreSource.INTERRUPTED.value:
                reason += " (stopped as it began: no step trained)"
        rows.append([started, where, origin, to, outcome, status, reason[:REASON_CHARS]])
    header = ["started (UTC)", "host:pid", "from", "to", "outcome", "status", "reason"]
    return lines + _indented(columns(header, rows, right={2, 3, 5}))


def _origin(e: SessionRecord) -> str:
    """Where a session began: the step it restored, or how it began without one."""
    if e.source == RestoreSource.CHECKPOINT.value:
        return str(e.restored_step)
    if e.source == RestoreSource.INTERRUPTED.value:
        # It stopped before it trained (a step limit already reached): it ends where it
        # began, which the ledger has as its end step.
        return "?" if e.step is None else str(e.step)
    return shown(e.source or "?")


def restart_lines(entries: list[SessionRecord]) -> list[str]:
    """What each restart cost, and the run's goodput (``_logdir/costs``)."""
    found = goodput(entries)
    if found is None or not found.restarts:
        return [] if found is None else ["", goodput_line(found)]
    rows = []
    for n, r in enumerate(found.restarts, 1):
        rows.append(
            [
                str(n),
                shown(r.after),
                _text(r.reached),
                _text(r.restored),
                _text(r.lost_steps),
                _text(r.lost_secs),
                _text(r.down_secs),
            ]
        )
    header = ["#", "after", "at step", "restored", "lost steps", "lost (s)", "down (s)"]
    lines = ["", f"restarts ({len(found.restarts)}, from {_ledger.NAME}):"]
    lines += _indented(columns(header, rows, right={0, 2, 3, 4, 5, 6}))
    lines.append(
        "  lost: from the commit it restored to its first step (steps thrown away, the "
        "restart, the restore, the first step); down: from the end of the one before"
    )
    return [*lines, goodput_line(found)]


def goodput_line(found: Goodput) -> str:
    return (
        f"goodput: {100 * found.fraction:.1f}% of {found.wall_secs:.1f} s went into steps "
        f"that were kept (start-ups and restarts lost {found.lost_secs:.1f} s)"
    )


def _text(value: int | float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def describe_beat(beat: Beat, now: float) -> str:
    age = now - beat.written_at
    where = f"pid {beat.pid} on {beat.host}"
    if beat.outcome is not None:
        return (
            f"session ended ({beat.outcome.value}, exit status {beat.exit_status}) "
            f"{beat.at_step}, {age:.0f} s ago ({where})"
        )
    busy = (
        "" if beat.busy_since is None else f"; {beat.job} running for {now - beat.busy_since:.1f} s"
    )
    return f"{beat.phase.value} at step {beat.step}, last beat {age:.1f} s ago{busy} ({where})"
