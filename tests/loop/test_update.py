"""The optimizer update as one XLA program on each replica's device (loop/update.py).

On 2 replicas the per-device update must give the weights the TensorFlow-kernel
update gives (jit_compile=False), with every Keras optimizer and option, keep the
two devices' copies bitwise equal, and keep the guard's promise.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import TinyTask, spy_calls, strategy_for

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),  # its own _backend_update_step
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "muon": lambda: keras.optimizers.Muon(0.01),
    "schedule_free_adamw": lambda: keras.optimizers.ScheduleFreeAdamW(0.01),
    "global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.02),
    "clipvalue": lambda: keras.optimizers.SGD(0.05, clipvalue=0.002),
    "ema_overwrite": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=2),
    "keras_accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
    "schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(
        0.01, decay_steps=2, decay_rate=0.5)),
    "lars": lambda: tputrain.build_optimizer(name="lars", learning_rate=0.1, weight_decay=1e-3),
}


class OptimizerTask(TinyTask):
    def __init__(self, make_optimizer, **kwargs):
        super().__init__(**kwargs)
        self.make_optimizer = make_optimizer

    def build_optimizer(self):
        return self.make_optimizer()


class EmbeddingTask(TinyTask):
    """Sparse gradients: an embedding lookup of token ids."""

    def __init__(self):
        super().__init__()
        self.x = np.random.RandomState(1).randint(0, 50, size=(256, 8)).astype(np.int64)
        self.y = (self.x[:, 0] > 25).astype(np.int64)

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), dtype="int64", name="x")
        h = keras.layers.Embedding(50, 16)(inputs)
        logits = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model({"x": inputs}, logits)

    def build_optimizer(self):
        return keras.optimizers.Adam(0.05)


def make(task: tputrain.Task, model_dir, train_steps: int = 6, replicas: int = 2,
         **kwargs) -> tputrain.Trainer:
    return tputrain.Trainer(task, str(model_dir), strategy=strategy_for(replicas),
                            train_steps=train_steps, steps_per_loop=min(3, train_steps),
                            global_batch_size=16, checkpoint_every=10**6, eval_steps=1,
                            report_mfu=False, **kwargs)


def train(task: tputrain.Task, model_dir, **kwargs) -> tputrain.Trainer:
    trainer = make(task, model_dir, **kwargs)
    trainer.train()
    return trainer


def run(task: tputrain.Task, model_dir, **kwargs) -> tputrain.Trainer:
    """The train loops alone (6 steps, no eval or final checkpoint: faster to test)."""
    trainer = make(task, model_dir, **kwargs)
    for _ in range(2):
        trainer.run_loop(3)
    assert int(trainer.step.numpy()) == 6
    return trainer


def assert_copies_equal(trainer: tputrain.Trainer) -> None:
    """Every mirrored weight and optimizer variable is bitwise the same on each device."""
    for variable in [*trainer.model.weights, *trainer.optimizer.variables]:
        copies = [np.asarray(c) for c in getattr(variable.value, "values", [variable.value])]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=variable.path)


# Keras's own conditionals around a merge call: the TensorFlow-kernel update on N
# replicas cannot run them ("merge_call called while defining a new graph"); the
# reference is then one replica.
ONE_REPLICA_REFERENCE = {"ema_overwrite", "keras_accumulation"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_device_updates_as_tensorflow_kernels_do(tmp_path, name):
    per_device = run(OptimizerTask(OPTIMIZERS[name]), tmp_path / "xla")
    if name in ONE_REPLICA_REFERENCE:
        kernels = run(OptimizerTask(OPTIMIZERS[name]), tmp_path / "one", replicas=1)
    else:
        kernels = run(OptimizerTask(OPTIMIZERS[name]), tmp_path / "tf", jit_compile=False)
        assert not kernels._steps.plan().apply_per_replica
    assert per_device._steps.plan().apply_per_replica
    assert int(per_device.optimizer.iterations.numpy()) == int(kernels.optimizer.iterations.numpy())
    assert_copies_equal(per_device)
    for got, want in zip(per_device.model.get_weights(), kernels.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_sparse_gradients_update_on_each_device(tmp_path):
    per_device = run(EmbeddingTask(), tmp_path / "xla")
    kernels = run(EmbeddingTask(), tmp_path / "tf", jit_compile=False)
    assert per_device._steps.plan().apply_per_replica
    assert_copies_equal(per_device)
    for got, want in zip(per_device.model.get_weights(), kernels.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def nan_at_step_2(value: float) -> OptimizerTask:
    """Adam on data with `value` in global step 2's batch (examples 16-31, in order)."""
    task = OptimizerTask(OPTIMIZERS["adam"])
    task.x = task.x.copy()
    task.x[27, 0] = value
    return task


class HugeTargetTask(OptimizerTask):
    """A loss linear in the first logit, weighted by a target of 1e25 for example 27 (in
    global step 2's batch): the gradients stay finite, their squares do not."""

    def __init__(self):
        super().__init__(OPTIMIZERS["adam"])
        self.y = np.zeros(len(self.x), np.float32)
        self.y[27] = 1e25

    def compute_loss(self, labels, outputs):
        return -labels * tf.cast(outputs[:, 0], tf.float32)

    def build_metrics(self):
        return []


@pytest.mark.parametrize("task", [lambda: nan_at_step_2(np.nan), HugeTargetTask])
def test_the_guard_skips_a_bad_step_on_every_device(tmp_path, task):
    """The summed gradients are NaN, or finite with squares that overflow: every
    device's update is skipped (its copies keep the old values) and the step is
    counted once."""
    trainer = train(task(), tmp_path / "skip", guard=tputrain.NonFiniteGuard(policy="skip"))
    assert trainer._steps.plan().apply_per_replica
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    assert int(trainer.optimizer.iterations.numpy()) == 5  # the bad step applied nothing
    assert_copies_equal(trainer)
    assert all(np.isfinite(w).all() for w in trainer.model.get_weights())


def spy_checks(monkeypatch) -> dict[str, int]:
    """Counts the traces of the scaled check and of the exact one made once for every
    device (`NonFiniteGuard.checking_once`)."""
    from tputrain.fault_tolerance import guard as guard_module

    return spy_calls(monkeypatch, guard_module,
                     {"_scaled_gradients_finite": "scaled", "_square_sum": "once"})


def test_each_device_runs_the_scaled_check_in_its_update_bit_for_bit_as_the_exact(
        tmp_path, monkeypatch):
    """On 2 replicas the loss is scaled and each device checks and unscales the summed
    gradients inside its own update program (no check made outside it for both): the
    weights end bit for bit as under the exact check."""
    calls = spy_checks(monkeypatch)
    scaled = run(OptimizerTask(OPTIMIZERS["adamw"]), tmp_path / "scaled",
                 guard=tputrain.NonFiniteGuard(policy="raise"))
    assert scaled._steps.plan().apply_per_replica
    assert calls["scaled"] >= 2 and calls["once"] == 0  # traced on each device
    exact = run(OptimizerTask(OPTIMIZERS["adamw"]), tmp_path / "exact",
                guard=tputrain.NonFiniteGuard(policy="raise", scaled_check=False))
    assert calls["once"] >= 1
    assert_copies_equal(scaled)
    for got, want in zip([*scaled.model.weights, *scaled.optimizer.variables],
                         [*exact.model.weights, *exact.optimizer.variables]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=got.path)


def test_gradients_crossing_in_float16_keep_the_exact_check(tmp_path, monkeypatch):
    """Scaled gradients would overflow float16 on the wire: the check made once."""
    calls = spy_checks(monkeypatch)
    run(OptimizerTask(OPTIMIZERS["adam"]), tmp_path / "f16",
        communication=tputrain.CommunicationOptions(allreduce_dtype="float16"))
    assert calls["scaled"] == 0 and calls["once"] >= 1


class OneBadGradientTask(OptimizerTask):
    """At step 2 (a marker in its batch) only the gradient of variable `index` is NaN:
    the one check spread over both devices must still see it, wherever it went."""

    def __init__(self, index: int):
        super().__init__(OPTIMIZERS["adam"])
        self.index = index
        self.x = self.x.copy()
        self.x[27, 7] = 1e3  # in step 2's batch; finite

    def compute_gradients(self, batch, model, optimizer, global_batch_size, micro_batches=1):
        gradients, loss, outputs = super().compute_gradients(
            batch, model, optimizer, global_batch_size, micro_batches)
        marked = tf.reduce_max(tf.abs(batch[0]["x"])) > 100.0
        g = gradients[self.index]
        gradients[self.index] = tf.where(marked, tf.fill(tf.shape(g), np.nan), g)
        return gradients, loss, outputs


@pytest.mark.parametrize("index", range(4))  # 2 kernels and 2 biases, both devices' shares
def test_a_nonfinite_gradient_of_any_one_variable_skips_the_step(tmp_path, index):
    trainer = train(OneBadGradientTask(index), tmp_path / str(index),
                    guard=tputrain.NonFiniteGuard(policy="skip"))
    assert trainer._steps.plan().apply_per_replica
    assert int(trainer.guard.nonfinite_steps.numpy()) == 1
    assert int(trainer.optimizer.iterations.numpy()) == 5
    assert all(np.isfinite(w).all() for w in trainer.model.get_weights())
    assert_copies_equal(trainer)


def test_the_guard_raises_with_the_weights_before_the_bad_step(tmp_path):
    trainer = make(nan_at_step_2(np.inf), tmp_path / "raise")
    with pytest.raises(tputrain.NonFiniteError, match="step 2"):
        trainer.train()
    one_step = train(nan_at_step_2(np.inf), tmp_path / "one", train_steps=1)
    assert_copies_equal(trainer)
    for got, want in zip(trainer.model.get_weights(), one_step.model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_custom_optimizer_class_is_compiled_per_device_only_when_asked(tmp_path):
    class MySGD(keras.optimizers.SGD):
        pass

    plan = make(OptimizerTask(lambda: MySGD(0.05)), tmp_path / "auto")._steps.plan()
    assert not plan.apply_per_replica
    assert "custom optimizer class (MySGD)" in plan.why and "jit_compile=True" in plan.why
    on = train(OptimizerTask(lambda: MySGD(0.05)), tmp_path / "on", jit_compile=True)
    assert on._steps.plan().apply_per_replica
    assert_copies_equal(on)


def test_a_loss_scale_optimizer_keeps_its_own_conditional(tmp_path):
    trainer = make(TinyTask(), tmp_path / "lso", precision="mixed_float16")
    assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    plan = trainer._steps.plan()
    assert not plan.apply_per_replica and "mixed_float16" in plan.why


class FailingAdamW(keras.optimizers.AdamW):
    """A user's optimizer whose update fails while the per-device program traces."""

    def update_step(self, gradient, variable, learning_rate):
        raise RuntimeError("the user's update failed")


def test_no_tensorflow_global_stays_changed_after_the_update_traces(tmp_path):
    """Issue 53: `strategy.extended.update` and `interim.maybe_merge_call` are swapped
    only while a device's update traces, and restored after it, an error included."""
    interim = tf.__internal__.distribute.interim
    merge_call = interim.maybe_merge_call
    trainer = train(OptimizerTask(OPTIMIZERS["adamw"]), tmp_path / "ok")  # decay merges too
    assert trainer._steps.plan().apply_per_replica
    assert interim.maybe_merge_call is merge_call
    assert "update" not in vars(trainer.strategy.extended)

    failing = make(OptimizerTask(lambda: FailingAdamW(0.01, weight_decay=0.1)),
                   tmp_path / "failing")
    with pytest.raises(Exception, match="the user's update failed"):
        failing.train()
    failing.close()
    assert interim.maybe_merge_call is merge_call
    assert "update" not in vars(failing.strategy.extended)
