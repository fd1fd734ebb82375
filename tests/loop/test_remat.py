"""Rematerialization (`Trainer.remat`): the same gradients, weights and counted
FLOPs as without it, on the step's XLA and multi-replica paths."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.checkpointing.seeds import seed_generator_states
from tputrain.observe.flops import count_flops
from tputrain.runtime.model_state import build_model_state
from tputrain.options import RematOptions, TrainerOptions
from tputrain.loop.remat import remat_disabled
from tputrain.tasks import SyntheticLMTask
from tiny import TinyTask, strategy_for

MODES = [None, "full", "activations", RematOptions("larger_than", output_size_threshold=1000),
         RematOptions("list_of_layers", layer_names=("logits", "dense_1"))]


def _task() -> SyntheticLMTask:
    return SyntheticLMTask(vocab_size=64, sequence_length=16, width=32, num_layers=2,
                           num_heads=2)


class SGDLM(SyntheticLMTask):
    """SGD: Adam would turn float noise in the attention key biases' gradients (zero:
    softmax ignores them) into full-size steps whose sign differs run to run."""

    def build_optimizer(self):
        return keras.optimizers.SGD(0.1)


def _batch():
    tokens = tf.random.stateless_uniform([4, 16], [1, 2], 0, 64, tf.int32)
    labels = tf.random.stateless_uniform([4, 16], [3, 4], 0, 64, tf.int32)
    return {"tokens": tokens}, labels


def _model(task, remat):
    keras.utils.set_random_seed(0)
    spec = {"tokens": tf.TensorSpec([4, 16], tf.int32)}
    options = TrainerOptions(remat=remat).remat
    return build_model_state(task, tf.distribute.get_strategy(), spec, (), None, options)


@functools.lru_cache(maxsize=None)
def _reference_gradients(jit_compile: bool) -> tuple[np.ndarray, ...]:
    """Without remat: computed once a process, the reference of every mode's test."""
    return tuple(_gradients(None, jit_compile))


def _gradients(remat, jit_compile):
    task = _task()
    state = _model(task, remat)
    step = tf.function(lambda batch: task.compute_gradients(batch, state.model, state.optimizer, 4),
                       jit_compile=jit_compile)
    return [tf.convert_to_tensor(g).numpy() for g in step(_batch())[0]]


def test_a_string_stands_for_remat_options_and_bad_values_name_the_knob():
    assert TrainerOptions(remat="full").remat == RematOptions("full")
    assert TrainerOptions().remat is None
    assert tputrain.RematOptions is RematOptions
    for bad in ("everything", 3, {"mode": "full"}):
        with pytest.raises(ValueError, match="Trainer.remat must be one of"):
            TrainerOptions(remat=bad)
    with pytest.raises(ValueError, match="layer_names"):
        TrainerOptions(remat=RematOptions("list_of_layers"))
    with pytest.raises(ValueError, match="output_size_threshold"):
        RematOptions("larger_than", output_size_threshold=-1)


# Every mode without XLA and the options' modes with it in the default tier; "full" and
# "activations" under XLA with --slow.
GRADIENT_CASES = [pytest.param(remat, jit, id=f"{remat}-{jit}", marks=(
    pytest.mark.slow if jit and remat in ("full", "activations") else ()))
    for jit in (False, True) for remat in MODES[1:]]


@pytest.mark.parametrize("remat, jit_compile", GRADIENT_CASES)
def test_gradients_are_those_without_remat(remat, jit_compile):
    # Keras's RematScope alone fails here on TensorFlow: tf.recompute_grad takes no
    # keyword arguments in a graph, and Keras passes `training=` to every layer.
    reference = _reference_gradients(jit_compile)
    for got, want in zip(_gradients(remat, jit_compile), reference, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_remat_recomputes_and_flops_are_counted_without_it():
    task = _task()
    spec = ({"tokens": tf.TensorSpec([4, 16], tf.int32)}, tf.TensorSpec([4, 16], tf.int32))

    def flops(state):
        return count_flops(lambda batch: task.compute_gradients(
            batch, state.model, state.optimizer, 4), spec)
    plain, remat = _model(task, None), _model(task, "full")
    assert flops(remat) > flops(plain)  # the recomputed forward is in the graph
    with remat_disabled(remat.model):
        assert flops(remat) == flops(plain)
    assert flops(remat) > flops(plain)  # restored


def _train(tmp_path, name, replicas, **kwargs):
    task = SGDLM(vocab_size=64, sequence_length=16, width=32, num_layers=1, num_heads=2)
    trainer = tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(replicas),
                               train_steps=2, steps_per_loop=2, global_batch_size=8,
                               **kwargs)
    trainer.train()
    weights = [v.numpy() for v in trainer.model.trainable_variables]
    return weights, trainer.flops_per_step, trainer.plan.xla


# One replica is trained in mixed_bfloat16 in the default tier; float32 (1 and 2 replicas)
# with --slow.
@pytest.mark.parametrize("replicas, precision", [
    pytest.param(1, "float32", marks=pytest.mark.slow),
    pytest.param(2, "float32", marks=pytest.mark.slow), (1, "mixed_bfloat16")])
def test_training_with_remat_gives_the_same_weights_and_flops(tmp_path, replicas, precision):
    plain, plain_flops, xla = _train(tmp_path, "plain", replicas, precision=precision)
    remat, remat_flops, remat_xla = _train(tmp_path, "remat", replicas, precision=precision,
                                           remat="full")
    assert remat_xla == xla
    assert remat_flops == plain_flops
    # float32: the same ops recomputed, the same numbers. mixed_bfloat16 agrees only
    # to bfloat16 rounding (the recomputed backward rounds differently; not pinned down).
    atol = 1e-6 if precision == "float32" else 2e-3
    for got, want in zip(remat, plain, strict=True):
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)


# ------------------------------------------------------------ random layers (issue 50)
#
# The recomputation must replay the forward pass's random draws: a Dropout recomputed
# with a new mask gives a gradient that belongs to no forward pass, and a seed
# generator advanced again by the recomputation draws other masks at every later step.


class DropoutTask(TinyTask):
    """TinyTask's classifier with two Dropouts (one nested in a block): no L2, so the
    gradients are the cross-entropy's alone."""

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(32, activation="relu")(inputs)
        h = keras.layers.Dropout(0.5, seed=1)(h)
        block = keras.Sequential([keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dropout(0.5, seed=2)], name="block")
        return keras.Model({"x": inputs}, keras.layers.Dense(2)(block(h)))


def _dropout_gradients(remat, replicas: int, jit_compile: bool):
    """Each replica's gradients of two steps (the second draws the next masks) and the
    seed generators' states after them."""
    task, strategy = DropoutTask(num_examples=16), strategy_for(replicas)
    keras.utils.set_random_seed(0)
    spec = {"x": tf.TensorSpec([16 // replicas, 8], tf.float32)}
    state = build_model_state(task, strategy, spec, (), None, TrainerOptions(remat=remat).remat)
    batch = ({"x": tf.constant(task.x)}, tf.constant(task.y))
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(batch).unbatch().batch(16))
    per_replica = next(iter(dataset))

    @tf.function(jit_compile=jit_compile)
    def gradients(batch):
        return task.compute_gradients(batch, state.model, state.optimizer, 16)[0]

    steps = [[g.numpy() for g in tf.nest.flatten(tf.nest.map_structure(
        strategy.experimental_local_results,
        tf.function(lambda b: strategy.run(gradients, args=(b,)))(per_replica)))]
        for _ in range(2)]
    seeds = [tf.convert_to_tensor(v).numpy() for v in seed_generator_states(state.model)]
    return steps, seeds


@pytest.mark.parametrize("replicas, jit_compile", [(1, False), (1, True), (2, False)])
def test_random_layers_are_recomputed_with_the_forward_pass_draws(replicas, jit_compile):
    want, want_seeds = _dropout_gradients(None, replicas, jit_compile)
    got, got_seeds = _dropout_gradients("full", replicas, jit_compile)
    assert any(np.abs(g).max() > 0.1 for g in want[0])  # not vanishing gradients
    for got_step, want_step in zip(got, want, strict=True):
        for g, w in zip(got_step, want_step, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
    # as many draws a step as without remat: the recomputation does not advance them
    for g, w in zip(got_seeds, want_seeds, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_training_with_dropout_and_remat_gives_the_same_weights(tmp_path, replicas):
    def train(name, **kwargs):
        trainer = tputrain.Trainer(DropoutTask(), str(tmp_path / name),
                                   strategy=strategy_for(replicas), train_steps=4,
                                   steps_per_loop=2, global_batch_size=16, eval_steps=1,
                                   report_mfu=False, **kwargs)
        trainer.train()
        seeds = [tf.convert_to_tensor(v).numpy() for v in seed_generator_states(trainer.model)]
        return [v.numpy() for v in trainer.model.trainable_variables], seeds

    (plain, plain_seeds), (remat, remat_seeds) = train("plain"), train("remat", remat="full")
    for got, want in zip(remat, plain, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    for got, want in zip(remat_seeds, plain_seeds, strict=True):
        np.testing.assert_array_equal(got, want)
