"""Dropout in a compiled step on a CPU (issue 55): the masks are drawn by XLA's ThreeFry,
not by Keras's default algorithm, whose key derivation XLA's CPU fusion recomputed
for every element of the mask; the layer still drops at its rate and scales the rest."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.loop.xla_dropout import ThreeFryDropout, dropout


def _trainer(tmp_path, name, jit_compile=True, replicas=1, task=None):
    return tputrain.Trainer(task or TinyTask(dropout=0.5), str(tmp_path / name),
                            strategy=strategy_for(replicas), train_steps=2, steps_per_loop=2,
                            global_batch_size=8, checkpoint_every=2, jit_compile=jit_compile,
                            seed=0, report_mfu=False)


def _step_hlo(trainer: tputrain.Trainer) -> str:
    step = trainer._steps.build()
    batch = trainer._steps.zero_batch()
    return trainer.strategy.run(
        lambda b: step.experimental_get_compiler_ir(b)(stage="hlo"), args=(batch,))


def test_the_compiled_step_draws_dropout_masks_with_threefry(tmp_path):
    hlo = _step_hlo(_trainer(tmp_path, "xla"))
    assert "rng_three_fry" in hlo
    # Keras's default ("auto_select") derives the key in the program; XLA fused that
    # derivation into the mask's loop, once an element.
    assert "StatelessRandomGetKeyCounter" not in hlo
    assert "rng_philox" not in hlo


def test_dropout_drops_at_its_rate_and_scales_the_kept_units():
    x = tf.fill([512, 256], 3.0)
    out = tf.function(lambda s: dropout(x, 0.3, None, s), jit_compile=True)(
        tf.constant([7, 11], tf.int64)).numpy()
    dropped = np.mean(out == 0.0)
    # 131072 draws: the binomial's standard deviation is 0.0013.
    assert abs(dropped - 0.3) < 0.01
    np.testing.assert_allclose(out[out != 0.0], 3.0 / 0.7, rtol=1e-6)


def test_dropout_draws_a_mask_a_noise_shape_slice():
    x = tf.ones([64, 8, 16])
    out = tf.function(lambda s: dropout(x, 0.5, [None, 1, 16], s), jit_compile=True)(
        tf.constant([1, 2], tf.int64)).numpy()
    assert (out == out[:, :1, :]).all()  # one mask for every step of axis 1
    assert 0.4 < np.mean(out == 0.0) < 0.6


def test_the_swap_covers_dropout_layers_only_while_active():
    inputs = keras.Input((8,))
    x = keras.layers.Dropout(0.5, seed=1)(inputs)
    x = keras.layers.SpatialDropout1D(0.5, seed=2)(keras.layers.Reshape((2, 4))(x))
    x = keras.layers.GaussianNoise(0.1, seed=3)(x)
    model = keras.Model(inputs, x)
    swap = ThreeFryDropout(model)
    assert sorted(type(layer).__name__ for layer, _ in swap.swaps) == [
        "Dropout", "SpatialDropout1D"]
    with swap.active():
        assert all("call" in vars(layer) for layer, _ in swap.swaps)
    assert not any("call" in vars(layer) for layer, _ in swap.swaps)


def test_compiled_steps_draw_new_masks_each_step_and_repeat_on_a_rerun(tmp_path):
    """The masks follow the layer's SeedGenerator: each step another, a rerun the same."""
    first = _trainer(tmp_path, "first")
    first.train()
    second = _trainer(tmp_path, "second")
    second.train()
    for a, b in zip(first.model.get_weights(), second.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    generator = [layer for layer in first.model._flatten_layers()
                 if isinstance(layer, keras.layers.Dropout)][0].seed_generator
    assert int(generator.state.numpy()[1]) > 0  # advanced by the steps


def test_an_uncompiled_step_keeps_keras_draws(tmp_path):
    plain = _trainer(tmp_path, "plain", jit_compile=False)
    assert plain._steps._threefry_dropout(plain._steps.plan()) is None
