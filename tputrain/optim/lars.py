"""LARS: SGD with momentum and a layer-wise trust ratio (You et al., 2017).

With very large batches one global learning rate is too large for some layers
and too small for others: the ratio between a layer's weight norm and its
gradient norm varies by orders of magnitude. LARS scales each variable's step by
its own "trust ratio" `eta * ||w|| / (||g|| + weight_decay * ||w||)`, which is
what lets ResNet-50 train at batch 32k on TPU pods.

Biases and normalization scales/offsets are excluded from both the trust ratio
and weight decay (they are small, 1-D, and adapting them hurts): every variable
of rank <= 1 and every variable whose name matches one of
`exclude_from_adaptation` takes a plain momentum-SGD step.
"""

from __future__ import annotations

import re
from typing import Sequence

import keras
from keras import ops

DEFAULT_EXCLUDE = ("bias", "gamma", "beta")


@keras.saving.register_keras_serializable(package="tputrain")
class LARS(keras.optimizers.Optimizer):
    """Layer-wise adaptive rate scaling on top of momentum SGD.

    For an adapted variable `w` with gradient `g` (paper's Algorithm 1):

        trust = eta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)   (1 if a norm is 0)
        v     = momentum * v + learning_rate * trust * (g + weight_decay * w)
        w     = w - v          (nesterov: w - momentum * v - learning_rate * trust * (g + wd w))

    Excluded variables (see the module docstring) use `trust = 1` and no decay.

    Args:
      learning_rate: float or schedule (the global rate, before trust ratios).
      momentum: heavy-ball momentum.
      weight_decay: L2 coefficient added to the gradient of adapted variables.
        Not Keras' decoupled decay: it is part of the trust ratio, as in the paper.
      eta: trust coefficient ("how far to trust the layer's own ratio").
      epsilon: keeps the ratio finite when both norms are tiny.
      nesterov: Nesterov momentum.
      exclude_from_adaptation: regexes searched in each variable's name (and path).
      **kwargs: base optimizer options (global_clipnorm, name, ...).
    """

    def __init__(self, learning_rate=0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, epsilon: float = 1e-9, nesterov: bool = False,
                 exclude_from_adaptation: Sequence[str] | None = DEFAULT_EXCLUDE,
                 name: str = "lars", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0 or eta <= 0:
            raise ValueError(f"LARS needs weight_decay >= 0 and eta > 0, got {weight_decay}, {eta}")
        self.momentum = float(momentum)
        self.lars_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)
        self.exclude_from_adaptation = tuple(exclude_from_adaptation or ())

    def is_adapted(self, variable) -> bool:
        """True if `variable` gets the trust ratio and weight decay (rank >= 2, no match)."""
        if len(variable.shape) <= 1:
            return False
        names = (str(variable.name), str(getattr(variable, "path", "")))
        return not any(re.search(pattern, name)
                       for pattern in self.exclude_from_adaptation for name in names)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._adapted = [self.is_adapted(v) for v in variables]
        self.momentums = self.add_optimizer_variables(variables, "momentum")

    def update_step(self, gradient, variable, learning_rate):
        """One variable's update; runs wherever Keras applies gradients (any context)."""
        index = self._get_variable_index(variable)
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        if self._adapted[index]:
            decay = ops.cast(self.lars_weight_decay, variable.dtype)
            w_norm = ops.sqrt(ops.sum(ops.square(variable)))
            g_norm = ops.sqrt(ops.sum(ops.square(gradient)))
            ratio = self.eta * w_norm / (g_norm + decay * w_norm + self.epsilon)
            positive = ops.logical_and(ops.greater(w_norm, 0), ops.greater(g_norm, 0))
            lr = lr * ops.where(positive, ratio, ops.ones_like(ratio))
            gradient = gradient + decay * variable
        velocity = self.momentums[index]
        momentum = ops.cast(self.momentum, variable.dtype)
        step = lr * gradient
        self.assign(velocity, momentum * velocity + step)
        if self.nesterov:
            self.assign_sub(variable, momentum * velocity + step)
        else:
            self.assign_sub(variable, velocity)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(momentum=self.momentum, weight_decay=self.lars_weight_decay, eta=self.eta,
                      epsilon=self.epsilon, nesterov=self.nesterov,
                      exclude_from_adaptation=list(self.exclude_from_adaptation))
        return config
