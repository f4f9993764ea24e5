"""Checks of settings, one rule per idea, used by the library and the task scripts alike: a
number that must be positive (or at least some minimum), a whole number that must be, and any
other condition, each failing with an error that names the setting:
``"<name> must be <what is expected>, got <value>"``."""

from __future__ import annotations

import math
import numbers
from typing import Any


def require(condition: bool, name: str, value: Any, expected: str) -> None:
    """Raise ``ValueError("<name> must be <expected>, got <value>")`` unless ``condition``."""
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def is_number(value: Any) -> bool:
    """A real number (Python's or NumPy's); ``True`` is not one, though Python counts it as 1."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive(name: str, value: Any, minimum: float = 0.0, strict: bool = True, optional: bool = False) -> None:
    """A finite number > ``minimum`` (``>=`` unless ``strict``); with ``optional`` also None (a
    setting left unset). A value that is no number at all is a ``TypeError``."""
    if optional and value is None:
        return
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    ok = math.isfinite(value) and (value > minimum if strict else value >= minimum)
    require(ok, name, value, f"a finite number {'>' if strict else '>='} {minimum:g}")


def whole_number(name: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
    """An integer (not a bool, not a float that happens to be whole) >= ``minimum``; with
    ``optional`` also None."""
    expected = f"a whole number >= {minimum}"
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum
    require(ok or (optional and value is None), name, value, f"None or {expected}" if optional else expected)
