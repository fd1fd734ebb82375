"""0-d and 1-element variables train as without XLA, under every XLA plan and optimizer.

Issue 32, item 1: a regression model ending in `Dense(1)` with an MSE loss got NaN
in that layer's bias (and its Adam slot) after one step with tputrain's defaults on
one replica, then stopped with `NonFiniteError`. The model here is a regression
with a 0-d weight and weights of shape [1] and [1, 1] besides ordinary ones, unlike
the built-in tasks; each optimizer `build_optimizer` offers trains it under each
XLA plan, and every weight and optimizer variable must end where the uncompiled
step (`jit_compile=False`, one replica) puts it.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.optim.optimizers import _OPTIMIZERS
from tiny import strategy_for

STEPS = 4


class Gain(keras.layers.Layer):
    """Multiplies by one learned scalar: a 0-d weight."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="ones", name="gain")

    def call(self, inputs):
        return inputs * tf.cast(self.gain, inputs.dtype)


class GainRegressionTask(tputrain.Task):
    """Least squares: Dense(3) -> Dense(1) (bias [1]) -> Dense(1) (kernel [1, 1]) -> Gain."""

    def __init__(self, optimizer: str):
        rng = np.random.RandomState(0)
        self.x = rng.randn(64, 5).astype(np.float32)
        self.y = (self.x @ rng.randn(5, 1) + 0.5).astype(np.float32)
        self.optimizer = optimizer

    def build_model(self) -> keras.Model:
        inputs = keras.Input((5,), name="x")
        hidden = keras.layers.Dense(3, activation="tanh")(inputs)
        one = keras.layers.Dense(1)(hidden)
        outputs = Gain(dtype="float32")(keras.layers.Dense(1, dtype="float32")(one))
        return keras.Model({"x": inputs}, outputs)

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x}, self.y))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.repeat().batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        return keras.losses.mean_squared_error(labels, outputs)

    def build_optimizer(self):
        return tputrain.build_optimizer(self.optimizer, learning_rate=0.01)


def trained(optimizer: str, model_dir: str, replicas: int = 1, **kwargs) -> tputrain.Trainer:
    """STEPS steps of the train loop (no eval or checkpoint: they do not matter here)."""
    trainer = tputrain.Trainer(GainRegressionTask(optimizer), model_dir,
                               strategy=strategy_for(replicas), train_steps=STEPS,
                               steps_per_loop=STEPS, global_batch_size=16,
                               checkpoint_every=10**6, eval_steps=1, report_mfu=False,
                               **kwargs)
    trainer.run_loop(STEPS)
    return trainer


def state(trainer: tputrain.Trainer) -> list[tuple[str, np.ndarray]]:
    """Every model and optimizer variable: (path, value; a mirrored one's first copy)."""
    return [(v.path, np.array(v.numpy()))
            for v in [*trainer.model.variables, *trainer.optimizer.variables]]


_UNCOMPILED: dict[tuple[str, str], list[tuple[str, np.ndarray]]] = {}


def uncompiled(optimizer: str, precision: str, tmp_path_factory) -> list[tuple[str, np.ndarray]]:
    """The reference: the same steps as TensorFlow kernels on one replica (once each)."""
    key = (optimizer, precision)
    if key not in _UNCOMPILED:
        model_dir = str(tmp_path_factory.mktemp(f"uncompiled-{optimizer}-{precision}"))
        _UNCOMPILED[key] = state(trained(optimizer, model_dir, jit_compile=False,
                                         precision=precision))
    return _UNCOMPILED[key]


# plan -> (Trainer options, what its XLA plan must be)
PLANS = {
    "whole_step": (dict(), lambda plan: plan.whole_step),
    "update_only": (dict(precision="mixed_bfloat16"), lambda plan: plan.apply_only),
    "update_on_each_device": (dict(replicas=2), lambda plan: plan.apply_per_replica),
    "none_on_2_replicas": (dict(replicas=2, jit_compile=False),
                           lambda plan: not (plan.whole_step or plan.apply_per_replica)),
}


# The default run trains each optimizer under one plan, every plan at least once (the
# diagonal); `--slow` adds the rest of the matrix.
# (Adam on the whole step is the case the issue found.)
DIAGONAL = {("adam", "whole_step"), ("adamw", "update_only"), ("lamb", "update_on_each_device"),
            ("lars", "none_on_2_replicas"), ("sgd", "whole_step")}
assert {name for name, _ in DIAGONAL} == set(_OPTIMIZERS), "one of each optimizer"


@pytest.mark.parametrize("optimizer, plan", [
    pytest.param(name, plan, marks=() if (name, plan) in DIAGONAL else pytest.mark.slow)
    for plan in sorted(PLANS) for name in sorted(_OPTIMIZERS)])
def test_scalar_and_one_element_variables_train_as_without_xla(tmp_path_factory, optimizer,
                                                                plan):
    options, expected_plan = PLANS[plan]
    precision = options.get("precision", "float32")
    trainer = trained(optimizer, str(tmp_path_factory.mktemp(plan)), **options)
    assert expected_plan(trainer._steps.plan())
    assert int(trainer.step.numpy()) == STEPS  # no step tripped the guard
    assert int(trainer.guard.nonfinite_steps.numpy()) == 0
    assert {(), (1,), (1, 1)} <= {tuple(w.shape) for w in trainer.model.weights}
    got = state(trainer)
    want = uncompiled(optimizer, precision, tmp_path_factory)
    assert len(got) == len(want)
    for (path, value), (_, expected) in zip(got, want):  # layer names differ by run
        assert np.all(np.isfinite(value)), path
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=path)
