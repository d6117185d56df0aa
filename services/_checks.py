"""Argument checks for the standard services (they use only asupervisor's public API).

Numbers from configs and numpy are numbers (``np.int64``, ``np.float32``); a bool is not.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) >= 0:
        raise ValueError(f"{name} must be a number >= 0, not {value!r}")
    if math.isinf(value):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return float(value)


def positive(name: str, value: Any) -> float:
    if non_negative(name, value) == 0:
        raise ValueError(f"{name} must be a number > 0, not {value!r}")
    return float(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return int(value)
