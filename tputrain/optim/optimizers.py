"""Optimizer construction from gin: the default `Task.build_optimizer`.

Names: "adam", "adamw", "sgd" (with momentum), "lamb" (Keras 3's LAMB) and
"lars" (`tputrain.optim.lars.LARS`). The learning rate may be a schedule, e.g.
`build_optimizer.learning_rate = @warmup_schedule()` (see `tputrain.optim.schedules`).
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Mapping, Sequence

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


def _keywords(cls: type) -> set[str]:
    """The keyword arguments `cls(...)` takes: its and its bases' `__init__`s' named ones
    (a Keras optimizer passes `**kwargs` on to its base class, which refuses the rest)."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {parameter.name for klass in cls.__mro__ if "__init__" in vars(klass)
            for parameter in inspect.signature(vars(klass)["__init__"]).parameters.values()
            if parameter.kind in named} - {"self"}


def check_arguments(name: str, extra: Mapping[str, Any]) -> None:
    """Refuses an unknown optimizer name, or an extra keyword argument the named Keras
    optimizer does not take, naming the nearest valid one. `build_optimizer` passes
    extra keywords on, so gin accepts any name there: the CLI checks them right after
    parsing, before anything is built (`tputrain.config.parsing`)."""
    key = name.lower()
    if key not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: use one of {sorted(_OPTIMIZERS)}")
    valid = _keywords(_OPTIMIZERS[key]) | set(inspect.signature(build_optimizer).parameters)
    for argument in extra:
        if argument not in valid:
            close = difflib.get_close_matches(argument, sorted(valid), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(valid))}"
            raise ValueError(f"build_optimizer: the {key!r} optimizer takes no argument "
                             f"{argument!r}{hint}")


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
    check_arguments(name, kwargs)
    key = name.lower()
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
