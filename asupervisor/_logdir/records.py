"""What a logdir knows of each checkpoint beyond its files: its metrics and its health.

Two files, each with one writer, each written whole (JSON):

- the chief's record, ``<logdir>/.asupervisor.checkpoints``, updated with every commit:
  ``{name: {"step": int, "time": float, "metrics": {str: float}, "healthy": bool}}``
  (``healthy``: the loss of the last step before the save was finite);
- the sidecar evaluator's results, ``<logdir>/eval/.asupervisor.evaluated``:
  ``{name: {"step": int, "time": float, "metrics": {str: float}}}``, what it measured
  on each checkpoint it evaluated (its events go to ``<logdir>/eval`` too).

Retention keeps the best checkpoints by a metric from either; the next session and
``asupervisor inspect`` read them back. Damaged files read as empty: they only ever add
to what the state file and the checkpoints' own files say.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .store import Store

RECORD = ".asupervisor.checkpoints"
EVAL_DIR = "eval"
EVALUATED = ".asupervisor.evaluated"


@dataclass(frozen=True)
class Record:
    step: int
    time: float
    metrics: dict[str, float] = field(default_factory=dict)
    healthy: bool = True


def finite_numbers(values: dict[str, Any]) -> dict[str, float]:
    """The entries that are finite numbers, as floats (JSON has no NaN)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[str(key)] = number
    return out


def _load(store: Store, name: str) -> dict[str, Any]:
    try:
        data = json.loads(store.read(name)) if store.kind(name) == "file" else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_records(store: Store) -> dict[str, Record]:
    records = {}
    for name, raw in _load(store, RECORD).items():
        try:
            records[str(name)] = Record(
                int(raw["step"]),
                float(raw["time"]),
                finite_numbers(dict(raw.get("metrics", {}))),
                bool(raw.get("healthy", True)),
            )
        except (KeyError, TypeError, ValueError):
            continue
    return records


def write_records(store: Store, records: dict[str, Record]) -> None:
    store.write(RECORD, json.dumps({n: asdict(r) for n, r in sorted(records.items())}).encode())


def evaluated_store(logdir: str) -> Store:
    return Store(f"{logdir.rstrip('/')}/{EVAL_DIR}")


def read_evaluated(logdir: str) -> dict[str, dict[str, float]]:
    """The evaluator's metrics by checkpoint name."""
    results = {}
    for name, raw in _load(evaluated_store(logdir), EVALUATED).items():
        if isinstance(raw, dict):
            results[str(name)] = finite_numbers(dict(raw.get("metrics", {})))
    return results


def write_evaluated(logdir: str, results: dict[str, dict[str, Any]]) -> None:
    """The evaluator's whole results file (it is the only writer)."""
    store = evaluated_store(logdir)
    store.make()
    store.write(EVALUATED, json.dumps(results, sort_keys=True).encode())
