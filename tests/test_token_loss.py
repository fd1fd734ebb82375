"""A per-token loss normalised by the global batch's real tokens (Task.loss_denominator).

Sequence rows carry padding (0 loss weight). The loss a run optimises must be
the mean over the real tokens of the whole global batch, whatever the replica
count and micro-batches: rows with many real tokens on one replica and few on
another must not be averaged per replica or per row.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import strategy_for

LENGTH, VOCAB, BATCH = 6, 11, 8


def _rows(count: int, seed: int):
    """Rows whose real lengths differ a lot (1 .. LENGTH tokens)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, VOCAB, size=(count, LENGTH)).astype(np.int32)
    targets = rng.randint(1, VOCAB, size=(count, LENGTH)).astype(np.int32)
    real = np.array([1 + (i * 5) % LENGTH for i in range(count)])
    weights = (np.arange(LENGTH)[None, :] < real[:, None]).astype(np.float32)
    return tokens, targets, weights


class TokenTask(tputrain.Task):
    """A per-token classifier over (tokens, targets, loss weights) rows."""

    def __init__(self, normalise_by_tokens: bool = True):
        self.data = _rows(64, seed=0)
        self.normalise_by_tokens = normalise_by_tokens

    def build_model(self):
        tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
        h = keras.layers.Embedding(VOCAB, 8, embeddings_initializer=keras.initializers.RandomNormal(seed=1))(tokens)
        h = keras.layers.Dense(8, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=2))(h)
        logits = keras.layers.Dense(VOCAB, kernel_initializer=keras.initializers.GlorotUniform(seed=3))(h)
        return keras.Model({"tokens": tokens}, logits)

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        tokens, targets, weights = self.data
        dataset = tf.data.Dataset.from_tensor_slices(({"tokens": tokens}, targets, weights))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.repeat().batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def loss_denominator(self, batch):
        if not self.normalise_by_tokens:
            return None
        return tf.reduce_sum(batch[2])

    def build_optimizer(self):
        return keras.optimizers.SGD(0.5)


def _train(tmp_path, name, replicas, steps=3, **kwargs):
    kwargs.setdefault("jit_compile", False)
    trainer = tputrain.Trainer(TokenTask(), str(tmp_path / name), strategy=strategy_for(replicas),
                               train_steps=steps, steps_per_loop=steps, global_batch_size=BATCH,
                               checkpoint_every=10**6, eval_steps=1, **kwargs)
    logs = trainer.run_loop(steps)[0]
    return trainer, logs


def _reference(steps=3):
    """Plain TensorFlow on one device: SGD on the mean loss over real tokens."""
    task = TokenTask()
    model = task.build_model()
    tokens, targets, weights = task.data
    losses = []
    for step in range(steps):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        with tf.GradientTape() as tape:
            per_token = task.compute_loss(targets[rows], model({"tokens": tokens[rows]}))
            loss = tf.reduce_sum(per_token * weights[rows]) / weights[rows].sum()
        grads = tape.gradient(loss, model.trainable_variables)
        for variable, grad in zip(model.trainable_variables, grads):
            variable.assign_sub(0.5 * tf.convert_to_tensor(grad))
        losses.append(float(loss))
    return [np.asarray(w) for w in model.get_weights()], losses


@pytest.mark.parametrize("replicas,jit_compile", [(1, False), (1, "auto"), (2, False),
                                                  (2, "auto"), (4, False)])
def test_the_loss_is_the_mean_over_the_global_batchs_real_tokens(tmp_path, replicas,
                                                                 jit_compile):
    """Host input splits each global batch over the replicas, so every run sees the
    reference's rows; "auto" compiles the whole step (1) or the update (2) with XLA."""
    trainer, logs = _train(tmp_path, "run", replicas, jit_compile=jit_compile)
    expected_weights, losses = _reference()
    assert logs["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    for got, want in zip(trainer.model.get_weights(), expected_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_per_token_normalisation_is_the_same_on_1_2_and_4_replicas_and_with_micro_batches(tmp_path):
    """Per-replica normalisation would differ here: the replicas' rows hold different
    numbers of real tokens."""
    runs = {n: _train(tmp_path, f"r{n}", n)[0] for n in (1, 2, 4)}
    runs["accumulated"] = _train(tmp_path, "acc", 2, accumulation_steps=2)[0]
    reference = [np.asarray(w) for w in runs[1].model.get_weights()]
    for name, trainer in runs.items():
        for got, want in zip(trainer.model.get_weights(), reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(name))


def test_without_a_denominator_the_loss_is_per_row_as_before(tmp_path):
    """The default (None) keeps dividing by the global batch (rows), so the runs
    differ: the test above is not vacuous."""
    task = TokenTask(normalise_by_tokens=False)
    trainer = tputrain.Trainer(task, str(tmp_path / "rows"), strategy=strategy_for(1),
                               train_steps=3, steps_per_loop=3, global_batch_size=BATCH,
                               checkpoint_every=10**6, eval_steps=1, jit_compile=False)
    trainer.run_loop(3)
    expected_weights, _ = _reference()
    assert not all(np.allclose(got, want, rtol=1e-5)
                   for got, want in zip(trainer.model.get_weights(), expected_weights))


def test_the_step_reports_real_tokens_and_the_padding_share(tmp_path):
    _, logs = _train(tmp_path, "tokens", 2)
    _, _, weights = TokenTask().data
    per_step = [weights[i * BATCH:(i + 1) * BATCH].sum() for i in range(3)]
    assert logs["real_tokens"] == pytest.approx(np.mean(per_step))
    assert logs["padding"] == pytest.approx(1 - np.mean(per_step) / (BATCH * LENGTH))
