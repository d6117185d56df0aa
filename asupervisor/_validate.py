"""Argument checks: every setting is checked once, with a ValueError naming it.

Numbers from configs and numpy are numbers: ``np.int64(5)`` is an int, ``np.float32(5)``
a float (both register with :mod:`numbers`); a bool is neither.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def _real(name: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {what}, not {value!r}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"{name} must be {what}, not {value!r}")
    if math.isinf(number):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return number


def _integer(name: str, value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {what}, not {value!r}")
    return int(value)


def non_negative(name: str, value: Any) -> float:
    number = _real(name, value, "a number >= 0")
    if number < 0:
        raise ValueError(f"{name} must be a number >= 0, not {value!r}")
    return number


def positive(name: str, value: Any) -> float:
    number = _real(name, value, "a number > 0")
    if number <= 0:
        raise ValueError(f"{name} must be a number > 0, not {value!r}")
    return number


def optional_positive(name: str, value: Any) -> float | None:
    return None if value is None else positive(name, value)


def optional_positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    number = _integer(name, value, "a positive int or None")
    if number <= 0:
        raise ValueError(f"{name} must be a positive int or None, not {value!r}")
    return number


def non_negative_int(name: str, value: Any) -> int:
    number = _integer(name, value, "an int >= 0")
    if number < 0:
        raise ValueError(f"{name} must be an int >= 0, not {value!r}")
    return number


def boolean(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise ValueError(f"{name} must be True or False, not {value!r}")


def optional_callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable or None, not {value!r}")
    return value
