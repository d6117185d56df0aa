"""Training that heals: a diverging loss rolls the run back instead of ending it.

``on_divergence=asv.Rollback(...)``: after each step the loss is looked at (a step's
``"loss"`` or its bare number; ``fit``'s batch logs). A non-finite loss, or with
``spike_factor`` one above that many times the median of the last ``window`` losses, is a
divergence. The session then restores the newest *healthy* checkpoint (its loss and every
value it saved were finite) at least ``lookback`` steps before it, moves the data
(``train(epochs=)``, ``fit``) past the batch that diverged and ``skip`` more, writes a
marker into the events file, commits the restored state as the first checkpoint of a new
branch of the history and goes on; no checkpoint of non-finite state is ever committed.
The large-model logbooks (PaLM, OPT) did this by hand: restart some steps before the spike
and skip the batches around it.

The window of recent losses is part of the saved state (restored at a restart and at a
rollback, as it was at that checkpoint), and the rollbacks are counted in the logdir's
history: ``max_rollbacks`` counts the rollbacks of the *run*, across restarts. After that
many, the session stops with ``DivergedError``, which says what happened, and so does a
restart that meets a divergence again.
"""

from __future__ import annotations

import collections
import math
import numbers
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .means import scalar_parts


class Rollback:
    """What to do when the loss diverges: roll back (see the module's docstring).

    ``max_rollbacks`` counts per run: the rollbacks the logdir's history records, across
    restarts, sessions and ``asupervisor run``'s attempts (not per process). After that
    many, a divergence ends the session with ``DivergedError``; raise it to go on.
    """

    def __init__(
        self,
        *,
        max_rollbacks: int = 3,
        spike_factor: float | None = None,
        window: int = 100,
        lookback: int = 0,
        skip: int = 0,
    ) -> None:
        self.max_rollbacks = _whole("max_rollbacks", max_rollbacks, 1)
        if spike_factor is not None and (
            isinstance(spike_factor, bool)
            or not isinstance(spike_factor, numbers.Real)
            or not 1 < float(spike_factor) < math.inf
        ):
            raise ValueError(f"spike_factor must be a number > 1 or None, not {spike_factor!r}")
        self.spike_factor = None if spike_factor is None else float(spike_factor)
        self.window = _whole("window", window, 2)
        self.lookback = _whole("lookback", lookback, 0)
        self.skip = _whole("skip", skip, 0)

    def __repr__(self) -> str:
        return (
            f"Rollback(max_rollbacks={self.max_rollbacks}, spike_factor={self.spike_factor}, "
            f"window={self.window}, lookback={self.lookback}, skip={self.skip})"
        )


def _whole(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, not {value!r}")
    return int(value)


def loss_of(result: Any) -> float | None:
    """The step's loss as a number (this waits for it), or ``None`` if it has none."""
    parts = scalar_parts(result)
    if "loss" not in parts:
        return None
    try:
        return float(parts["loss"])
    except (TypeError, ValueError):
        return None


class LossWatch:
    """The losses of the recent steps, and whether the newest diverges. Its window is
    kept in every checkpoint (``state``/``restore``, the kept-state protocol)."""

    def __init__(self, policy: Rollback) -> None:
        self.policy = policy
        self._recent: collections.deque[float] = collections.deque(maxlen=policy.window)

    def diverges(self, loss: float) -> str | None:
        """``"non-finite"``, ``"spike"`` or ``None``; a loss that does not diverge joins
        the window the next ones are measured against."""
        if not math.isfinite(loss):
            return "non-finite"
        factor, recent = self.policy.spike_factor, self._recent
        if factor is not None and len(recent) >= max(2, self.policy.window // 4):
            median = statistics.median(recent)
            if median > 0 and loss > factor * median:
                return "spike"
        recent.append(loss)
        return None

    def accepts_all(self, losses: Sequence[float]) -> bool:
        """Many steps' losses at once (a call of ``steps_per_loop`` steps): ``True`` when
        none can diverge (each is finite, and no spike rule compares them with the
        window), and they joined the window; ``False``, the window untouched, when each
        must be looked at in turn (``diverges``) to find the first that diverges."""
        if self.policy.spike_factor is not None or not all(map(math.isfinite, losses)):
            return False
        self._recent.extend(losses)
        return True

    def state(self) -> dict[str, Any]:
        return {"recent": list(self._recent)}

    def restore(self, state: Mapping[str, Any]) -> None:
        """The window as the restored checkpoint saved it (a fresh one if it has none)."""
        recent = state.get("recent", [])
        self._recent.clear()
        if isinstance(recent, list):
            self._recent.extend(float(x) for x in recent if isinstance(x, (int, float)))
