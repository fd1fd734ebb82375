"""A test model with one deliberately bf16-sensitive layer (for the precision audit).

`OffsetCancel` adds a large offset and subtracts it again: exact in float32, but in
bfloat16 (8-bit mantissa) values near 256 are spaced 2 apart, so activations of
size ~1 round to 0 or +-2. The other layers are ordinary. The float32 weights are
chosen to solve the task exactly (no training needed): the label is the sign of
`x0 + 0.5 x1`, which the "features" layer computes and the logits read out.
"""

from __future__ import annotations

import gin
import keras
import numpy as np
import tensorflow as tf

import tputrain


class OffsetCancel(keras.layers.Layer):
    """`(x + offset) - offset`, computed in the layer's compute dtype."""

    def __init__(self, offset: float = 256.0, **kwargs):
        super().__init__(**kwargs)
        self.offset = offset

    def call(self, x):
        offset = keras.ops.cast(self.offset, self.compute_dtype)
        return (x + offset) - offset

    def get_config(self):
        return {**super().get_config(), "offset": self.offset}


@gin.configurable
class SensitiveTask(tputrain.Task):
    """Binary classification of `x0 + 0.5 x1 > 0` on 8 Gaussian features."""

    def __init__(self, num_examples: int = 512, seed: int = 0):
        rng = np.random.RandomState(seed)
        self.x = rng.randn(num_examples, 8).astype(np.float32)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).astype(np.int64)

    def build_model(self) -> keras.Model:
        projection = np.zeros((8, 4), np.float32)
        projection[0, 0], projection[1, 0] = 1.0, 0.5  # unit 0: the decision value
        projection[2:, 1:] = np.random.RandomState(1).randn(6, 3) * 0.1  # distractors
        readout = np.zeros((4, 2), np.float32)
        readout[0] = [-4.0, 4.0]
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(4, name="features",
                               kernel_initializer=keras.initializers.Constant(projection))(inputs)
        h = OffsetCancel(name="offset_cancel")(h)
        h = keras.layers.Activation("linear", name="identity")(h)
        logits = keras.layers.Dense(2, dtype="float32", name="logits",
                                    kernel_initializer=keras.initializers.Constant(readout))(h)
        return keras.Model({"x": inputs}, logits, name="sensitive")

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x}, self.y))
        if split == "train":
            dataset = dataset.repeat()
        return dataset.batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
