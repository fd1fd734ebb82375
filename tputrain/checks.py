"""Argument checks shared by the public constructors: one wording, one rule.

A config value of the wrong type must fail at construction, naming the
parameter: `int("abc")` would say "invalid literal for int()" without saying
which one, and `int(250.9)` would silently train 250 steps.
"""

from __future__ import annotations

import numbers
from typing import Any


def check_int(owner: str, name: str, value: Any, minimum: int,
              allow_none: bool = False) -> int | None:
    """Returns `value` as an int; TypeError if it is not a whole number (bools and
    floats included), ValueError if it is below `minimum`."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be an int{' or None' if allow_none else ''}, "
                        f"got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}"
                         f"{' or None' if allow_none else ''}, got {value}")
    return int(value)
