"""The measured tables of the docs come from ``benchmarks/results/*.json``.

In a page, the lines between ``<!-- measured: NAME -->`` and ``<!-- /measured -->`` are
the table of ``benchmarks/results/NAME.json`` (written by ``benchmarks/_results.py``),
headed by the command that produced it, its date, commit and machine; without the file,
they say "not measured yet" with the command to run. The tables are written into the
markdown itself, so that the pages read the same on GitHub as on the site:

    python docs/_hooks/measured.py            # rewrite the tables from the results files
    python docs/_hooks/measured.py --check    # exit 1 if a page is not current

``make bench`` runs it after the benchmarks; ``tests/test_docs.py`` checks that every page
is current. As an mkdocs hook it fills the same tables at build time.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
START = re.compile(r"^<!-- measured: ([\w-]+) -->$")
END = "<!-- /measured -->"

# The command each results file is written by (`make bench` and `make faults` run them).
COMMANDS = {
    "peers": "python benchmarks/peers.py",
    "step_overhead": "python benchmarks/step_overhead.py",
    "health_check": "python benchmarks/step_overhead.py --health-only",
    "checkpoint_stall": "python benchmarks/checkpoint_stall.py",
    "commit_cost": "python benchmarks/commit_cost.py",
    "commit_cost_30000": (
        "python benchmarks/commit_cost.py --commits 30000 --results commit_cost_30000"
    ),
    "lifecycle_latency": "python benchmarks/lifecycle_latency.py",
    "restart_latency": "python benchmarks/restart_latency.py",
    "fork_exit": "python benchmarks/fork_exit.py",
    "close_stall": "python benchmarks/close_stall.py",
    "fit_overhead": "python benchmarks/fit_overhead.py",
    "fit_interruptions": "python benchmarks/fit_interruptions.py --trials 5",
    "multiworker": "python benchmarks/multiworker.py",
    "object_store": "python benchmarks/object_store.py",
    "evaluation_hold": "python benchmarks/evaluation_hold.py",
    "goodput": "python benchmarks/goodput.py",
    "goodput_slurm": "python benchmarks/goodput.py --slurm --steps 4000 --save-steps 100",
    "goodput_tiers": "python benchmarks/goodput.py --store gcs --local-tier",
    "fault_report": "python tests/faults/run_report.py",
    "resume_cost": "python benchmarks/resume_cost.py",
    "resume_equivalence": "python benchmarks/resume_equivalence.py",
    "resume_equivalence_workers": "python benchmarks/resume_equivalence.py --workers",
}


# Options that only say where a benchmark kept its own output (a folder of the machine it
# ran on): the figures do not depend on them, so the header leaves them out.
OUTPUT_OPTIONS = ("--logs",)


def shown_command(command: str) -> str:
    """``command`` as a page shows it: without the options in ``OUTPUT_OPTIONS``."""
    words, kept = shlex.split(command), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in OUTPUT_OPTIONS:
            skip = True  # and its value, the next word
        elif not word.startswith(tuple(f"{o}=" for o in OUTPUT_OPTIONS)):
            kept.append(word)
    return shlex.join(kept)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
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
    head = [f"Measured by `{shown_command(data.get('command', command))}`"]
    if data.get("date"):
        head.append(f"on {data['date']}")
    if data.get("commit"):
        head.append(f"at commit {data['commit']}")
    if data.get("machine"):
        head.append(f"({data['machine']})")
    notes = [" ".join(head) + ":", ""]
    if data.get("faults"):
        notes += ["Faults: " + _cell([f"{kind} at {secs} s" for kind, secs in data["faults"]]), ""]
    if data.get("load"):
        notes += [f"The machine is shared: {data['load']}.", ""]
    tables = _table(list(data.get("rows", [])))
    if data.get("costs"):  # goodput.py: what each fault cost
        tables += "\n\nWhat each fault cost:\n\n" + _table(list(data["costs"]))
    if data.get("against_tf"):  # commit_cost.py: a save against TensorFlow's own
        tables += "\n\nA small model's save against TensorFlow's own:\n\n" + _table(
            list(data["against_tf"])
        )
    for title, rows in data.get("tables", {}).items():  # a benchmark's further tables
        tables += f"\n\n{title}:\n\n" + _table(list(rows))
    return "\n".join(notes) + "\n" + tables


def fill(markdown: str, results: Path = RESULTS) -> str:
    """``markdown`` with each measured table written from its results file (a start
    marker without its end gets one)."""
    lines = markdown.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        start = START.match(lines[i])
        if start is None:
            out.append(lines[i])
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end] != END and not START.match(lines[end]):
            end += 1
        out += [lines[i], "", render(start[1], results), "", END]
        i = end + 1 if end < len(lines) and lines[end] == END else i + 1
    return "\n".join(out)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return fill(markdown)


def main(argv: list[str]) -> int:
    stale = []
    for page in pages():
        text = page.read_text()
        filled = fill(text)
        if filled != text:
            stale.append(page.relative_to(ROOT).as_posix())
            if "--check" not in argv:
                page.write_text(filled)
    if stale:
        verb = "not current" if "--check" in argv else "rewritten"
        print(f"measured tables {verb}: {', '.join(stale)}", file=sys.stderr)
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
