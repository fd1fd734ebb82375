"""A small Transformer language model on synthetic tokens, for throughput work.

Each sequence is an arithmetic progression modulo the vocabulary with a random
start and stride, so the model can learn it (loss falls) while the data costs
almost nothing to make: the step, not the input, is what gets measured. Shapes
are static: [per_replica_batch, sequence_length].
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tputrain.data import InputContext
from tputrain.task import Task


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned [sequence_length, width] table to the token embeddings.

    A layer of its own so the table is a trainable weight: an `Embedding` called
    on a constant `arange` is folded into the graph as a constant and never trains.
    """

    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), name="table",
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + keras.ops.cast(self.table, x.dtype)


def transformer_block(x: keras.KerasTensor, width: int, heads: int, mlp_ratio: int,
                      attention_mask: keras.KerasTensor | None = None) -> keras.KerasTensor:
    """A pre-norm block: causal self-attention, or attention where `attention_mask`
    ([batch, length, length], e.g. `text_lm.segment_mask`) allows; then the MLP."""
    h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    attention = keras.layers.MultiHeadAttention(heads, width // heads)
    h = (attention(h, h, use_causal_mask=True) if attention_mask is None
         else attention(h, h, attention_mask=attention_mask))
    x = x + h
    h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    h = keras.layers.Dense(width * mlp_ratio, activation="gelu")(h)
    return x + keras.layers.Dense(width)(h)


class SyntheticLMTask(Task):
    """Causal LM: embedding, `num_layers` pre-norm blocks, float32 logits."""

    def __init__(self, vocab_size: int = 512, sequence_length: int = 128, width: int = 256,
                 num_layers: int = 4, num_heads: int = 4, mlp_ratio: int = 4, seed: int = 0):
        if width % num_heads:
            raise ValueError(f"width {width} is not divisible by num_heads {num_heads}")
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.width = width
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.mlp_ratio = mlp_ratio
        self.seed = seed

    def build_model(self) -> keras.Model:
        tokens = keras.Input((self.sequence_length,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(self.vocab_size, self.width)(tokens)
        x = PositionEmbedding(name="positions")(x)
        for _ in range(self.num_layers):
            x = transformer_block(x, self.width, self.num_heads, self.mlp_ratio)
        x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        logits = keras.layers.Dense(self.vocab_size, dtype="float32", name="logits")(x)
        return keras.Model({"tokens": tokens}, logits, name="synthetic_lm")

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        length, vocab = self.sequence_length, self.vocab_size
        seed = self.seed + (0 if split == "train" else 1)

        def make_batch(indices: tf.Tensor):
            key = tf.stack([tf.constant(seed, tf.int64), indices[0]])  # one seed per batch
            start = tf.random.stateless_uniform([batch], key, 0, vocab, tf.int64)
            stride = tf.random.stateless_uniform([batch], key + 1, 1, 16, tf.int64)
            steps = tf.range(length + 1, dtype=tf.int64)
            tokens = tf.cast((start[:, None] + stride[:, None] * steps[None, :]) % vocab, tf.int32)
            tokens = tf.ensure_shape(tokens, [batch, length + 1])
            return {"tokens": tokens[:, :-1]}, tokens[:, 1:]

        # Disjoint example indices per input pipeline; eval is a fixed finite set.
        stop = None if split == "train" else 64 * batch
        dataset = tf.data.Dataset.range(input_context.input_pipeline_id, stop or 2**62,
                                        input_context.num_input_pipelines)
        dataset = dataset.batch(batch, drop_remainder=True)
        return dataset.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)

    def compute_loss(self, labels, outputs) -> tf.Tensor:
        per_token = keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)
        return tf.reduce_mean(per_token, axis=-1)

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return [keras.metrics.SparseCategoricalAccuracy(name="token_accuracy")]
