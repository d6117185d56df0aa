"""Steps' numeric results, averaged between two summaries."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from .summaries import scalars

FOLD_EVERY = 256  # results kept by reference before they are summed


def scalar_parts(result: Any) -> dict[str, Any]:
    """The parts of a step's result that are single numbers, by name (a bare number is
    ``loss``), kept as they are: a tensor's shape is known without waiting for it, and
    a step's large outputs (logits, images) are not kept alive for a mean."""
    if result is None:
        return {}
    items = result.items() if isinstance(result, Mapping) else [("loss", result)]
    found: dict[str, Any] = {}
    for key, value in items:
        if _single(value):
            found[str(key)] = value
    return found


def _single(value: Any) -> bool:
    """A single number: a Python or NumPy number, or a tensor or array of rank 0 (its
    rank read first: cheaper than building its shape, and known without waiting)."""
    rank = getattr(value, "ndim", None)
    if rank is not None:  # a tensor (eager or symbolic, known rank) or an array
        return bool(rank == 0)
    shape = getattr(value, "shape", None)
    if shape is not None:
        try:
            return len(shape) == 0
        except (TypeError, ValueError):  # a shape of unknown rank
            return False
    return isinstance(value, numbers.Number)


class ResultMeans:
    """The mean of each numeric result since the last :meth:`take` (training thread).

    A result's numbers are kept as they are, by reference: converting a tensor waits for
    it, which a step must not pay. Every ``FOLD_EVERY`` steps, and at :meth:`take`, the
    kept numbers are converted and summed, so memory stays bounded however long the
    interval is.
    """

    def __init__(self) -> None:
        self._kept: list[dict[str, Any]] = []
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, result: Any) -> None:
        parts = scalar_parts(result)
        if parts:
            self._kept.append(parts)
        if len(self._kept) >= FOLD_EVERY:
            self._fold()

    def add_many(self, columns: Mapping[str, Sequence[float]]) -> None:
        """Many steps' numbers at once (a call of ``steps_per_loop`` steps), each name's in
        step order: summed as one step at a time would have been."""
        self._fold()  # the steps before these come first in the sums
        sums, counts = self._sums, self._counts
        for key, values in columns.items():
            if values:
                sums[key] = sum(values, sums.get(key, 0.0))
                counts[key] = counts.get(key, 0) + len(values)

    def take(self) -> dict[str, float]:
        """Each name's mean since the last take (``{}`` if no step returned numbers)."""
        self._fold()
        means = {key: total / self._counts[key] for key, total in self._sums.items()}
        self.clear()
        return means

    def clear(self) -> None:
        self._kept.clear()
        self._sums.clear()
        self._counts.clear()

    def _fold(self) -> None:
        sums, counts = self._sums, self._counts
        for parts in self._kept:
            for key, value in scalars(parts).items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
        self._kept.clear()
