"""LARS: the update matches a hand computation; biases and norms are not adapted."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tputrain.optim.lars import LARS
from tiny import TinyTask, strategy_for, weights


def hand_lars(w, g, v, lr, momentum, wd, eta, adapted):
    """You et al. 2017, Algorithm 1, in NumPy."""
    if adapted:
        w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
        trust = eta * w_norm / (g_norm + wd * w_norm + 1e-9)
        g = g + wd * w
    else:
        trust = 1.0
    v = momentum * v + lr * trust * g
    return w - v, v


def test_update_matches_hand_computation():
    kernel = keras.Variable(np.array([[1.0, -2.0], [3.0, 0.5]], np.float32), name="kernel")
    bias = keras.Variable(np.array([0.5, -0.25], np.float32), name="bias")
    optimizer = LARS(learning_rate=0.5, momentum=0.9, weight_decay=0.01, eta=0.02)
    optimizer.build([kernel, bias])
    grads = [np.array([[0.1, 0.2], [-0.3, 0.4]], np.float32), np.array([1.0, -2.0], np.float32)]
    expected = {"kernel": (kernel.numpy(), np.zeros((2, 2))), "bias": (bias.numpy(), np.zeros(2))}
    for step in range(3):
        scale = 1.0 + step  # different gradients each step exercise the momentum
        optimizer.apply_gradients([(tf.constant(g * scale), v) for g, v in zip(grads, [kernel, bias])])
        for (name, (w, v)), g, adapted in zip(list(expected.items()), grads, (True, False)):
            expected[name] = hand_lars(w, g * scale, v, 0.5, 0.9, 0.01, 0.02, adapted)
        np.testing.assert_allclose(kernel.numpy(), expected["kernel"][0], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(bias.numpy(), expected["bias"][0], rtol=1e-5, atol=1e-7)


def test_biases_and_norms_are_excluded():
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Dense(5, name="dense"),
                              keras.layers.LayerNormalization(name="ln"),
                              keras.layers.BatchNormalization(name="bn"),
                              keras.layers.Embedding(7, 3, name="embedding")], name="m")
    optimizer = LARS()
    adapted = {v.path: optimizer.is_adapted(v) for v in model.trainable_variables}
    assert adapted == {"m/dense/kernel": True, "m/dense/bias": False,
                       "m/ln/gamma": False, "m/ln/beta": False,
                       "m/bn/gamma": False, "m/bn/beta": False,
                       "m/embedding/embeddings": True}
    by_name = LARS(exclude_from_adaptation=["embeddings"])
    assert not by_name.is_adapted(model.get_layer("embedding").embeddings)


def test_zero_weights_take_a_plain_momentum_step():
    kernel = keras.Variable(np.zeros((2, 2), np.float32), name="kernel")
    optimizer = LARS(learning_rate=0.1, momentum=0.0, eta=0.001)
    optimizer.apply_gradients([(tf.ones((2, 2)), kernel)])
    np.testing.assert_allclose(kernel.numpy(), -0.1 * np.ones((2, 2)), rtol=1e-6)


def test_config_round_trip():
    optimizer = LARS(learning_rate=0.3, momentum=0.8, weight_decay=1e-4, eta=0.01, nesterov=True)
    clone = LARS.from_config(optimizer.get_config())
    assert (clone.momentum, clone.lars_weight_decay, clone.eta, clone.nesterov) == (0.8, 1e-4, 0.01, True)


class LarsTask(TinyTask):
    def build_optimizer(self):
        return LARS(learning_rate=1.0, momentum=0.9, weight_decay=1e-3, eta=0.01)


@pytest.mark.parametrize("replicas", [2])
def test_two_replicas_match_one_device(tmp_path, replicas):
    """The trust ratio sees whole (all-reduced) gradients under MirroredStrategy."""
    import tputrain

    runs = []
    for n in (1, replicas):
        trainer = tputrain.Trainer(LarsTask(), str(tmp_path / f"r{n}"), strategy=strategy_for(n),
                                   train_steps=4, steps_per_loop=4, global_batch_size=16,
                                   checkpoint_every=4)
        trainer.train()
        runs.append(weights(trainer))
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
