"""Optimizer construction from gin: the default `Task.build_optimizer`.

Names: "adam", "adamw", "sgd" (with momentum), "lamb" (Keras 3's LAMB) and
"lars" (`tputrain.optim.lars.LARS`). The learning rate may be a schedule, e.g.
`build_optimizer.learning_rate = @warmup_schedule()` (see `tputrain.optim.schedules`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import keras

from tputrain.optim.lars import LARS
from tputrain.precision import wrap_optimizer_for_policy

_OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adamw": keras.optimizers.AdamW,
    "sgd": keras.optimizers.SGD,
    "lamb": keras.optimizers.Lamb,
    "lars": LARS,
}
_WITH_MOMENTUM = ("sgd", "lars")


def _check_learning_rate(learning_rate: Any) -> Any:
    """A number must be finite and not negative (a negative rate climbs the loss: a
    run that "succeeds" and exports the result); an int is taken as a float
    (Keras refuses `1` as "should be float"). Schedules and callables pass."""
    if isinstance(learning_rate, bool):
        raise TypeError(f"build_optimizer.learning_rate={learning_rate} is a bool: pass a "
                        "float such as 1e-3, or a schedule")
    if isinstance(learning_rate, (int, float)):
        if not math.isfinite(learning_rate) or learning_rate < 0:
            raise ValueError(f"build_optimizer.learning_rate={learning_rate} would not train "
                             "(negative or not finite): pass a positive float such as 1e-3")
        return float(learning_rate)
    return learning_rate


def build_optimizer(name: str = "adam",
                    learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 1e-3,
                    weight_decay: float | None = None,
                    momentum: float = 0.9,
                    global_clipnorm: float | None = None,
                    exclude_from_weight_decay: Sequence[str] | None = None,
                    **kwargs) -> keras.optimizers.Optimizer:
    """Builds a Keras 3 optimizer; wraps it for loss scaling under mixed_float16.

    Call inside `strategy.scope()` (the Trainer does) so slot variables are
    mirrored. `global_clipnorm` clips the gradients of all variables together by
    their global norm before the update (the gradients summed over replicas: the
    Trainer all-reduces before `apply`, see `tputrain.distribution.allreduce`). `weight_decay` is Keras' decoupled decay
    (`w -= lr * wd * w`) for adam/adamw/sgd/lamb, and the paper's L2 term inside
    the trust ratio for lars. `exclude_from_weight_decay` lists substrings of
    variable names that get no decay, e.g. `['bias', 'gamma', 'beta']` (LARS
    already skips biases and norms). Extra keyword arguments go to the Keras
    optimizer unchanged.
    """
    key = name.lower()
    if key not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: use one of {sorted(_OPTIMIZERS)}")
    options = dict(kwargs, learning_rate=_check_learning_rate(learning_rate),
                   global_clipnorm=global_clipnorm)
    if weight_decay is not None:
        options["weight_decay"] = weight_decay
    if key in _WITH_MOMENTUM:
        options["momentum"] = momentum
    optimizer = _OPTIMIZERS[key](**options)
    if exclude_from_weight_decay:
        if key == "lars":
            optimizer.exclude_from_adaptation += tuple(exclude_from_weight_decay)
        else:
            optimizer.exclude_from_weight_decay(var_names=list(exclude_from_weight_decay))
    return wrap_optimizer_for_policy(optimizer)
