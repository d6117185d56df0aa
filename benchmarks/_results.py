"""Where the benchmarks leave their figures: ``benchmarks/results/<name>.json``.

The documentation's "Measured" page is built from these files (docs/_hooks/measured.py),
so that no figure in the docs is copied by hand. Each file holds the command that produced
it, the date, a note on the machine, and the rows of the benchmark's table.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    try:
        import tensorflow as tf

        version = f", TF {tf.__version__}"
    except ImportError:  # pragma: no cover - every benchmark imports TF
        version = ""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}{version}"
    )


def write(name: str, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """Write ``rows`` (one dict per table row, column name to value) as ``<name>.json``."""
    RESULTS.mkdir(exist_ok=True)
    argv = [f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]
    payload = {
        "benchmark": name,
        "command": "python " + shlex.join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        **extra,
        "rows": rows,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"figures written to {path.relative_to(RESULTS.parent.parent)}", file=sys.stderr)
    return path
