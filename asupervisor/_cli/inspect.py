"""``asupervisor inspect``'s text: what a logdir holds, for people (``--json`` is the
report itself).

The summary first (the run, its goodput, the heartbeat), then the newest sessions and
restarts, the checkpoints on disk, the tail of the history with its counts (``--all``:
every session, restart and commit), the tags and the events files. Every table's
columns are as wide as their widest cell, and every line fits ``WIDTH`` columns: free
text is cut where it would not (``fit``)."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

from .._kinds import RestoreSource
from .._logdir import ledger as _ledger
from .._logdir.costs import Goodput, goodput
from .._logdir.heartbeat import Beat
from .._logdir.ledger import SessionRecord
from .._logdir.report import CommitInfo, LogdirReport
from .text import columns, cut, fit, shown, size, wrapped

WIDTH = 100  # every line fits a terminal this wide
TAIL = 10  # the newest sessions, restarts and commits shown without --all
CELL = 40  # a free-text cell that is not its table's last (a tag's name, a problem)


def render(report: LogdirReport, every: bool = False) -> str:
    """The report as text; ``every``: every session, restart and commit, not the tail."""
    found = goodput(report.sessions)
    head = "none" if report.latest_checkpoint is None else report.latest_checkpoint
    lines = [f"logdir: {shown(report.logdir)}"]
    lines.append(f"latest checkpoint: {shown(os.path.basename(head))}  (step {report.latest_step})")
    lines.append(run_line(report, found))
    if found is not None:
        lines.append(goodput_line(found))
    lines += heartbeat_lines(report)
    lines += ["", *ledger_table(report.sessions, every)]
    lines += changed_lines(report.sessions)
    lines += restart_lines(found, every)
    lines += ["", *checkpoint_lines(report)]
    lines += ["", *history_lines(report, every)]
    lines += ["", *tag_lines(report)]
    # Table rows were cut (their free text is last), prose wrapped: each line fits.
    return "\n".join(line for text in lines for line in _prose(text))


def run_line(report: LogdirReport, found: Goodput | None) -> str:
    """The run in one line: how many commits, sessions, restarts, rollbacks."""
    parts = [f"{len(report.commits)} commits", f"{len(report.sessions)} sessions"]
    if found is not None:
        parts.append(f"{len(found.restarts)} restarts")
        if found.segments > 1:  # a person's new start after a clean end: not a restart
            parts.append(f"{found.segments - 1} new starts after a clean end")
    parts.append(f"{len(report.rollbacks)} rollbacks")
    return "run: " + ", ".join(parts)


def heartbeat_lines(report: LogdirReport) -> list[str]:
    if report.heartbeat is not None:
        beat = Beat.from_json(json.dumps(report.heartbeat).encode())
        lines = [f"heartbeat: {shown(describe_beat(beat, time.time()))}"]
        if beat.steps_at_risk is not None:
            lines.append(f"local tier: {describe_at_risk(beat)}")
        return lines
    if report.heartbeat_problem is not None:
        return [f"heartbeat: unreadable: {shown(report.heartbeat_problem)}"]
    return []


def _indented(table: list[str]) -> list[str]:
    """A table's lines, indented, each cut to ``WIDTH``: its last column is free text."""
    return [fit("  " + line, WIDTH) for line in table]


def _prose(text: str, indent: str = "") -> list[str]:
    """A line of prose (a path, a reason) wrapped to ``WIDTH``, nothing of it cut."""
    return wrapped(indent + text, WIDTH, indent + "    ")


def _shown_of(total: int, shown_count: int, what: str) -> str:
    """``12`` or ``the last 10 of 12`` (with how to see every one)."""
    if shown_count >= total:
        return str(total)
    return f"the last {shown_count} of {total} {what}; --all shows every one"


def checkpoint_lines(report: LogdirReport) -> list[str]:
    """The checkpoints on disk, in commit order, with what their commits recorded (why
    one cannot be read first: the last column has the room)."""
    lines = [f"checkpoints ({len(report.checkpoints)} on disk):"]
    rows = []
    for c in report.checkpoints:
        readable = "yes" if c.readable else "NO"
        metrics = " ".join(f"{shown(k)}={v:.6g}" for k, v in sorted(c.metrics.items()))
        if c.healthy is False:
            metrics = "NOT HEALTHY (loss or state not finite) " + metrics
        if c.seq is None:
            metrics = "(no commit names it) " + metrics
        if not c.readable:
            metrics = f"{shown(c.problem)}  {metrics}"
        step = "?" if c.step is None else str(c.step)
        rows.append([step, c.saved, size(c.bytes), readable, metrics])
    header = ["step", "saved (UTC)", "size", "readable", "metrics (or why unreadable)"]
    return lines + _indented(columns(header, rows, right={0, 2}))


def history_lines(report: LogdirReport, every: bool = False) -> list[str]:
    """``asupervisor inspect``'s history: its counts, then its newest commits (``every``:
    all of them) in commit order with parent and branch, where each is, and each
    rollback (which commits it abandoned, for which)."""
    derived = "  (derived from an older logdir's state file)" if report.history_derived else ""
    kept = Counter(c.kept for c in report.commits)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(kept.items()))
    abandoned = sum(c.abandoned_by is not None for c in report.commits)
    lines = [
        f"history: {len(report.commits)} commits ({counts or 'none'}), "
        f"{len(report.rollbacks)} rollbacks, {abandoned} commits abandoned{derived}"
    ]
    made = Counter(c.run or "-" for c in report.commits)
    if len(made) > 1:
        lines.append("  by run: " + ", ".join(f"{cut(shown(r), 12)} {n}" for r, n in made.items()))
    commits = report.commits if every else report.commits[-TAIL:]
    if commits:
        lines.append(f"commits ({_shown_of(len(report.commits), len(commits), 'commits')}):")
        header = ["commit", "parent", "branch", "step", "kept", "healthy", "run/attempt", "name"]
        rows = [_commit_row(c) for c in commits]
        lines += _indented(columns(header, rows, right={0, 1, 2, 3}))
    for r in report.rollbacks:
        at = "" if r.at_step is None else f" at step {r.at_step}"
        dropped = f", {r.batches_dropped} batches dropped" if r.batches_dropped else ""
        left = ", ".join(shown(n) for n in r.abandoned) or "nothing"
        lines += _prose(f"rollback {r.number}: {r.kind}{at}", "  ")
        lines += _prose(f"back to {shown(r.to)}, abandoning {left}{dropped}", "    ")
        lines += _prose(f"why: {shown(r.reason)}", "    ")
    return lines


def changed_lines(entries: list[SessionRecord]) -> list[str]:
    """Where the run was changed: a line per difference a session found between the
    commit it restored and the run it was (``run.changed``)."""
    lines = []
    for e in entries:
        started = shown((e.started or "?")[:19].replace("T", " "))
        for change in e.changed if isinstance(e.changed, list) else []:
            at = "?" if e.restored_step is None else e.restored_step
            lines += _prose(f"changed at {started} (step {at}): {shown(change)}", "  ")
    return lines


def _commit_row(c: CommitInfo) -> list[str]:
    healthy = {True: "yes", False: "NO", None: "?"}[c.healthy]
    made = f"{cut(shown(c.run or '-'), 14)}/{c.attempt if c.attempt is not None else '-'}"
    notes = ("  HEAD" if c.head else "") + (
        f"  abandoned by rollback {c.abandoned_by}" if c.abandoned_by is not None else ""
    )
    step = "?" if c.step is None else str(c.step)
    parent = "-" if c.parent is None else f"#{c.parent}"
    return [f"#{c.seq}", parent, str(c.branch), step, c.kept, healthy, made, shown(c.name) + notes]


def tag_lines(report: LogdirReport) -> list[str]:
    lines = [f"tags ({len(report.tags)}):"]
    rows = []
    for name, t in sorted(report.tags.items()):
        value = "" if t.last_value is None else f"{t.last_value:.6g}"
        steps = f"{t.first_step}..{t.last_step}"
        rows.append([cut(shown(name), CELL), shown(t.kind), value, steps, str(t.points)])
    lines += _indented(columns(["tag", "kind", "last value", "steps", "points"], rows, {2, 4}))
    lines.append("")
    lines.append(f"events files ({len(report.events_files)}):")
    for f in report.events_files:
        damage = f"  DAMAGED: {shown(f.damaged)}" if f.damaged else ""
        lines += _prose(f"{shown(f.name)}  {size(f.bytes)}  {f.events} events{damage}", "  ")
    return lines


def ledger_table(entries: list[SessionRecord], every: bool = True) -> list[str]:
    """The ledger's sessions as table lines (``every``: all, else the newest)."""
    shown_entries = entries if every else entries[-TAIL:]
    count = _shown_of(len(entries), len(shown_entries), "sessions")
    lines = [f"sessions ({count}; from {_ledger.NAME}):"]
    if not entries:
        return lines
    rows = []
    for e in shown_entries:
        where = cut(shown(f"{e.host}:{e.pid}"), 20)
        started = shown((e.started or "?")[:19].replace("T", " "))  # UTC, to the second
        origin = _origin(e)
        if e.ended is None:
            to, outcome, status, reason = "?", "no end recorded", "", "killed or still running"
        elif e.recorded_by == "runner":  # killed: the runner saw its end, and its last beat
            to, outcome, status = _text(e.step), "killed", str(e.exit_status)
            reason = shown(e.reason or "its last beat's step")
        else:
            to = "?" if e.step is None else str(e.step)  # None: ended before its restore
            outcome, status = shown(e.outcome or "?"), str(e.exit_status)
            reason = shown(e.reason or "") + (f": {shown(e.error)}" if e.error else "")
            if e.source == RestoreSource.INTERRUPTED.value:
                reason = f"no step trained: stopped as it began ({reason})"
        rows.append([started, where, origin, to, outcome, status, reason])
    header = ["started (UTC)", "host:pid", "from", "to", "outcome", "exit", "reason"]
    return lines + _indented(columns(header, rows, right={2, 3, 5}))


def _origin(e: SessionRecord) -> str:
    """Where a session began: the step it restored, or how it began without one."""
    if e.source == RestoreSource.CHECKPOINT.value:
        # With a local tier: "(local)" when it was read from the host's own copy.
        return str(e.restored_step) + (" (local)" if e.restored_tier == "local" else "")
    if e.source == RestoreSource.INTERRUPTED.value:
        # It stopped before it trained (a step limit already reached): it ends where it
        # began, which the ledger has as its end step.
        return "?" if e.step is None else str(e.step)
    return shown(e.source or "?")


def restart_lines(found: Goodput | None, every: bool = False) -> list[str]:
    """What each restart cost (``_logdir/costs``): the newest, or ``every`` one."""
    if found is None or not found.restarts:
        return []
    restarts = list(enumerate(found.restarts, 1))
    if not every:
        restarts = restarts[-TAIL:]
    rows = []
    for n, r in restarts:
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
    count = _shown_of(len(found.restarts), len(restarts), "restarts")
    lines = ["", f"restarts ({count}; from {_ledger.NAME}):"]
    lines += _indented(columns(header, rows, right={0, 2, 3, 4, 5, 6}))
    lines += _prose(
        "lost: from the commit it restored to its first step (steps thrown away, the "
        "restart, the restore, the first step); down: from the end of the one before",
        "  ",
    )
    return lines


def goodput_line(found: Goodput) -> str:
    return (
        f"goodput: {100 * found.fraction:.1f}% of {found.wall_secs:.1f} s went into steps "
        f"that were kept (start-ups and restarts lost {found.lost_secs:.1f} s)"
    )


def _text(value: int | float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def describe_at_risk(beat: Beat) -> str:
    """What a host that never comes back would lose: the steps committed in its local
    tier that the mirror had not copied into the logdir at the last beat."""
    if not beat.steps_at_risk:
        return "every local commit is in the logdir (0 steps at risk)"
    return (
        f"{beat.steps_at_risk} steps at risk: committed on {shown(beat.host)}, "
        "not yet in the logdir"
    )


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
