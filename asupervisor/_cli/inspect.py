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
            metrics = "NOT HEALTHY (loss not finite) " + metrics
        lines.append(
            f"  {c.step:>10}  {c.saved:<25}  {size(c.bytes):>10}  {readable:<8}  {metrics}"
        )
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
