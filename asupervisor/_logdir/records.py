"""What a logdir knows of each checkpoint beyond its files: its metrics and its health.

- What a commit records (``Record``: step, time, metrics, health) goes into the logdir's
  history (``_history``) with the commit. ``healthy`` is ``True`` when the loss of the
  last step before the save and every floating-point value the checkpoint saves were
  finite, ``False`` when one was not, ``None`` when it is not known.
- Older logdirs kept it in ``<logdir>/.asupervisor.checkpoints`` (``{name: {"step",
  "time", "metrics", "healthy"}}``): read once, when their history is derived.
- The sidecar evaluator's results, ``<logdir>/eval/.asupervisor.evaluated`` (one writer:
  the evaluator): ``{name: {"step", "time", "metrics", "written", "seq", "skipped"}}``,
  what it measured on each checkpoint it evaluated, or why it skipped one (its events go
  to ``<logdir>/eval`` too). Retention reads it for ``KeepBest`` and for the evaluator's
  backlog.

Damaged files read as empty: they only ever add to what the history says.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .store import Store

RECORD = ".asupervisor.checkpoints"  # an older logdir's records
EVAL_DIR = "eval"
EVALUATED = ".asupervisor.evaluated"
RESULTS_READ_LIMIT = 64 << 20


@dataclass(frozen=True)
class Record:
    step: int
    time: float
    metrics: dict[str, float] = field(default_factory=dict)
    healthy: bool | None = None


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


def _load(store: Store, name: str, limit: int | None = None) -> dict[str, Any]:
    try:
        if store.kind(name) != "file":
            return {}
        data = json.loads(store.read(name) if limit is None else store.read(name, limit))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_legacy_records(store: Store) -> dict[str, Record]:
    """An older logdir's records (a missing ``healthy`` read as unknown)."""
    records = {}
    for name, raw in _load(store, RECORD).items():
        try:
            healthy = raw.get("healthy")
            records[str(name)] = Record(
                int(raw["step"]),
                float(raw["time"]),
                finite_numbers(dict(raw.get("metrics", {}))),
                None if healthy is None else bool(healthy),
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
    return records


def evaluated_store(logdir: str) -> Store:
    return Store(f"{logdir.rstrip('/')}/{EVAL_DIR}")


def read_results(logdir: str) -> dict[str, dict[str, Any]]:
    """The evaluator's results file, whole: checkpoint name -> ``{"step", "time",
    "metrics", "written", "seq", "skipped"}`` (``skipped``: why it was not evaluated, or
    ``None``); damaged entries, or a damaged file, read as nothing."""
    results: dict[str, dict[str, Any]] = {}
    for name, raw in _load(evaluated_store(logdir), EVALUATED, RESULTS_READ_LIMIT).items():
        try:
            written, seq, skipped = raw.get("written"), raw.get("seq"), raw.get("skipped")
            results[str(name)] = {
                "step": int(raw["step"]) if raw.get("step") is not None else None,
                "time": float(raw["time"]),
                "metrics": finite_numbers(dict(raw.get("metrics", {}))),
                "written": float(written) if written is not None else None,
                "seq": int(seq) if seq is not None else None,
                "skipped": str(skipped) if skipped is not None else None,
            }
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
    return results


def read_evaluated(logdir: str) -> dict[str, dict[str, float]]:
    """The evaluator's metrics by checkpoint name."""
    return {name: entry["metrics"] for name, entry in read_results(logdir).items()}


def write_evaluated(logdir: str, results: dict[str, dict[str, Any]]) -> None:
    """The evaluator's whole results file (it is the only writer)."""
    store = evaluated_store(logdir)
    store.make()
    store.write(EVALUATED, json.dumps(results, sort_keys=True).encode())
