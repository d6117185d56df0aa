"""The run's faults in TensorBoard, from the ledger's facts, on the steps' axis.

At each session's start the chief writes, at the restored step, into the logdir's run:

- ``run/restarts``: how many times the run has started again before this session;
- ``run/goodput``: the share of the run's wall time so far that went into kept steps
  (``_logdir/costs``), once an earlier session says it;
- ``run/steps_lost``: the steps the session before trained and were not kept (its
  step reached, less the restored one); for a killed session, which recorded no end,
  the steps its points were drawn to past the restore (at least that many);
- ``run/rollbacks``: the divergence rollbacks of the run so far (the history's; each
  rollback also writes it, and ``rollback/diverged_at_step``, as it happens);
- ``run/history`` (text, a markdown table, on the text dashboard): every session,
  when it began, from which step, how and where it ended, the steps each restart lost.

So a dip in ``loss`` or in the step rate has the restart that made it beside it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from .._log import log
from .._logdir import costs as _costs
from .._logdir import ledger as _ledger
from .._logdir.history import read_history
from .._logdir.store import Store
from .summaries import EventsFile

HISTORY_ROWS = 50  # the newest sessions in the table: a long run's stays readable


def write_story(
    events: EventsFile,
    logdir: str,
    session: str,
    restored: int,
    source: str,
    drawn_to: int | None,
) -> None:
    """Training thread, at the session's start: the run's story into its events file
    (only the session's own file: a writer the user gave is theirs). The ledger is a
    record of what happened, not the run's state: one that cannot be read is said,
    and the session goes on."""
    if events.path is None:
        return
    try:
        values = run_story(Store(logdir), session, restored, source, drawn_to)
    except Exception as exc:
        log.warning("summary.story_unread", error=f"{type(exc).__name__}: {exc}")
        return
    events.write(values, restored)


def run_story(
    store: Store, session: str, restored: int, source: str, drawn_to: int | None
) -> dict[str, Any]:
    """The values to write at ``restored`` for the session ``session`` that began there
    (``drawn_to``: the highest step of the points a dead session drew past it)."""
    before = _ledger.sessions(_ledger.read(store))
    before = [s for s in before if s.session != session]
    now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    this = _ledger.SessionRecord(
        session=session, started=now, restored_step=restored, source=source
    )
    # Each session's restart, this one's last; none where a session began a run segment
    # (a person's new start after a clean end: nothing of the session before was lost).
    restarts = _costs.restarts_of([*before, this])
    values: dict[str, Any] = {"run/restarts": float(sum(r is not None for r in restarts))}
    values["run/rollbacks"] = float(len(read_history(store).divergences()))
    so_far = _costs.goodput(before) if before else None
    if so_far is not None and so_far.wall_secs > 0:
        values["run/goodput"] = so_far.fraction
    this_restart = restarts[-1]
    lost = None if this_restart is None else _lost(this_restart, before[-1], restored, drawn_to)
    if lost is not None:
        values["run/steps_lost"] = float(lost[0])
    values["run/history"] = _table(before, restarts, restored, lost, so_far)
    return values


def _lost(
    restart: _costs.RestartCost,
    previous: _ledger.SessionRecord,
    restored: int,
    drawn_to: int | None,
) -> tuple[int, bool] | None:
    """The steps the restart into this session lost, and whether that is a lower bound
    (a killed session's, from the points it drew)."""
    if restart.lost_steps is not None:
        return restart.lost_steps, False
    if previous.ended is None and drawn_to is not None:
        return max(drawn_to - restored, 0), True
    return None


def _table(
    before: list[_ledger.SessionRecord],
    restarts: list[_costs.RestartCost | None],
    restored: int,
    lost: tuple[int, bool] | None,
    so_far: _costs.Goodput | None,
) -> str:
    """``restarts``: each session's (``before``'s, then this one's), ``None`` for a new start."""
    count = sum(r is not None for r in restarts)
    head = f"{count} restart{'' if count == 1 else 's'}"
    if so_far is not None and so_far.wall_secs > 0:
        head += f", goodput {so_far.fraction:.1%} of {_duration(so_far.wall_secs)}"
    rows = [
        "| session | began (UTC) | from step | ended | how | at step | steps lost |",
        "|---:|---|---:|---|---|---:|---:|",
    ]
    for number, (s, restart) in enumerate(zip(before, restarts[:-1], strict=True), 1):
        steps_lost = "" if restart is None else _count(restart.lost_steps)
        how = "killed (no end recorded)" if s.ended is None else f"{s.outcome} ({s.exit_status})"
        rows.append(
            f"| {number} | {_when(s.started)} | {_count(s.restored_step)} | "
            f"{_when(s.ended)} | {how} | {_count(s.step)} | {steps_lost} |"
        )
    this_lost = "" if lost is None else f"{'≥ ' if lost[1] else ''}{lost[0]}"
    rows.append(f"| {len(before) + 1} | now | {restored} | | running | | {this_lost} |")
    if len(rows) > HISTORY_ROWS + 2:
        rows = rows[:2] + rows[-HISTORY_ROWS:]
    return head + "\n\n" + "\n".join(rows)


def _when(value: str | None) -> str:
    if not value:
        return ""
    try:
        moment = datetime.fromisoformat(value).astimezone(timezone.utc)
    except ValueError:
        return value
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _duration(secs: float) -> str:
    minutes, seconds = divmod(int(secs), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {seconds:02d} s"
