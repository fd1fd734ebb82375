"""A byte-level Transformer LM on packed rows of real text.

Rows come from packing (`tputrain.data.packing`): several documents a row, with
`segment_ids` (1, 2, ... a document, 0 on padding) and `positions` (restarting
at 0 each document). The model attends only within a document and causally,
its learned position table is read at `positions`, so a packed row computes each
document exactly as if it were alone. The loss is per token, weighted by the
packing's `loss_weights` and divided by the global batch's real tokens
(`Task.loss_denominator`): the same on any replica count.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from tputrain.data import InputContext
from tputrain.task import Task
from tputrain.tasks.transformer import transformer_block

TOKENS, SEGMENT_IDS, POSITIONS = "tokens", "segment_ids", "positions"


def segment_mask(segment_ids: tf.Tensor) -> tf.Tensor:
    """[batch, length] ids -> [batch, length, length] bool: query i sees key j when
    both are in the same segment and j <= i (padding, id 0, sees only padding)."""
    same = tf.equal(segment_ids[:, :, None], segment_ids[:, None, :])
    length = tf.shape(segment_ids)[1]
    causal = tf.range(length)[:, None] >= tf.range(length)[None, :]
    return tf.logical_and(same, causal[None])


class SegmentMask(keras.layers.Layer):
    """`segment_mask` as a layer of the functional model."""

    def call(self, segment_ids):
        return segment_mask(segment_ids)


class PositionTable(keras.layers.Layer):
    """Adds a learned [max_length, width] table, read at each token's position."""

    def __init__(self, max_length: int, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.max_length, input_shape[0][-1]), name="table",
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, inputs):
        x, positions = inputs
        return x + keras.ops.cast(tf.gather(self.table, positions), x.dtype)


class BitsPerToken(keras.metrics.Mean):
    """Mean cross-entropy in bits over real tokens (bits per byte for a byte-level LM)."""

    def __init__(self, name: str = "bits_per_token", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, labels, logits, sample_weight=None):
        nats = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return super().update_state(nats / math.log(2.0), sample_weight=sample_weight)


class TextLMTask(Task):
    """Causal LM over packed rows: `({tokens, segment_ids, positions}, targets,
    loss_weights)` batches of static shape [batch, sequence_length].

    `build_inputs` reads the standard library's source as bytes
    (`tputrain.data.text_corpus`), packed to `sequence_length`; override it for
    your own packed data (the same features). `sequence_length` is the row length
    (and the longest position the model learns).
    """

    def __init__(self, vocab_size: int = 258, sequence_length: int = 128, width: int = 128,
                 num_layers: int = 2, num_heads: int = 4, mlp_ratio: int = 4,
                 corpus_dir: str | None = None, max_files: int | None = 200,
                 shuffle_buffer: int = 256, seed: int = 0, static_length: bool = True):
        if width % num_heads:
            raise ValueError(f"TextLMTask: width {width} is not divisible by num_heads "
                             f"{num_heads}")
        self.vocab_size, self.sequence_length = vocab_size, sequence_length
        self.width, self.num_layers, self.num_heads = width, num_layers, num_heads
        self.mlp_ratio, self.seed, self.static_length = mlp_ratio, seed, static_length
        self.corpus_dir, self.max_files, self.shuffle_buffer = corpus_dir, max_files, shuffle_buffer

    def build_model(self) -> keras.Model:
        # static_length=False: any row length up to sequence_length (bucketed batches,
        # one compiled program a length); the Trainer feeds one static shape.
        shape = (self.sequence_length if self.static_length else None,)
        tokens = keras.Input(shape, dtype="int32", name=TOKENS)
        segments = keras.Input(shape, dtype="int32", name=SEGMENT_IDS)
        positions = keras.Input(shape, dtype="int32", name=POSITIONS)
        mask = SegmentMask(name="segment_mask")(segments)
        x = keras.layers.Embedding(self.vocab_size, self.width)(tokens)
        x = PositionTable(self.sequence_length, name="positions_table")([x, positions])
        for _ in range(self.num_layers):
            x = transformer_block(x, self.width, self.num_heads, self.mlp_ratio, mask)
        x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        logits = keras.layers.Dense(self.vocab_size, dtype="float32", name="logits")(x)
        return keras.Model({TOKENS: tokens, SEGMENT_IDS: segments, POSITIONS: positions},
                           logits, name="text_lm")

    def compute_loss(self, labels: Any, outputs: Any) -> tf.Tensor:
        """Per token, [batch, length]; the packing's loss weights zero the padding."""
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def loss_denominator(self, batch: Any) -> tf.Tensor:
        """The batch's real tokens (its loss weights' sum)."""
        return tf.reduce_sum(tf.cast(batch[2], tf.float32))

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return [BitsPerToken(), keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

    def flops_per_example(self) -> float:
        """6 x parameters x tokens a row (forward and backward; attention not counted)."""
        width, layers, vocab = self.width, self.num_layers, self.vocab_size
        params = layers * (4 * width * width + 2 * self.mlp_ratio * width * width) + vocab * width
        return 6.0 * params * self.sequence_length

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        from tputrain.tasks.text_lm_inputs import packed_text  # data modules, on use
        return packed_text(self, split, input_context)
