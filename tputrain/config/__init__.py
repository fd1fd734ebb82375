"""Gin at the edges: what gin can configure, and config files parsed with the fix named.

* `registry`: every configurable registered in one place (the library itself takes
  plain arguments), with the deprecated aliases of old names;
* `parsing`: `parse_gin` (what the CLI calls), errors that name the nearest valid
  binding, the operative config written to model_dir.

`registry` installs the configured `resolve_strategy`/`build_optimizer` that
`Trainer(strategy=None)` and `Task.build_optimizer` call in `tputrain.core.builders`
(the bottom wing, which the Trainer, the Task and `distribution` import down).

`tputrain.config.parse_gin` and the other public names of `parsing` are importable
from here as before (`tputrain.config` was one module), loaded at first use so that
importing this package imports neither gin nor TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

# What `tputrain.config` held before it became a package: loaded from `parsing` at first use.
_PARSING = ("ConfigError", "bound_or", "builtin_config_dir", "clear_config",
            "explain_gin_error", "parse_gin", "read_as_data", "require_bound",
            "without_gin_notes", "write_operative_config")

__all__ = list(_PARSING)


def __getattr__(name: str) -> Any:
    if name not in _PARSING:
        raise AttributeError(f"module 'tputrain.config' has no attribute {name!r}")
    value = getattr(importlib.import_module("tputrain.config.parsing"), name)
    globals()[name] = value
    return value
