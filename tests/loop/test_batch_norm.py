"""tputrain/loop/batch_norm.py: Keras's BatchNormalization as TensorFlow's fused kernel
while a step traces without XLA: the same values, gradients and moving statistics,
and Keras's own call wherever the fused kernel does not cover the layer."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import strategy_for
from tputrain.loop import batch_norm as batch_norm_module
from tputrain.loop import convolutions
from tputrain.loop.batch_norm import fused_call
from tputrain.loop.step import ElementwiseFusion


def _layer(shape, **kwargs) -> keras.layers.BatchNormalization:
    layer = keras.layers.BatchNormalization(**kwargs)
    layer.build(shape)
    channels = shape[-1] if kwargs.get("axis", -1) == -1 else shape[kwargs["axis"]]
    if layer.scale:
        layer.gamma.assign(tf.random.stateless_normal([channels], [1, 2]) + 1.0)
    if layer.center:
        layer.beta.assign(tf.random.stateless_normal([channels], [3, 4]))
    layer.moving_mean.assign(tf.random.stateless_normal([channels], [5, 6]))
    layer.moving_variance.assign(tf.random.stateless_uniform([channels], [7, 8], 0.5, 2.0))
    return layer


def _run(layer, x, call=None, training=True):
    """Output, gradients (input and trainable weights) and moving statistics after
    one call; the layer's weights are put back afterwards."""
    saved = [v.numpy() for v in layer.variables]
    upstream = tf.reshape(tf.linspace(-2.0, 3.0, int(tf.size(x))), x.shape)
    with tf.GradientTape() as tape:
        tape.watch(x)
        if call is None:
            y = layer(x, training=training)
        else:
            vars(layer)["call"] = call
            try:
                y = layer(x, training=training)
            finally:
                del vars(layer)["call"]
        y = tf.cast(y, tf.float32)
    grads = tape.gradient(y, [x, *layer.trainable_variables],
                          output_gradients=upstream)
    found = [y, *grads, layer.moving_mean, layer.moving_variance]
    found = [tf.cast(t, tf.float64).numpy() for t in found]
    for variable, value in zip(layer.variables, saved):
        variable.assign(value)
    return found


@pytest.mark.parametrize("shape, kwargs", [
    ((6, 5, 4, 8), {}), ((6, 5, 4, 8), {"center": False}),
    ((6, 5, 4, 8), {"scale": False, "momentum": 0.9}),
    ((6, 8), {}),             # a Dense's outputs: reshaped for the kernel
    ((6, 7, 8), {}),          # a Conv1D's
    ((2, 3, 4, 5, 8), {}),    # a Conv3D's
])
def test_fused_call_is_keras_batch_norm_its_gradients_and_moving_statistics(shape, kwargs):
    keras.mixed_precision.set_global_policy("float32")
    layer = _layer(shape, **kwargs)
    x = tf.random.stateless_normal(shape, [9, 10]) * 3.0 + 1.0
    expected = _run(layer, x)
    ours = _run(layer, x, fused_call(layer))
    assert len(ours) == len(expected)
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fused_call_in_bf16_computes_in_float32_as_keras_does():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        shape = (4, 6, 6, 16)
        layer = _layer(shape)
        x = tf.cast(tf.random.stateless_normal(shape, [1, 1]) * 2.0, tf.bfloat16)
        vars(layer)["call"] = fused_call(layer)
        try:
            assert layer(x, training=True).dtype == tf.bfloat16
        finally:
            del vars(layer)["call"]
        expected = _run(layer, x)
        ours = _run(layer, x, fused_call(layer))
        for got, want in zip(ours, expected):  # a bf16 rounding of each other at most
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_batch_of_one_example_gives_keras_zero_variance():
    keras.mixed_precision.set_global_policy("float32")
    layer = _layer((1, 1, 1, 4))
    x = tf.random.stateless_normal((1, 1, 1, 4), [2, 3])
    for got, want in zip(_run(layer, x, fused_call(layer)), _run(layer, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, kwargs", [
    ((6, 8, 4, 4), {"axis": 1}),       # channels first
    ((6, 8), {"axis": 0}),
    ((6, 4, 4, 8), {"renorm": True}),
    ((6, 4, 4, 8), {"synchronized": True}),
])
def test_layers_the_fused_kernel_does_not_cover_keep_keras_call(shape, kwargs):
    keras.mixed_precision.set_global_policy("float32")
    layer = _layer(shape, **kwargs)
    assert fused_call(layer) is None or _falls_back(layer, shape)


def _falls_back(layer, shape) -> bool:
    x = tf.random.stateless_normal(shape, [4, 4])
    for got, want in zip(_run(layer, x, fused_call(layer)), _run(layer, x)):
        np.testing.assert_array_equal(got, want)
    return True


def test_inference_frozen_and_masked_calls_are_keras_own():
    keras.mixed_precision.set_global_policy("float32")
    shape = (6, 4, 4, 8)
    layer = _layer(shape)
    x = tf.random.stateless_normal(shape, [4, 5])
    for got, want in zip(_run(layer, x, fused_call(layer), training=False),
                         _run(layer, x, training=False)):
        np.testing.assert_array_equal(got, want)
    layer.trainable = False
    for got, want in zip(_run(layer, x, fused_call(layer)), _run(layer, x)):
        np.testing.assert_array_equal(got, want)


def test_a_subclass_keeps_its_own_call():
    class Custom(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=training, mask=mask) * 2.0

    layer = Custom()
    layer.build((2, 2, 2, 3))
    assert fused_call(layer) is None


def test_fusion_swaps_batch_norm_only_when_asked():
    inputs = keras.Input((4, 4, 3))
    x = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="gelu")(x))
    assert [name for _, name, _ in ElementwiseFusion(model).swaps] == ["activation"]
    both = ElementwiseFusion(model, batch_norm=True)
    assert sorted(name for _, name, _ in both.swaps) == ["activation", "call"]
    only = ElementwiseFusion(model, elementwise=False, batch_norm=True)
    assert [(type(layer), name) for layer, name, _ in only.swaps] == [
        (keras.layers.BatchNormalization, "call")]


class BatchNormConvTask(tputrain.Task):
    """Two 3x3 convolutions with BatchNorm on 8x8x3 images, a Dense(4) head."""

    def build_model(self):
        inputs = keras.Input((8, 8, 3), name="image")
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(x))
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model({"image": inputs}, keras.layers.Dense(4, dtype="float32")(x))

    def build_inputs(self, split, input_context):
        images = tf.random.stateless_normal([64, 8, 8, 3], [1, 2])
        labels = tf.random.stateless_uniform([64], [3, 4], 0, 4, tf.int32)
        dataset = tf.data.Dataset.from_tensor_slices(({"image": images}, labels))
        batch = input_context.get_per_replica_batch_size(16)
        return dataset.repeat().batch(batch, drop_remainder=True)

    def build_optimizer(self):
        return tputrain.build_optimizer("sgd", learning_rate=0.05)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)


def _trainer(tmp_path, name, replicas, jit_compile):
    return tputrain.Trainer(BatchNormConvTask(), str(tmp_path / name),
                            strategy=strategy_for(replicas), train_steps=4, steps_per_loop=2,
                            global_batch_size=16, checkpoint_every=10**9, eval_steps=1,
                            precision="float32", seed=0, jit_compile=jit_compile)


@pytest.mark.parametrize("replicas", [1, 2])
def test_auto_runs_a_conv_nets_batch_norms_fused_on_onednn_and_trains_as_keras(
        tmp_path, monkeypatch, replicas):
    """On a oneDNN CPU "auto" compiles nothing of a conv net's step; its batch norms
    run as the fused kernel, and the weights and moving statistics end as with
    Keras's own batch norm (jit_compile=False, which swaps nothing)."""
    monkeypatch.setattr(convolutions, "onednn_enabled", lambda: True)
    calls = []
    original = batch_norm_module.fused_batch_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(batch_norm_module, "fused_batch_norm", counted)
    auto = _trainer(tmp_path, "auto", replicas, "auto")
    assert auto._steps.plan().fuse_batch_norm
    auto.train()
    assert calls  # traced into the step
    traced = len(calls)
    plain = _trainer(tmp_path, "plain", replicas, False)
    assert not plain._steps.plan().fuse_batch_norm
    plain.train()
    assert len(calls) == traced
    for mine, theirs in zip(auto.model.variables, plain.model.variables):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=mine.path)
    for layer in auto.model._flatten_layers(include_self=False, recursive=True):
        assert "call" not in vars(layer)  # swapped back after tracing


def _gradients_and_statistics(model, fusion, images, labels):
    @tf.function
    def run():
        with fusion.active() if fusion else contextlib.nullcontext():
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    labels, logits, from_logits=True))
        return tape.gradient(loss, model.trainable_variables)
    saved = [v.numpy() for v in model.variables]
    kernels = {op.type for op in run.get_concrete_function().graph.get_operations()}
    assert ("FusedBatchNormV3" in kernels) == (fusion is not None)
    grads = [g.numpy() for g in run()]
    statistics = [v.numpy() for v in model.non_trainable_variables]
    for variable, value in zip(model.variables, saved):
        variable.assign(value)
    return grads, statistics


def test_a_keras_applications_model_trains_fused_as_with_keras_batch_norm():
    """MobileNetV3Small (weights=None): every batch norm is swapped, and one training
    call's gradients and moving statistics are Keras's to float32 rounding."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=4, include_preprocessing=False,
        classifier_activation=None, dropout_rate=0.0)
    fusion = ElementwiseFusion(model, elementwise=False, batch_norm=True)
    norms = [layer for layer in model._flatten_layers(include_self=False, recursive=True)
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(fusion.swaps) == len(norms) > 10
    images = tf.random.stateless_uniform([8, 32, 32, 3], [1, 2], -1.0, 1.0)
    labels = tf.random.stateless_uniform([8], [3, 4], 0, 4, tf.int32)
    expected = _gradients_and_statistics(model, None, images, labels)
    fused = _gradients_and_statistics(model, fusion, images, labels)
    for mine, theirs in zip(fused, expected):
        assert len(mine) == len(theirs)
        distance = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(mine, theirs)))
        size = np.sqrt(sum(np.sum(b ** 2) for b in theirs))
        assert distance <= 1e-4 * size
