"""Where the benchmarks leave their figures: ``benchmarks/results/<name>.json``.

The documentation's measured tables are written from these files
(``python docs/_hooks/measured.py``), so that no figure in the docs is copied by hand.
Each file holds the command that produced it, the date, the commit of the code it ran,
a note on the machine, and the rows of the benchmark's table.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def machine() -> str:
    # The installed version, read without importing TensorFlow (whose start-up lines
    # would land in the benchmark's output).
    from importlib import metadata

    try:
        version = f", TF {metadata.version('tensorflow')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - every benchmark needs TF
        version = ""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}{version}"
    )


def commit() -> str | None:
    """The commit of the code measured (``+changes`` when the tree had changes), or ``None``
    outside a git checkout."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short=10", "HEAD")
    if head is None:
        return None
    # The code measured; the results files and the pages a run rewrites do not count.
    code = ["asupervisor", "benchmarks", ":!benchmarks/results", "tests/faults"]
    changes = git("status", "--porcelain", "--untracked-files=no", "--", *code)
    return head + ("+changes" if changes else "")


def write(name: str, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """Write ``rows`` (one dict per table row, column name to value) as ``<name>.json``."""
    RESULTS.mkdir(exist_ok=True)
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else Path(script.name)
    payload = {
        "benchmark": name,
        "command": "python " + shlex.join([shown.as_posix(), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(),
        **extra,
        "rows": rows,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"figures written to {where}", file=sys.stderr)
    return path
