"""Random layers in a compiled step on a CPU (issue 55): Keras's draws (Dropout's masks,
GaussianNoise's, GaussianDropout's and AlphaDropout's numbers) are made by XLA's
ThreeFry, not by Keras's default algorithm, whose key derivation XLA's CPU fusion
recomputed for every element drawn; each layer still draws what it promises (rate,
mean, standard deviation), and only in the compiled step's tracing thread."""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.loop.xla_dropout import ThreeFryDraws, dropout


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


def test_the_swap_covers_every_random_layer_only_while_active():
    from keras.src.backend.tensorflow import random as backend_random
    inputs = keras.Input((8,))
    x = keras.layers.Dropout(0.5, seed=1)(inputs)
    x = keras.layers.SpatialDropout1D(0.5, seed=2)(keras.layers.Reshape((2, 4))(x))
    x = keras.layers.GaussianNoise(0.1, seed=3)(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    swap = ThreeFryDraws(model)
    assert sorted(type(layer).__name__ for layer in swap.layers) == [
        "Dropout", "GaussianNoise", "SpatialDropout1D"]
    keras_draws = backend_random.normal, backend_random.dropout
    with swap.active():
        assert (backend_random.normal, backend_random.dropout) != keras_draws
    assert (backend_random.normal, backend_random.dropout) == keras_draws


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
    assert plain._steps._threefry_draws(plain._steps.plan()) is None


# The other random layers Keras ships (issue 55): their normal and uniform draws go
# through Keras's TensorFlow backend as dropout's masks do, and draw with ThreeFry too.

class RandomLayerTask(TinyTask):
    """TinyTask with random layers on its hidden layer."""

    def __init__(self, *layers: str):
        super().__init__()
        self.layers = layers

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="relu")(inputs)
        for layer in self.layers:
            h = random_layer(layer)(h)
        return keras.Model({"x": inputs}, keras.layers.Dense(2, dtype="float32")(h))


def random_layer(name: str) -> keras.layers.Layer:
    return {"GaussianNoise": lambda: keras.layers.GaussianNoise(0.5, seed=1),
            "GaussianDropout": lambda: keras.layers.GaussianDropout(0.3, seed=1),
            "AlphaDropout": lambda: keras.layers.AlphaDropout(0.3, seed=1)}[name]()


RANDOM_LAYERS = ["GaussianNoise", "GaussianDropout", "AlphaDropout"]


@pytest.mark.parametrize("layer", RANDOM_LAYERS)
def test_the_compiled_step_draws_other_random_layers_with_threefry(tmp_path, layer):
    hlo = _step_hlo(_trainer(tmp_path, layer, task=RandomLayerTask(layer)))
    assert "rng_three_fry" in hlo
    assert "StatelessRandomGetKeyCounter" not in hlo
    assert "rng_philox" not in hlo


def _compiled_draw(layer: keras.layers.Layer, x: tf.Tensor, model: keras.Model) -> np.ndarray:
    """`layer`'s training-mode output for `x` in an XLA program traced with the swap."""
    draw = tf.function(lambda v: layer(v, training=True), jit_compile=True)
    with ThreeFryDraws(model).active():
        assert "rng_three_fry" in draw.experimental_get_compiler_ir(x)(stage="hlo")
        return draw(x).numpy()


def _alone(layer: keras.layers.Layer) -> keras.Model:
    inputs = keras.Input((256,))
    return keras.Model(inputs, layer(inputs))


def test_gaussian_noise_draws_its_stddev():
    layer = keras.layers.GaussianNoise(0.5, seed=3)
    noise = _compiled_draw(layer, tf.zeros([512, 256]), _alone(layer))
    # 131072 draws: the mean's standard error is 0.0014, the std's 0.001.
    assert abs(noise.mean()) < 0.007
    assert abs(noise.std() - 0.5) < 0.005


def test_gaussian_dropout_draws_mean_one_noise_of_its_rate():
    layer = keras.layers.GaussianDropout(0.3, seed=3)
    out = _compiled_draw(layer, tf.ones([512, 256]), _alone(layer))
    stddev = np.sqrt(0.3 / 0.7)
    assert abs(out.mean() - 1.0) < 5 * stddev / np.sqrt(out.size)
    assert abs(out.std() - stddev) < 0.01 * stddev


def test_alpha_dropout_drops_at_its_rate_and_keeps_mean_and_variance():
    layer = keras.layers.AlphaDropout(0.3, seed=3)
    x = tf.random.stateless_normal([512, 256], seed=[4, 5])
    out = _compiled_draw(layer, x, _alone(layer))
    alpha_p = -1.6732632423543772 * 1.0507009873554805  # SELU's negative saturation
    a = ((1 - 0.3) * (1 + 0.3 * alpha_p**2)) ** -0.5
    dropped = np.isclose(out, a * alpha_p - a * alpha_p * 0.3)  # a dropped unit's value
    assert abs(dropped.mean() - 0.3) < 0.01  # the binomial's std is 0.0013
    assert abs(out.mean()) < 0.02 and abs(out.std() - 1.0) < 0.02  # self-normalizing


def test_draws_are_keras_own_outside_the_compiled_step_and_in_other_threads():
    """The swap covers only the tracing thread while active: Keras's backend is back as
    it was after, and an uncompiled draw (here, or in another thread meanwhile) is
    Keras's, bit for bit."""
    from keras.src.backend.tensorflow import random as backend_random
    originals = {name: getattr(backend_random, name) for name in
                 ("normal", "uniform", "truncated_normal", "randint", "dropout")}
    seed = keras.random.SeedGenerator(7)
    state = seed.state.numpy()
    want = keras.random.normal([64], seed=seed).numpy()
    seed.state.assign(state)
    layer = keras.layers.GaussianNoise(1.0, seed=1)
    with ThreeFryDraws(_alone(layer)).active():
        other: list[np.ndarray] = []
        thread = threading.Thread(target=lambda: other.append(
            keras.random.normal([64], seed=seed).numpy()))
        thread.start()
        thread.join()
    assert {name: getattr(backend_random, name) for name in originals} == originals
    np.testing.assert_array_equal(other[0], want)
    seed.state.assign(state)
    np.testing.assert_array_equal(keras.random.normal([64], seed=seed).numpy(), want)


def test_a_compiled_draw_is_a_function_of_the_seed_generator_state():
    """What resume relies on: from the same SeedGenerator state (as a checkpoint restores
    it) the compiled draw repeats bit for bit, and each draw advances the state once,
    as Keras's own draw does."""
    layer = keras.layers.GaussianNoise(1.0, seed=5)
    model = _alone(layer)
    state = layer.seed_generator.state.numpy()
    first = _compiled_draw(layer, tf.zeros([8, 256]), model)
    advanced = layer.seed_generator.state.numpy()
    second = _compiled_draw(layer, tf.zeros([8, 256]), model)
    assert (first != second).any()  # the next step draws anew
    layer.seed_generator.state.assign(state)
    np.testing.assert_array_equal(_compiled_draw(layer, tf.zeros([8, 256]), model), first)
    layer.seed_generator.state.assign(state)
    keras.random.normal([4], seed=layer.seed_generator)  # Keras's own draw
    np.testing.assert_array_equal(layer.seed_generator.state.numpy(), advanced)


@pytest.mark.slow  # three Trainers compiling: ~15 s on 2 loaded cores
def test_compiled_random_layers_repeat_on_a_rerun_and_resume_bitwise(tmp_path):
    """The draws follow the layers' SeedGenerators: a run stopped at step 2 and resumed
    ends with the uninterrupted run's weights, bit for bit (its first 2 steps a rerun)."""
    def run(name, steps):
        trainer = tputrain.Trainer(RandomLayerTask(*RANDOM_LAYERS), str(tmp_path / name),
                                   strategy=strategy_for(1), train_steps=4, steps_per_loop=2,
                                   global_batch_size=8, checkpoint_every=2, eval_steps=1,
                                   jit_compile="auto", seed=0, report_mfu=False)
        trainer.train(steps)
        return trainer
    whole = run("whole", 4)
    assert whole._steps.plan().whole_step
    run("resumed", 2)
    resumed = run("resumed", 2)
    assert resumed.current_step == 4
    for a, b in zip(whole.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)
