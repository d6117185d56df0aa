"""An mkdocs hook: the "Measured" page's tables come from benchmarks/results/*.json.

A line `<!-- measured: NAME -->` in a page is replaced at build time by the table of
`benchmarks/results/NAME.json` (written by `benchmarks/_results.py`, or by goodput.py in
its own schema), headed by the command that produced it; without the file, the line says
"not measured yet" with the command to run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"^<!-- measured: ([\w-]+) -->$", re.MULTILINE)

# The command each benchmark is run with when it has not written its results yet.
COMMANDS = {
    "peers": "python benchmarks/peers.py",
    "step_overhead": "python benchmarks/step_overhead.py",
    "checkpoint_stall": "python benchmarks/checkpoint_stall.py",
    "lifecycle_latency": "python benchmarks/lifecycle_latency.py",
    "restart_latency": "python benchmarks/restart_latency.py",
    "close_stall": "python benchmarks/close_stall.py",
    "fit_overhead": "python benchmarks/fit_overhead.py",
    "fit_interruptions": "python benchmarks/fit_interruptions.py --trials 5",
    "multiworker": "python benchmarks/multiworker.py",
    "object_store": "python benchmarks/object_store.py",
    "evaluation_hold": "python benchmarks/evaluation_hold.py",
    "goodput": "python benchmarks/goodput.py",
    "resume_cost": "python benchmarks/resume_cost.py",
    "resume_equivalence": "python benchmarks/resume_equivalence.py",
    "resume_equivalence_workers": "python benchmarks/resume_equivalence.py --workers",
}


def _cell(value: Any) -> str:
    if isinstance(value, float):  # fixed point, never an exponent
        size = abs(value)
        digits = (
            0 if size >= 100 else 1 if size >= 10 else 2 if size >= 1 else 3 if size >= 0.01 else 4
        )
        return f"{value:.{digits}f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    if value is None:
        return ""
    return str(value).replace("|", "\\|")


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def render(name: str, results: Path = RESULTS) -> str:
    path = results / f"{name}.json"
    command = COMMANDS.get(name, f"python benchmarks/{name}.py")
    if not path.exists():
        return f"*Not measured yet: run `{command}`.*"
    data = json.loads(path.read_text())
    head = [f"Measured by `{data.get('command', command)}`"]
    if data.get("date"):
        head.append(f"on {data['date']}")
    if data.get("machine"):
        head.append(f"({data['machine']})")
    notes = [" ".join(head) + ":", ""]
    if data.get("faults"):
        notes += ["Faults: " + _cell([f"{kind} at {secs} s" for kind, secs in data["faults"]]), ""]
    return "\n".join(notes) + "\n" + _table(list(data.get("rows", [])))


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda m: render(m.group(1)), markdown)
