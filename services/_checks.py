"""Argument checks for the standard services (they use only asupervisor's public API)."""

from __future__ import annotations

import math
from typing import Any


def positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, not {value!r}")
    if math.isinf(value):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return float(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return value
