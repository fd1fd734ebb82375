"""`tputrain.Task`'s default steps with models unlike the built-in tasks."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import strategy_for

_RNG = np.random.RandomState(0)
X = _RNG.randn(200, 4).astype(np.float32)
Y = X.sum(axis=1).astype(np.float32)


class SqueezedRegression(tputrain.Task):
    """A 1-unit regression head squeezed to [batch] (float labels [batch]) with an
    MAE metric; the eval split padded to whole batches (`pad_to_batch`), the documented
    way to evaluate every example."""

    def build_model(self) -> keras.Model:
        inputs = keras.Input((4,), name="x")
        return keras.Model({"x": inputs}, keras.layers.Reshape(())(keras.layers.Dense(1)(inputs)))

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": X}, Y)).shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id)
        if split == "train":
            return dataset.repeat().batch(batch, drop_remainder=True)
        return dataset.batch(batch).map(lambda *e: tputrain.data.pad_to_batch(e, batch))

    def compute_loss(self, labels, outputs):
        return tf.square(labels - outputs)

    def build_metrics(self):
        return [keras.metrics.MeanAbsoluteError(name="mae")]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_squeezed_regression_heads_padded_eval_is_the_mae_over_every_example(
        tmp_path, replicas):
    """Outputs and labels of rank 1 with the padding's weights of rank 1: Keras's MAE
    reduces the last axis, the batch here, which the weights cannot broadcast to; the
    metric is updated per example instead, and equals numpy's over the 200 examples."""
    trainer = tputrain.Trainer(SqueezedRegression(), str(tmp_path), train_steps=4,
                               steps_per_loop=2, global_batch_size=32,
                               strategy=strategy_for(replicas))
    trainer.train()
    logs = trainer.evaluate_weights()
    predictions = trainer.model({"x": X}).numpy()
    assert logs["mae"] == pytest.approx(float(np.mean(np.abs(Y - predictions))), rel=1e-5)


class BroadcastLoss(SqueezedRegression):
    """The user's slip: a 1-unit head [batch, 1] minus labels [batch] broadcasts to
    every pair, a [batch, batch] "per-example" loss."""

    def build_model(self) -> keras.Model:
        inputs = keras.Input((4,), name="x")
        return keras.Model({"x": inputs}, keras.layers.Dense(1)(inputs))

    def compute_loss(self, labels, outputs):
        return tf.square(labels - outputs)

    def build_metrics(self):
        return []


def test_a_loss_broadcast_over_every_pair_of_the_batch_is_refused_naming_the_fix(tmp_path):
    trainer = tputrain.Trainer(BroadcastLoss(), str(tmp_path), train_steps=2,
                               global_batch_size=32, strategy=strategy_for(1))
    with pytest.raises(ValueError, match=r"\[32, 32\].*labels \[32\].*outputs \[32, 1\]"):
        trainer.train()
