"""Steps' numeric results, averaged between two summaries."""

from __future__ import annotations

from typing import Any

from ._summaries import scalars

FOLD_EVERY = 256  # results kept by reference before they are summed


class ResultMeans:
    """The mean of each numeric result since the last :meth:`take` (training thread).

    A result is kept as it is, by reference: converting a tensor waits for it, which
    a step must not pay. Every ``FOLD_EVERY`` steps, and at :meth:`take`, the kept
    results are converted and summed, so memory stays bounded however long the
    interval is.
    """

    def __init__(self) -> None:
        self._kept: list[Any] = []
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, result: Any) -> None:
        self._kept.append(result)
        if len(self._kept) >= FOLD_EVERY:
            self._fold()

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
        for result in self._kept:
            for key, value in scalars(result).items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
        self._kept.clear()
