"""Precision policy: which dtype layers compute in, and the helpers that keep it safe.

Under a mixed policy ("mixed_bfloat16", "mixed_float16") Keras keeps every variable
(and optimizer slot) in float32, so small updates are not rounded away, while layers
compute in the low-precision dtype, which is where the speed comes from (half the
bytes a value, and bf16 matmul units on TPUs and on CPUs with AVX512_BF16). Logits
and losses should be float32: softmax/cross-entropy and loss sums lose too much in
16 bits, and adding a bf16 loss to a float32 regularization loss fails. `to_float32` does that cast.

float16 (GPUs) also needs loss scaling, or small gradients underflow to zero:
`wrap_optimizer_for_policy` adds it. bfloat16 has float32's exponent range and needs
none, which is why it is the TPU default.

Set the policy before building the model: layers read it when they are created.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.core import tracing
from tputrain.observe.console import default_progress

VALID_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def set_precision_policy(
    name: str | None = None, strategy: tf.distribute.Strategy | None = None
) -> str:
    """Sets the global Keras dtype policy and returns its name.

    Args:
      name: one of `VALID_POLICIES`, or None for the hardware default:
        "mixed_bfloat16" under a TPUStrategy (TPUs compute natively in bf16),
        "float32" elsewhere (bf16 on GPUs/CPUs is not always faster, and float32
        is exact to compare against).
      strategy: the strategy the model will run under; None means the current one
        (`tf.distribute.get_strategy()`). Only used when `name` is None.

    Call it per host, before building the model.
    """
    if name is None:
        strategy = strategy or tf.distribute.get_strategy()
        name = "mixed_bfloat16" if _is_tpu_strategy(strategy) else "float32"
    if name not in VALID_POLICIES:
        raise ValueError(
            f"Unknown precision policy {name!r}: use one of {', '.join(VALID_POLICIES)}, "
            f"or None for the default (mixed_bfloat16 on TPU, else float32)."
        )
    keras.mixed_precision.set_global_policy(name)
    default_progress()  # often called before any Trainer
    logging.info("tputrain: precision policy %s.", name)
    return name


@contextlib.contextmanager
def users_policy_kept() -> Iterator[None]:
    """The global Keras policy as the block found it, set again after it: a run sets
    its own while it builds its model (layers keep theirs) and leaves the user's, so
    the user's next Keras model computes as before the run."""
    previous = keras.mixed_precision.global_policy()
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


@contextlib.contextmanager
def run_policy(name: str) -> Iterator[None]:
    """The run's policy `name` (`RunPlan.precision`) while a later part of it builds
    (an optimizer for LoRA, the model an export restores), the user's after."""
    with users_policy_kept():
        keras.mixed_precision.set_global_policy(name)
        yield


def resolve_precision(name: str | None, strategy: tf.distribute.Strategy) -> str:
    """The one place a run's precision is set: `PrecisionOptions.policy` (a gin
    `set_precision_policy.name` is its deprecated alias, `tputrain.config.registry`),
    else the hardware default."""
    return set_precision_policy(name, strategy=strategy)


def wrap_optimizer_for_policy(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """Adds loss scaling if the global policy is mixed_float16; else returns `optimizer`.

    float16 gradients underflow without it. In a custom loop, compute gradients of
    `optimizer.scale_loss(loss)`; `apply_gradients` unscales them and skips steps
    whose gradients overflowed. Wrapping twice is avoided.
    """
    if keras.mixed_precision.global_policy().name != "mixed_float16":
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    return keras.optimizers.LossScaleOptimizer(optimizer)


@tracing.graph_helper
def to_float32(structure: Any) -> Any:
    """Casts every floating tensor (and NumPy array) in a nest to float32.

    Use on logits and per-example losses under a mixed policy; integer tensors
    (labels, masks) and non-tensors are returned unchanged. Works inside
    `strategy.run` (per replica) and outside it.
    """

    def cast(x: Any) -> Any:
        if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating):
            return x.astype(np.float32)
        if tf.is_tensor(x) and x.dtype.is_floating and x.dtype != tf.float32:
            return tf.cast(x, tf.float32)
        return x

    return tf.nest.map_structure(cast, structure)


def _is_tpu_strategy(strategy: tf.distribute.Strategy | None) -> bool:
    tpu_classes = tuple(
        cls
        for cls in (
            getattr(tf.distribute, "TPUStrategy", None),
            getattr(tf.distribute.experimental, "TPUStrategy", None),
        )
        if cls is not None
    )
    return isinstance(strategy, tpu_classes)
