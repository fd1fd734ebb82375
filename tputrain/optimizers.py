"""Optimizer construction from gin: the default `Task.build_optimizer`."""

from __future__ import annotations

import gin
import keras

from tputrain.precision import wrap_optimizer_for_policy

_OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adamw": keras.optimizers.AdamW,
    "sgd": keras.optimizers.SGD,
}


@gin.configurable
def build_optimizer(name: str = "adam",
                    learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 1e-3,
                    weight_decay: float | None = None,
                    momentum: float = 0.9,
                    global_clipnorm: float | None = None,
                    **kwargs) -> keras.optimizers.Optimizer:
    """Builds a Keras 3 optimizer; wraps it for loss scaling under mixed_float16.

    Call inside `strategy.scope()` (the Trainer does) so slot variables are
    mirrored. Extra keyword arguments go to the Keras optimizer unchanged.
    """
    key = name.lower()
    if key not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: use one of {sorted(_OPTIMIZERS)}")
    options = dict(kwargs, learning_rate=learning_rate, global_clipnorm=global_clipnorm)
    if weight_decay is not None:
        options["weight_decay"] = weight_decay
    if key == "sgd":
        options["momentum"] = momentum
    return wrap_optimizer_for_policy(_OPTIMIZERS[key](**options))
