"""Precision: which dtype a run computes in, and how to check that it is safe.

- `policy`: the global precision policy, loss scaling, `to_float32` for logits and
  losses (its names are re-exported here, so `tputrain.precision.to_float32` keeps
  working).
- `layers`: keep named layers in float32 under a mixed policy
  (`PrecisionOptions.keep_float32_layers`).
- `audit`: `tputrain audit-precision`, which layers drift in bf16/fp16 and whether
  the drift changes the metrics.
"""

from tputrain.precision.policy import (VALID_POLICIES, resolve_precision, set_precision_policy,
                                       to_float32, wrap_optimizer_for_policy)

__all__ = ["VALID_POLICIES", "resolve_precision", "set_precision_policy", "to_float32",
           "wrap_optimizer_for_policy"]
