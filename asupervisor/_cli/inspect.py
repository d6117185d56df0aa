"""``asupervisor inspect``'s table: what a logdir holds, for people (``--json`` is the
report itself)."""

from __future__ import annotations

import json
import time

from .._kinds import RestoreSource
from .._logdir import ledger as _ledger
from .._logdir.heartbeat import Beat
from .._logdir.ledger import SessionRecord
from .._logdir.report import LogdirReport
from .text import shown, size


def render(report: LogdirReport) -> str:
    lines = [f"logdir: {shown(report.logdir)}"]
    latest = shown(report.latest_checkpoint or "none")
    lines.append(f"latest checkpoint: {latest}  (step {report.latest_step})")
    lines.append("")
    lines.append(f"checkpoints ({len(report.checkpoints)}):")
    lines.append(f"  {'step':>10}  {'saved (UTC)':<25}  {'size':>10}  readable  metrics")
    for c in report.checkpoints:
        readable = "yes" if c.readable else f"NO  {shown(c.problem)}"
        metrics = " ".join(f"{shown(k)}={v:.6g}" for k, v in sorted(c.metrics.items()))
        if c.healthy is False:
            metrics = "NOT HEALTHY (loss or state not finite) " + metrics
        if c.seq is None:
            metrics = "(no commit names it) " + metrics
        step = "?" if c.step is None else str(c.step)
        lines.append(f"  {step:>10}  {c.saved:<25}  {size(c.bytes):>10}  {readable:<8}  {metrics}")
    lines += ["", *history_lines(report)]
    lines.append("")
    lines.append(f"tags ({len(report.tags)}):")
    lines.append(f"  {'tag':<28}  {'kind':<9}  {'last value':>12}  {'steps':<17}  points")
    for name, t in sorted(report.tags.items()):
        value = "" if t.last_value is None else f"{t.last_value:.6g}"
        steps = f"{t.first_step}..{t.last_step}"
        lines.append(
            f"  {shown(name):<28}  {shown(t.kind):<9}  {value:>12}  {steps:<17}  {t.points}"
        )
    lines.append("")
    lines.append(f"events files ({len(report.events_files)}):")
    for f in report.events_files:
        damage = f"  DAMAGED: {shown(f.damaged)}" if f.damaged else ""
        lines.append(f"  {shown(f.name)}  {size(f.bytes)}  {f.events} events{damage}")
    lines += ["", *ledger_lines(report)]
    return "\n".join(lines)


def history_lines(report: LogdirReport) -> list[str]:
    """``asupervisor inspect``'s history: each commit in commit order with its parent and
    branch, where it is, and each rollback (which commits it abandoned, for which)."""
    derived = "  (derived from an older logdir's state file)" if report.history_derived else ""
    lines = [
        f"history ({len(report.commits)} commits, {len(report.rollbacks)} rollbacks){derived}:"
    ]
    if report.commits:
        lines.append(
            f"  {'commit':>6}  {'parent':>6}  {'branch':>6}  {'step':>10}  {'kept':<9}  "
            f"{'healthy':<7}  {'run/attempt':<14}  name"
        )
    for c in report.commits:
        healthy = {True: "yes", False: "NO", None: "?"}[c.healthy]
        made = f"{c.run or '-'}/{c.attempt if c.attempt is not None else '-'}"
        notes = ("  HEAD" if c.head else "") + (
            f"  abandoned by rollback {c.abandoned_by}" if c.abandoned_by is not None else ""
        )
        step = "?" if c.step is None else str(c.step)
        parent = "-" if c.parent is None else f"#{c.parent}"
        lines.append(
            f"  {f'#{c.seq}':>6}  {parent:>6}  {c.branch:>6}  {step:>10}  {c.kept:<9}  "
            f"{healthy:<7}  {shown(made)[:14]:<14}  {shown(c.name)}{notes}"
        )
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
    """``asupervisor inspect``'s last sections: the sessions of the ledger, the heartbeat."""
    lines = ledger_table(report.sessions)
    if report.heartbeat is not None:
        beat = Beat.from_json(json.dumps(report.heartbeat).encode())
        lines += ["", f"heartbeat: {shown(describe_beat(beat, time.time()))}"]
    elif report.heartbeat_problem is not None:
        lines += ["", f"heartbeat: unreadable: {shown(report.heartbeat_problem)}"]
    return lines


def ledger_table(entries: list[SessionRecord]) -> list[str]:
    """The ledger's sessions as table lines."""
    lines = [f"sessions ({len(entries)}, from {_ledger.NAME}):"]
    if not entries:
        return lines
    lines.append(
        f"  {'started (UTC)':<25}  {'host:pid':<22}  {'from':>8}  {'to':>8}  "
        f"{'outcome':<18}  status  reason"
    )
    for e in entries:
        where = shown(f"{e.host}:{e.pid}")[:22]
        started = shown((e.started or "?")[:19].replace("T", " "))  # UTC, to the second
        restored = e.source == RestoreSource.CHECKPOINT.value
        origin = str(e.restored_step) if restored else shown(e.source or "?")
        if e.ended is None:
            to, outcome, status, reason = "?", "no end recorded", "", "killed or still running"
        else:
            to = str(e.step)
            outcome, status = shown(e.outcome or "?"), str(e.exit_status)
            reason = shown(e.reason or "") + (f": {shown(e.error)}" if e.error else "")
        lines.append(
            f"  {started:<25}  {where:<22}  {origin:>8}  {to:>8}  "
            f"{outcome:<18}  {status:>6}  {reason[:80]}"
        )
    return lines


def describe_beat(beat: Beat, now: float) -> str:
    age = now - beat.written_at
    where = f"pid {beat.pid} on {beat.host}"
    if beat.outcome is not None:
        return (
            f"session ended ({beat.outcome.value}, exit status {beat.exit_status}) at step "
            f"{beat.step}, {age:.0f} s ago ({where})"
        )
    busy = (
        "" if beat.busy_since is None else f"; {beat.job} running for {now - beat.busy_since:.1f} s"
    )
    return f"{beat.phase.value} at step {beat.step}, last beat {age:.1f} s ago{busy} ({where})"
