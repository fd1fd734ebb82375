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


def check_bool(owner: str, name: str, value: Any, allow_none: bool = False) -> bool | None:
    """Returns `value` if it is True or False (or None when allowed), else TypeError:
    `shuffle="no"` is truthy, and would silently shuffle."""
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    raise TypeError(f"{owner}.{name} must be True or False{' or None' if allow_none else ''}, "
                    f"got {value!r}")


def per_replica_batch(global_batch: int, replicas: int, micro_batches: int = 1) -> int:
    """`global_batch` split over `replicas` (and `micro_batches` each); ValueError
    naming a batch that works if it does not split evenly, since a remainder would
    leave replicas with different shapes (TPUs compile one) or empty."""
    if global_batch % replicas:
        raise ValueError(
            f"global batch {global_batch} is not divisible by {replicas} replicas: "
            f"use a multiple of {replicas} (e.g. {nearest_multiple(global_batch, replicas)})")
    if global_batch % (replicas * micro_batches):
        raise ValueError(
            f"global batch {global_batch} does not split into {micro_batches} "
            f"micro-batches over {replicas} replicas: use a multiple of "
            f"{replicas * micro_batches}")
    return global_batch // (replicas * micro_batches)


def nearest_multiple(value: int, factor: int) -> int:
    """The positive multiple of `factor` nearest `value`: the batch to suggest."""
    return factor * max(1, round(value / factor))
