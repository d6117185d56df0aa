"""Argument checks: every setting is checked once, with a ValueError naming it."""

from __future__ import annotations

import math
from typing import Any


def non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, not {value!r}")
    if math.isinf(value):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return float(value)


def positive(name: str, value: Any) -> float:
    if non_negative(name, value) == 0:
        raise ValueError(f"{name} must be > 0, not {value!r}")
    return float(value)


def optional_positive(name: str, value: Any) -> float | None:
    return None if value is None else positive(name, value)


def optional_positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, not {value!r}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, not {value!r}")
    return value


def optional_callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or None, not {value!r}")
    return value
