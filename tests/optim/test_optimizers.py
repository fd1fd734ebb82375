"""build_optimizer: every name builds, clipping, weight-decay exclusion, fp16 loss scaling."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.optim.lars import LARS
from tiny import TinyTask


@pytest.mark.parametrize("name, cls", [("adam", keras.optimizers.Adam),
                                       ("adamw", keras.optimizers.AdamW),
                                       ("sgd", keras.optimizers.SGD),
                                       ("lamb", keras.optimizers.Lamb),
                                       ("LARS", LARS)])
def test_every_name_builds_and_steps(name, cls):
    optimizer = tputrain.build_optimizer(name, learning_rate=0.1, weight_decay=0.01)
    assert isinstance(optimizer, cls)
    variable = keras.Variable(np.ones((3, 2), np.float32))
    optimizer.apply_gradients([(tf.ones((3, 2)), variable)])
    assert np.all(variable.numpy() < 1.0)


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="adamw.*lamb.*lars"):
        tputrain.build_optimizer("adamx")


def test_a_misspelled_keras_argument_names_the_nearest():
    with pytest.raises(ValueError, match=r"'sgd'.*'nesterv'.*did you mean 'nesterov'"):
        tputrain.build_optimizer("sgd", nesterv=True)
    assert tputrain.build_optimizer("sgd", nesterov=True).nesterov  # a Keras argument passes


def test_global_clipnorm_clips_all_gradients_together():
    optimizer = tputrain.build_optimizer("sgd", learning_rate=1.0, momentum=0.0, global_clipnorm=1.0)
    a, b = keras.Variable(np.zeros(3, np.float32)), keras.Variable(np.zeros(4, np.float32))
    optimizer.apply_gradients([(tf.fill([3], 3.0), a), (tf.fill([4], 4.0), b)])
    update = np.concatenate([a.numpy(), b.numpy()])
    assert np.linalg.norm(update) == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(a.numpy() / b.numpy()[:3], 0.75, rtol=1e-5)  # direction kept


def test_weight_decay_skips_excluded_names():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, bias_initializer="ones")])
    optimizer = tputrain.build_optimizer("adamw", learning_rate=0.1, weight_decay=0.5,
                                         exclude_from_weight_decay=["bias"])
    kernel, bias = [v.numpy().copy() for v in model.trainable_variables]
    zeros = [tf.zeros_like(v) for v in model.trainable_variables]
    optimizer.apply_gradients(zip(zeros, model.trainable_variables))
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), kernel * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(model.trainable_variables[1].numpy(), bias)


def test_mixed_float16_wraps_for_loss_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    assert isinstance(tputrain.build_optimizer("sgd"), keras.optimizers.LossScaleOptimizer)
    keras.mixed_precision.set_global_policy("float32")
    assert not isinstance(tputrain.build_optimizer("sgd"), keras.optimizers.LossScaleOptimizer)


def test_fp16_loss_scaling_skips_an_overflow_step_and_recovers():
    """Task.train_step under mixed_float16: an overflowing batch changes no weight and
    halves the loss scale; the next, ordinary batch trains."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    task = TinyTask()
    model = task.build_model()
    optimizer = tputrain.build_optimizer("sgd", learning_rate=0.1)
    optimizer.build(model.trainable_variables)
    metrics = task.build_metrics()

    @tf.function
    def step(x, y):
        return task.train_step(({"x": x}, y), model, optimizer, metrics, global_batch_size=16)

    x, y = task.x[:16], task.y[:16]
    scale = float(optimizer.dynamic_scale.numpy())
    before = [w.copy() for w in model.get_weights()]
    step(x * 3e4, y)  # float16 activations/gradients overflow (max 65504)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert float(optimizer.dynamic_scale.numpy()) == scale / 2
    step(x, y)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
