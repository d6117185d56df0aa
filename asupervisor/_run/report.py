"""The crash-loop report of ``asupervisor run``: why it gives up, attempt by attempt."""

from __future__ import annotations

from collections.abc import Sequence

from .attempt import AttemptResult
from .statuses import describe_status

SHOWN_ATTEMPTS = 20


def crash_loop(
    history: Sequence[AttemptResult], failures: int, committed: int | None, logdir: str | None
) -> str:
    """The report's lines: the attempts (the last ``SHOWN_ATTEMPTS``), the last failure and
    the last lines of its stderr. ``committed``: the newest checkpoint this run committed;
    ``logdir``: what the logdir's newest is, as a phrase (``None``: no logdir given)."""
    from .._cli.text import columns, shown

    newest = "none" if committed is None else f"step {committed}"
    where = "" if logdir is None else f"; {logdir}"
    lines = [
        f"asupervisor run: crash loop: {failures} failures in a row without a checkpoint "
        f"committed by this run (the newest it committed: {newest}{where}); not restarting"
    ]
    rows = [
        [
            str(r.number),
            ", ".join(describe_status(s) for s in r.statuses),
            "?" if r.reached_step is None else str(r.reached_step),
            "none" if r.committed is None else str(r.committed),
            f"{r.seconds:.1f}s",
        ]
        for r in history[-SHOWN_ATTEMPTS:]
    ]
    header = ["attempt", "exit status", "reached step", "committed", "ran for"]
    lines += ["  " + line for line in columns(header, rows, right={0, 2, 3, 4})]
    last = history[-1]
    lines.append(f"  the last failure: {last.why}")
    lines.append(f"  the last lines of its stderr (attempt {last.number}):")
    lines += [f"    | {shown(line)}" for line in last.tail] or ["    (none)"]
    return "\n".join(lines)
