"""A Keras-Hub causal LM built from its config (no download), fine-tuned with LoRA.

`KerasHubLMTask(backbone="GPT2Backbone", backbone_config={...}, lora_rank=4)`
builds `keras_hub.models.<backbone>(**backbone_config)` with random weights,
calls `backbone.enable_lora(lora_rank)` (Keras-Hub freezes every weight of the
backbone and adds trainable `lora_kernel_a`/`lora_kernel_b` factors to its
query and value projections) and wraps it in the matching `...CausalLM`
(`GPT2Backbone` -> `GPT2CausalLM`) without a preprocessor: inputs
`{"token_ids", "padding_mask"}` of `[batch, sequence_length]` int32, logits out.

The data needs no network either: arithmetic token sequences (a random start
and a random stride a row, modulo the vocabulary; `strides` picks which), so
next-token accuracy says how much the model learned. Override `build_inputs`
for your own token rows (the same features, next tokens as labels). Keras-Hub
is an optional dependency (`pip install 'tputrain[hub]'`), imported when the
model is built. See docs/keras_hub.md.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from tputrain.data import InputContext
from tputrain.task import Task

TOKEN_IDS, PADDING_MASK = "token_ids", "padding_mask"
TINY_GPT2 = {"vocabulary_size": 100, "num_layers": 2, "num_heads": 2, "hidden_dim": 16,
             "intermediate_dim": 32, "max_sequence_length": 16, "dropout": 0.0}


def keras_hub_module() -> Any:
    """`keras_hub`, or an ImportError naming the extra that installs it."""
    try:
        import keras_hub  # pylint: disable=import-outside-toplevel  (optional dependency)
    except ImportError as error:
        raise ImportError("the Keras-Hub path needs keras-hub: pip install 'tputrain[hub]' "
                          "(or pip install keras-hub)") from error
    return keras_hub


def arithmetic_rows(count: int, length: int, vocab: int, strides: Sequence[int],
                    seed: int) -> np.ndarray:
    """[count, length + 1] int32 rows `(start + stride * i) % vocab`."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, count)
    stride = np.asarray(strides)[rng.integers(0, len(strides), count)]
    return ((start[:, None] + stride[:, None] * np.arange(length + 1)[None]) % vocab
            ).astype(np.int32)


def enable_lora_on(model: keras.Model, rank: int, targets: Sequence[str] | None = None,
                   trainable_layers: Sequence[str] = (), lora_biases: bool = True
                   ) -> keras.Model:
    """`backbone.enable_lora(rank, targets)` on the model's Keras-Hub backbone (which
    leaves the adapted layers' biases trainable; `lora_biases=False` freezes them),
    then `trainable_layers` (layer names anywhere in the model) made trainable again:
    what the user leaves trainable beside the LoRA factors."""
    backbone = getattr(model, "backbone", model)
    backbone.enable_lora(rank, target_layer_names=list(targets) if targets else None)
    for layer in model._flatten_layers(include_self=False):  # pylint: disable=protected-access
        if getattr(layer, "lora_enabled", False) and getattr(layer, "bias", None) is not None:
            layer.bias.trainable = lora_biases
    named = {layer.name: layer for layer in model._flatten_layers(include_self=False)}  # pylint: disable=protected-access
    missing = sorted(set(trainable_layers) - set(named))
    if missing:
        raise ValueError(f"trainable_layers {missing} are not layers of the model; it has "
                         f"{sorted(named)[:20]}...")
    for name in trainable_layers:
        named[name].trainable = True
    return model


class KerasHubLMTask(Task):
    """Causal LM fine-tuning of a Keras-Hub backbone built from its config.

    Args:
      backbone: the class name in `keras_hub.models` ("GPT2Backbone",
        "GemmaBackbone", ...); its `...CausalLM` is the model.
      backbone_config: the backbone's constructor arguments (default: a 2-layer
        GPT-2, hidden 16, vocabulary 100, 16 positions).
      lora_rank: `backbone.enable_lora(lora_rank)` when set; None trains every weight.
      lora_targets: the layer names LoRA applies to (None: the backbone's
        `default_lora_layer_names()`, query and value).
      trainable_layers: layers left trainable beside the LoRA factors (names).
      lora_biases: keep the adapted layers' biases trainable, as Keras's
        `enable_lora` does; False: only the LoRA factors (and `trainable_layers`) train.
      sequence_length: tokens a row (at most the backbone's positions).
      strides: the arithmetic data's strides; train_rows, eval_rows: its sizes.
      seed: the weights' and the data's seed.
      learning_rate: Adam's learning rate; None: `tputrain.build_optimizer()` as
        configured (gin's `build_optimizer.*`).
    """

    def __init__(self, backbone: str = "GPT2Backbone",
                 backbone_config: Mapping[str, Any] | None = None, lora_rank: int | None = 4,
                 lora_targets: Sequence[str] | None = None, trainable_layers: Sequence[str] = (),
                 sequence_length: int = 16, strides: Sequence[int] = (1, 2, 3),
                 train_rows: int = 1024, eval_rows: int = 256, seed: int = 0,
                 learning_rate: float | None = None, lora_biases: bool = True):
        self.backbone, self.backbone_config = backbone, dict(backbone_config or TINY_GPT2)
        self.lora_rank, self.lora_targets = lora_rank, lora_targets
        self.trainable_layers = tuple(trainable_layers)
        self.sequence_length, self.strides = sequence_length, tuple(strides)
        self.rows = {"train": train_rows, "eval": eval_rows}
        self.seed, self.learning_rate, self.lora_biases = seed, learning_rate, lora_biases

    def build_model(self) -> keras.Model:
        hub = keras_hub_module()
        backbone_class = getattr(hub.models, self.backbone)
        causal_lm = getattr(hub.models, self.backbone.replace("Backbone", "CausalLM"))
        keras.utils.set_random_seed(self.seed)  # the same base weights in every process
        model = causal_lm(backbone_class(**self.backbone_config), preprocessor=None)
        if self.lora_rank:
            enable_lora_on(model, self.lora_rank, self.lora_targets, self.trainable_layers,
                           self.lora_biases)
        return model

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        rows = arithmetic_rows(self.rows["train" if split == "train" else "eval"],
                               self.sequence_length, self.backbone_config["vocabulary_size"],
                               self.strides, self.seed + (split != "train"))
        features = {TOKEN_IDS: rows[:, :-1], PADDING_MASK: np.ones_like(rows[:, :-1])}
        dataset = tf.data.Dataset.from_tensor_slices((features, rows[:, 1:]))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if split == "train":
            dataset = dataset.repeat()
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        return dataset.batch(batch, drop_remainder=True)

    def compute_loss(self, labels: Any, outputs: Any) -> tf.Tensor:
        """Each row's mean next-token cross-entropy."""
        per_token = keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)
        return tf.reduce_mean(per_token, axis=-1)

    def build_metrics(self) -> Sequence[keras.metrics.Metric]:
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        if self.learning_rate is None:
            return super().build_optimizer()
        return keras.optimizers.Adam(self.learning_rate)

    def feature_spec(self) -> dict[str, tf.io.FixedLenFeature]:
        """tf.Example features of a request (export's `serving_examples`)."""
        return {name: tf.io.FixedLenFeature([self.sequence_length], tf.int64)
                for name in (TOKEN_IDS, PADDING_MASK)}
