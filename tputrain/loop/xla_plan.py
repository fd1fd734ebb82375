"""What `Trainer.jit_compile` compiles for this model and strategy, and why.

Decided once, at start-up, by the run plan (`RunPlan.with_xla`): the step
(`tputrain.loop.step.StepBuilder`) reads the decision, the start-up line logs its
reason. Only a step XLA refuses changes it later (`RunPlan.without_xla`).

Under a mixed policy on a CPU, `jit_compile="auto"` leaves the matmuls to oneDNN
(XLA's CPU backend has none for bf16) and compiles only what XLA fuses well and
oneDNN does not: the optimizer's update, and each exact GELU and layer norm
(`tputrain.loop.step.ElementwiseFusion`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tputrain.distribution.strategy import without_gpus
from tputrain.loop.convolutions import convolutions_on_onednn, has_convolutions
from tputrain.loop.random_draws import xla_refusal
from tputrain.loop.update import refusal as update_refusal


class XlaPlan(NamedTuple):
    """What `jit_compile` compiles (`decide_xla`), and why."""

    whole_step: bool
    gradients_only: bool
    why: str
    apply_only: bool = False  # the optimizer's update alone
    fuse_elementwise: bool = False  # ElementwiseFusion: GELUs (XLA) and layer norms
    apply_per_replica: bool = False  # the update as one XLA program a device (loop/update.py)
    fuse_batch_norm: bool = False  # batch norms as TensorFlow's fused kernel (loop/batch_norm.py)


# What a step runs with when XLA is off (configured, or refused by the step).
XLA_OFF = XlaPlan(False, False, "off")


def fused_forward(plan: XlaPlan, auto: bool) -> XlaPlan:
    """`plan`, with batch norms as TensorFlow's fused kernel (`tputrain.loop.batch_norm`)
    when `auto` (jit_compile="auto", tputrain's own step, not a TPU) leaves the
    forward pass to TensorFlow's kernels."""
    return plan._replace(fuse_batch_norm=auto and not (plan.whole_step or plan.gradients_only))


def decide_xla(jit_compile: bool | str, precision: str, custom_train_step: bool,
               strategy: tf.distribute.Strategy, model: keras.Model,
               optimizer: keras.optimizers.Optimizer, features_spec: Any) -> XlaPlan:
    """What `jit_compile` compiles for `model` under `strategy` (and `fused_forward`).

    `features_spec`: one micro-batch's features, for counting the model's random draws.
    """
    decision = _Decision(jit_compile, precision, custom_train_step, strategy, model,
                         optimizer, features_spec)
    return fused_forward(decision.plan(),
                         jit_compile == "auto" and not decision.on_tpu and not custom_train_step)


class _Decision:
    """The facts `decide_xla` weighs; the model's random draws are counted once, if asked."""

    def __init__(self, jit_compile: bool | str, precision: str, custom_train_step: bool,
                 strategy: tf.distribute.Strategy, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, features_spec: Any):
        self.jit_compile = jit_compile
        self.precision = precision
        self.custom_train_step = custom_train_step
        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.features_spec = features_spec
        self.on_tpu = isinstance(strategy, tf.distribute.TPUStrategy)
        self._random_refusal: str | None = ""  # "": not yet found

    def plan(self) -> XlaPlan:
        if self.on_tpu:
            return XlaPlan(False, False, "on (TPU: always compiled)")
        replicas = self.strategy.num_replicas_in_sync
        if self.jit_compile is True:
            if replicas == 1:
                return XlaPlan(True, False, "on (the whole step)")
            per_device = self.per_device_refusal(compile_any=True) is None
            return XlaPlan(False, True, "on (forward and backward; the update on each device)"
                           if per_device else "on (forward and backward only)",
                           apply_per_replica=per_device)
        if self.jit_compile != "auto":
            return XLA_OFF
        on_cpu = without_gpus(self.strategy)
        if not self.custom_train_step and convolutions_on_onednn(self.model, on_cpu):
            # bf16 on one replica keeps the GELU and layer-norm programs (no update).
            return XlaPlan(False, False, "auto: off for convolutions on oneDNN (CPU)",
                           fuse_elementwise=replicas == 1 and self.precision == "mixed_bfloat16")
        if replicas > 1:
            return self.replicas_plan(replicas, on_cpu)
        return self.one_replica_plan(on_cpu)

    def replicas_plan(self, replicas: int, on_cpu: bool) -> XlaPlan:
        """"auto" on several replicas: the update on each device, where it compiles."""
        why = self.per_device_refusal(compile_any=False)
        if why is None and self.compiles_convolutions(on_cpu):
            # A small ResNet on 2 CPU replicas ran more steps per CPU-second.
            return XlaPlan(False, True, "auto: forward and backward (convolutions) and "
                           f"the optimizer update on each of {replicas} replicas' devices",
                           apply_per_replica=True)
        if why is None:
            return XlaPlan(False, False, f"auto: the optimizer update on each of {replicas} "
                           "replicas' devices", apply_per_replica=True)
        return XlaPlan(False, False, f"auto: off on {replicas} replicas ({why})")

    def one_replica_plan(self, on_cpu: bool) -> XlaPlan:
        """"auto" on one replica (no convolutions on oneDNN)."""
        if on_cpu and self.precision == "mixed_bfloat16" and self.compiles_convolutions(on_cpu):
            # TensorFlow's bf16 convolutions on a CPU are far slower uncompiled.
            return XlaPlan(True, False, "auto: the whole step for convolutions in "
                           f"{self.precision} on CPU")
        if on_cpu and self.precision == "mixed_bfloat16" and not self.custom_train_step:
            # XLA's CPU backend has no oneDNN bf16 matmuls, so only the update and
            # the GELUs compile (docs/performance.md).
            return XlaPlan(False, False, f"auto: for {self.precision} on CPU the optimizer "
                           "update and GELUs only (matmuls stay on oneDNN)",
                           apply_only=True, fuse_elementwise=True)
        if on_cpu and self.precision != "float32":
            return XlaPlan(False, False, f"auto: off for {self.precision} on CPU")
        if on_cpu and self.random_refusal():
            # XLA's CPU draws are slow but for Keras's, made by ThreeFry (xla_dropout.py).
            return XlaPlan(False, False, self.random_refusal())
        return XlaPlan(True, False, "auto: the whole step, if it compiles")

    def compiles_convolutions(self, on_cpu: bool) -> bool:
        """With "auto", on CPUs without oneDNN (`plan` handles those first): whether forward
        and backward compile for a conv net with few random draws (XLA fuses around them)."""
        return (on_cpu and self.precision in ("float32", "mixed_bfloat16")
                and not self.custom_train_step
                and has_convolutions(self.model) and not self.random_refusal())

    def random_refusal(self) -> str | None:
        """`random_draws.xla_refusal` for the model, found once."""
        if self._random_refusal == "":
            self._random_refusal = xla_refusal(self.model, self.features_spec)
        return self._random_refusal

    def per_device_refusal(self, compile_any: bool) -> str | None:
        """Why the update is not one XLA program per device on N replicas, or None."""
        if self.custom_train_step:
            return "a Task.train_step override"
        if self.precision not in ("float32", "mixed_bfloat16"):
            return f"precision {self.precision}"
        return update_refusal(self.optimizer, compile_any=compile_any)
