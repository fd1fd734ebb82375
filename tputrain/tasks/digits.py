"""Handwritten digits (8x8, the copy scikit-learn ships): real data, no network.

On first use the 1797 images are split (held-out eval set) and written to
sharded TFRecords in a cache directory with `write_tfrecords`; training then
reads them back through `TFRecordInput`, like any large dataset would be read.
"""

from __future__ import annotations

import os
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tputrain.core.cache_dir import cache_root
from tputrain.data import InputContext, TFRecordInput, write_tfrecords
from tputrain.task import Task

NUM_EVAL = 320  # a multiple of 64, so every eval batch of a power-of-two size is full
FEATURES = {"image": ([64], "float32"), "label": ([], "int64")}


def default_cache_dir() -> str:
    return os.path.join(cache_root(), "digits")


def prepare_digits(cache_dir: str, train_shards: int = 8, eval_shards: int = 2) -> dict[str, str]:
    """Writes the digits as TFRecords once; returns {split: file pattern}."""
    patterns = {split: os.path.join(cache_dir, f"{split}-*-of-*.tfrecord") for split in ("train", "eval")}
    if all(tf.io.gfile.glob(p) for p in patterns.values()):
        return patterns
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("the digits task needs scikit-learn: pip install 'tputrain[data]'") from error
    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    images = (digits.data[order] / 16.0).astype(np.float32)
    labels = digits.target[order].astype(np.int64)
    splits = {"eval": slice(0, NUM_EVAL), "train": slice(NUM_EVAL, None)}
    for split, shards in (("train", train_shards), ("eval", eval_shards)):
        write_tfrecords({"image": images[splits[split]], "label": labels[splits[split]]},
                        os.path.join(cache_dir, split), num_shards=shards)
    return patterns


class DigitsTask(Task):
    """An MLP classifier on scikit-learn's 8x8 digits (1477 train / 320 eval)."""

    splits = ("train", "eval")

    def __init__(self, hidden_units: Sequence[int] = (256, 128), dropout: float = 0.1,
                 cache_dir: str | None = None, shuffle_buffer: int = 2048, seed: int = 0,
                 cache: bool | str = "memory"):
        self.hidden_units = tuple(hidden_units)
        self.dropout = dropout
        self.cache_dir = cache_dir or default_cache_dir()
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        # The whole split is ~0.4 MB: parsed once and served from RAM, each batch
        # costs one gather instead of per-example shuffle/batch/parse work that
        # would compete with this small model's short step for the host's cores.
        self.cache = cache

    def build_model(self) -> keras.Model:
        image = keras.Input((64,), name="image")
        x = image
        for index, units in enumerate(self.hidden_units):  # named: InitCheckpoint matches by name
            x = keras.layers.Dense(units, activation="relu", name=f"hidden_{index}")(x)
            if self.dropout:
                x = keras.layers.Dropout(self.dropout, seed=self.seed)(x)
        logits = keras.layers.Dense(10, dtype="float32", name="logits")(x)
        return keras.Model({"image": image}, logits, name="digits_mlp")

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        patterns = prepare_digits(self.cache_dir)
        training = split == "train"
        return TFRecordInput(patterns[split], FEATURES, label_key="label",
                             shuffle=training, repeat=training,
                             pad_remainder=not training,  # every eval example, any batch
                             shuffle_buffer=self.shuffle_buffer, seed=self.seed,
                             cache=self.cache)(input_context)

    def compute_loss(self, labels, outputs) -> tf.Tensor:
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
