"""The builders a run calls when its caller passes none, as configured.

`Trainer(strategy=None)` resolves a strategy, `Task.build_optimizer` builds an
optimizer, `configure_devices` applies a parsed config's devices. Without gin these
are the plain library functions; the gin registry (`tputrain.config.registry`)
installs its configured versions here when it loads, so a config's
`resolve_strategy.*` and `build_optimizer.*` bindings apply. This module imports
nothing of tputrain: the Trainer and the Task reach the configured builders without
importing the package above them (no import cycle).
"""

from __future__ import annotations

from typing import Any, Callable

_INSTALLED: dict[str, Callable[..., Any]] = {}
NAMES = ("resolve_strategy", "build_optimizer", "configure_devices")


def install(name: str, builder: Callable[..., Any]) -> None:
    """Makes `builder` the one runs call for `name` (the gin registry's configured one)."""
    if name not in NAMES:
        raise ValueError(f"builders.install: {name!r} is not one of {NAMES}")
    _INSTALLED[name] = builder


def configured(name: str, default: Callable[..., Any]) -> Callable[..., Any]:
    """The installed builder for `name`, else `default` (the plain library function)."""
    return _INSTALLED.get(name, default)
