"""jit_compile="auto" on a CPU and random layers (issue 38): XLA stays off for a model
whose slow random draws are many beside its FLOPs (an MLP drawing noise with `tf.random`
on its hidden layer; Keras's draws, Dropout's and GaussianNoise's, are drawn fast in XLA
since issue 55), and compiles the whole step of one whose draws are few (a conv net
with a Dropout head)."""

from __future__ import annotations

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import child_env
from tiny import TinyTask, strategy_for
from tputrain.loop import convolutions
from tputrain.loop.random_draws import COSTLY_DRAWS_PER_FLOP, draws_per_flop


class ConvDropoutTask(TinyTask):
    """Two 3x3 convolutions on 16x16x3 images, pooled, a Dense(8) and Dropout head."""

    def __init__(self):
        super().__init__()
        rng = np.random.RandomState(0)
        self.images = rng.rand(64, 16, 16, 3).astype(np.float32)
        self.labels = rng.randint(0, 2, 64).astype(np.int64)

    def build_model(self) -> keras.Model:
        inputs = keras.Input((16, 16, 3), name="image")
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = keras.layers.Dense(8, activation="relu")(keras.layers.GlobalAveragePooling2D()(x))
        x = keras.layers.Dropout(0.5, seed=1)(x)
        return keras.Model({"image": inputs}, keras.layers.Dense(2, dtype="float32")(x))

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"image": self.images}, self.labels))
        dataset = dataset.repeat() if split == "train" else dataset
        return dataset.batch(batch, drop_remainder=True)


def trainer(tmp_path, task, name, jit_compile="auto"):
    return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(1),
                            train_steps=4, steps_per_loop=2, global_batch_size=8,
                            checkpoint_every=4, jit_compile=jit_compile, seed=0,
                            report_mfu=False)


def test_draws_per_flop_counts_the_dropout_draws_against_the_matmuls():
    model = TinyTask(dropout=0.5).build_model()  # Dense 8->16, Dropout, Dense 16->2
    batch = 4
    flops = 2 * batch * (8 * 16 + 16 * 2)  # two matmuls, 2 FLOPs a multiply-add
    draws = batch * 16  # one uniform number per dropped-or-kept unit
    ratio = draws_per_flop(model, {"x": tf.TensorSpec([batch, 8], tf.float32)})
    assert ratio == draws / flops


def test_conv_net_draws_are_few_per_flop():
    model = ConvDropoutTask().build_model()
    flops = 2 * (16 * 16 * 32 * 3 * 3 * 3 + 16 * 16 * 32 * 3 * 3 * 32 + 32 * 8 + 8 * 2)
    ratio = draws_per_flop(model, {"image": tf.TensorSpec([1, 16, 16, 3], tf.float32)})
    assert ratio == 8 / flops
    assert ratio < COSTLY_DRAWS_PER_FLOP


def _onednn(monkeypatch, on: bool) -> None:
    """Pins whether TensorFlow runs oneDNN, whatever this machine's CPU."""
    monkeypatch.setattr(convolutions, "onednn_enabled", lambda: on)


def test_auto_compiles_the_whole_step_of_a_conv_net_with_dropout(tmp_path, monkeypatch):
    # On a CPU whose TensorFlow kernels do not run through oneDNN (with oneDNN:
    # test_auto_leaves_float32_convolutions_to_onednn_on_one_cpu).
    _onednn(monkeypatch, False)
    auto = trainer(tmp_path, ConvDropoutTask(), "auto")
    assert auto._steps.xla_plan() == (True, False, "auto: the whole step, if it compiles")
    auto.train()
    compiled = trainer(tmp_path, ConvDropoutTask(), "compiled", jit_compile=True)
    compiled.train()
    plain = trainer(tmp_path, ConvDropoutTask(), "plain", jit_compile=False)
    plain.train()
    # XLA draws other dropout masks than TensorFlow's kernels (its own generator): the
    # auto run is the compiled one bit for bit, and not the uncompiled one.
    for a, b in zip(auto.model.get_weights(), compiled.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert any(not np.allclose(a, b, rtol=1e-3)
               for a, b in zip(auto.model.get_weights(), plain.model.get_weights()))


class NoisyTask(TinyTask):
    """TinyTask with GaussianNoise on its hidden layer: Keras's draws in XLA."""

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.GaussianNoise(0.1, seed=1)(h)
        return keras.Model({"x": inputs}, keras.layers.Dense(2, dtype="float32")(h))


class RawNoise(keras.layers.Layer):
    """Gaussian noise drawn with `tf.random` itself, not through Keras's backend."""

    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, inputs, training=False):
        if not training:
            return inputs
        seed = tf.cast(self.seed_generator.next(), tf.int32)
        return inputs + tf.random.stateless_normal(tf.shape(inputs), seed=seed)


class RawNoiseTask(TinyTask):
    """TinyTask with `RawNoise` on its hidden layer: TensorFlow's draws in XLA."""

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        h = RawNoise()(keras.layers.Dense(16, activation="relu")(inputs))
        return keras.Model({"x": inputs}, keras.layers.Dense(2, dtype="float32")(h))


def test_auto_compiles_the_whole_step_of_an_mlp_with_dropout(tmp_path):
    """Issue 55: a compiled step draws Dropout's masks with ThreeFry (xla_dropout.py),
    faster than TensorFlow's kernels, so Dropout no longer keeps XLA off."""
    mlp = trainer(tmp_path, TinyTask(dropout=0.5), "mlp")
    assert mlp._steps.xla_plan() == (True, False, "auto: the whole step, if it compiles")


def test_auto_compiles_the_whole_step_of_an_mlp_with_gaussian_noise(tmp_path):
    """Issue 55: GaussianNoise's draws go through Keras's backend, which a compiled step
    swaps for ThreeFry (xla_dropout.py) as it does Dropout's."""
    noisy = trainer(tmp_path, NoisyTask(), "noisy")
    assert noisy._steps.xla_plan() == (True, False, "auto: the whole step, if it compiles")


def test_auto_keeps_xla_off_for_draws_made_with_tf_random(tmp_path):
    """A layer drawing with `tf.random` itself keeps XLA's slow algorithm: XLA stays off."""
    raw = trainer(tmp_path, RawNoiseTask(), "raw")
    assert raw._steps.xla_plan() == (
        False, False, "auto: off on CPU for random ops drawn outside keras.random "
                      "(e.g. tf.random)")


def test_a_compiled_step_counts_no_dropout_draws():
    model = TinyTask(dropout=0.5).build_model()
    spec = {"x": tf.TensorSpec([4, 8], tf.float32)}
    assert draws_per_flop(model, spec) > COSTLY_DRAWS_PER_FLOP  # what Keras would draw
    assert draws_per_flop(model, spec, compiled=True) == 0


def test_mixed_bfloat16_with_dropout_compiles_the_update_outside_the_draws(tmp_path):
    """The bf16 plan's XLA programs (the update, GELUs, layer norms) draw nothing, so a
    random layer no longer turns them off."""
    task = TinyTask(dropout=0.5)
    bf16 = tputrain.Trainer(task, str(tmp_path / "bf16"), strategy=strategy_for(1),
                            train_steps=2, steps_per_loop=2, global_batch_size=8,
                            precision="mixed_bfloat16", report_mfu=False)
    plan = bf16._steps.plan()
    assert (plan.whole_step, plan.apply_only, plan.fuse_elementwise) == (False, True, True)
    assert np.isfinite(bf16.train()["loss"])


def test_auto_runs_one_step_a_launch_for_convolutions_on_cpu(tmp_path):
    """XLA's CPU convolutions ran several times slower in a multi-step program."""
    conv = trainer(tmp_path, ConvDropoutTask(), "conv")
    conv.train()
    assert conv.plan.steps_per_program == 1
    mlp = trainer(tmp_path, TinyTask(), "mlp")
    mlp.train()
    assert mlp.plan.steps_per_program == 2


def test_auto_leaves_float32_convolutions_to_onednn_on_one_cpu(tmp_path, monkeypatch):
    """Where TensorFlow runs its CPU kernels through oneDNN (x86 CPUs with AVX-512 VNNI
    and newer), its float32 convolutions beat XLA's: "auto" leaves XLA off (the update
    compiled alone was slower too). Without oneDNN the whole step compiles, as before."""
    _onednn(monkeypatch, True)
    conv = trainer(tmp_path, ConvDropoutTask(), "onednn")
    plan = conv._steps.plan()
    assert (plan.whole_step, plan.gradients_only, plan.apply_only) == (False, False, False)
    assert "oneDNN" in plan.why
    assert np.isfinite(conv.train()["loss"])
    assert trainer(tmp_path, TinyTask(), "mlp")._steps.plan().whole_step  # no convolutions
    _onednn(monkeypatch, False)
    assert trainer(tmp_path, ConvDropoutTask(), "xla")._steps.plan().whole_step


def test_onednn_enabled_follows_tf_enable_onednn_opts():
    script = ("import tputrain.loop.convolutions as c; "
              "print('ONEDNN', c.onednn_enabled())")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=dict(child_env(), TF_ENABLE_ONEDNN_OPTS="0"), timeout=300)
    assert "ONEDNN False" in result.stdout, result.stderr[-2000:]


def test_auto_compiles_forward_and_backward_of_a_conv_net_on_two_replicas(tmp_path, monkeypatch):
    """A float32 conv net on 2 CPU replicas: XLA for forward and backward too (the update
    on each device as before); an MLP keeps the update alone. On a CPU whose TensorFlow
    does not run oneDNN (with it: the next test)."""
    _onednn(monkeypatch, False)

    def two(task, name):
        return tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(2),
                                train_steps=2, steps_per_loop=2, global_batch_size=8,
                                report_mfu=False)
    conv = two(ConvDropoutTask(), "conv")
    plan = conv._steps.plan()
    assert (plan.whole_step, plan.gradients_only, plan.apply_per_replica) == (False, True, True)
    assert np.isfinite(conv.train()["loss"])
    plan = two(TinyTask(), "mlp")._steps.plan()
    assert (plan.gradients_only, plan.apply_per_replica) == (False, True)


def test_auto_leaves_float32_convolutions_to_onednn_on_two_replicas(tmp_path, monkeypatch):
    """With oneDNN, the step stays uncompiled on 2 replicas too: the update compiled on
    each device (an MLP's plan) also ran slower than TensorFlow's kernels there."""
    _onednn(monkeypatch, True)
    conv = tputrain.Trainer(ConvDropoutTask(), str(tmp_path / "conv"), strategy=strategy_for(2),
                            train_steps=2, steps_per_loop=2, global_batch_size=8,
                            report_mfu=False)
    plan = conv._steps.plan()
    assert (plan.whole_step, plan.gradients_only, plan.apply_per_replica) == (False, False, False)
    assert "oneDNN" in plan.why
    assert np.isfinite(conv.train()["loss"])


def _bf16_conv(tmp_path, replicas: int, name: str) -> tputrain.Trainer:
    return tputrain.Trainer(ConvDropoutTask(), str(tmp_path / name),
                            strategy=strategy_for(replicas), train_steps=2,
                            steps_per_loop=2, global_batch_size=8,
                            precision="mixed_bfloat16", report_mfu=False)


def test_auto_compiles_a_conv_net_in_mixed_bfloat16_on_cpu(tmp_path, monkeypatch):
    """TensorFlow's bf16 convolutions on a CPU without oneDNN are slow: the whole step
    compiles (one replica), forward and backward too (two)."""
    _onednn(monkeypatch, False)
    one = _bf16_conv(tmp_path, 1, "one")
    assert one._steps.plan().whole_step
    assert np.isfinite(one.train()["loss"])
    plan = _bf16_conv(tmp_path, 2, "two")._steps.plan()
    assert (plan.gradients_only, plan.apply_per_replica) == (True, True)


def test_auto_leaves_bfloat16_convolutions_to_onednn(tmp_path, monkeypatch):
    """With oneDNN (AVX-512 bf16 kernels) TensorFlow's bf16 convolutions are fast: one
    replica compiles only the GELUs and layer norms (the update compiled alone ran
    slower than TensorFlow's kernels there), two nothing."""
    _onednn(monkeypatch, True)
    one = _bf16_conv(tmp_path, 1, "one")
    plan = one._steps.plan()
    assert (plan.whole_step, plan.apply_only, plan.fuse_elementwise) == (False, False, True)
    assert np.isfinite(one.train()["loss"])
    plan = _bf16_conv(tmp_path, 2, "two")._steps.plan()
    assert (plan.gradients_only, plan.apply_per_replica) == (False, False)


class AugmentedTask(ConvDropoutTask):
    """Random augmentation layers on 16x16x3 images before a Dense(8) and Dense(2)."""

    def __init__(self, *layers: str):
        super().__init__()
        self.layers = layers

    def build_model(self) -> keras.Model:
        inputs = keras.Input((16, 16, 3), name="image")
        x = inputs
        for name in self.layers:
            x = {"RandomFlip": lambda: keras.layers.RandomFlip(seed=1),
                 "RandomContrast": lambda: keras.layers.RandomContrast(0.2, seed=2),
                 "RandomRotation": lambda: keras.layers.RandomRotation(0.1, seed=3),
                 "MixUp": lambda: keras.layers.MixUp(seed=4)}[name]()(x)
        x = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(x))
        return keras.Model({"image": inputs}, keras.layers.Dense(2, dtype="float32")(x))


def test_auto_compiles_the_whole_step_with_augmentation_xla_compiles(tmp_path):
    """RandomFlip and RandomContrast draw their factors through Keras's backend (ThreeFry
    in XLA) and run ops XLA compiles: the whole step compiles."""
    augmented = trainer(tmp_path, AugmentedTask("RandomFlip", "RandomContrast"), "flip")
    assert augmented._steps.xla_plan() == (True, False, "auto: the whole step, if it compiles")
    step, batch = augmented._steps.build(), augmented._steps.zero_batch()
    hlo = augmented.strategy.run(
        lambda b: step.experimental_get_compiler_ir(b)(stage="hlo"), args=(batch,))
    assert "rng_three_fry" in hlo and "StatelessRandomGetKeyCounter" not in hlo


def test_auto_keeps_xla_off_for_augmentation_xla_cannot_compile(tmp_path):
    """RandomRotation's image transform and MixUp's gamma draws have no XLA kernel: the
    plan says so in one line (not a failed lowering of the whole step)."""
    rotation = trainer(tmp_path, AugmentedTask("RandomFlip", "RandomRotation"), "rotation")
    assert rotation._steps.xla_plan() == (
        False, False, "auto: off on CPU: XLA has no kernel for ImageProjectiveTransformV3 "
                      "(RandomRotation)")
    mixup = trainer(tmp_path, AugmentedTask("MixUp"), "mixup")
    assert mixup._steps.plan().why.startswith("auto: off on CPU: XLA has no kernel for "
                                              "StatelessRandomGamma")
    assert mixup._steps.plan().why.endswith("(MixUp)")


class DropoutTrainingOnlyBug(keras.Model):
    """A subclassed model with Dropout whose training branch reads a key its input
    lacks (the user's bug): it builds, but its training forward pass does not trace."""

    def __init__(self):
        super().__init__()
        self.drop = keras.layers.Dropout(0.5)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs, training=False):
        return self.dense(self.drop(inputs["features"] if training else inputs["x"],
                                    training=training))


def test_a_forward_pass_that_does_not_trace_is_not_called_draws_outside_keras_random(
        tmp_path, caplog):
    """A Dropout model with the user's bug in its training branch: the plan's reason names
    what happened (the forward pass did not trace, and why), not random ops drawn outside
    keras.random, and the step then raises the user's error itself."""
    def build():
        model = DropoutTrainingOnlyBug()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model

    rng = np.random.default_rng(0)
    train = ({"x": rng.normal(size=(64, 8)).astype(np.float32)}, rng.integers(0, 2, size=64))
    with caplog.at_level("INFO"), pytest.raises(KeyError, match="features"):
        tputrain.fit(build, train, model_dir=str(tmp_path / "fit"), steps=4, batch_size=16,
                     strategy=strategy_for(1), report_mfu=False)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "drawn outside keras.random" not in said
    reason = [line for line in said.splitlines() if "does not trace alone" in line]
    assert len(reason) == 1 and "(KeyError: 'features')" in reason[0], said
