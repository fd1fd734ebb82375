"""A Task whose splits are a two-source `MixtureInput`, shared by the eval and predict
tests: its eval batches carry `source_id` beside `x`, which the model must never get."""

from __future__ import annotations

import keras
import numpy as np

import tputrain
from tputrain.data import MixtureInput, write_tfrecords


class MixtureEvalTask(tputrain.Task):
    """A one-feature model (`x`) on a 50/50 mixture of `manifests` (label `y`)."""

    def __init__(self, manifests):
        self.manifests = manifests

    def build_model(self) -> keras.Model:
        x = keras.Input((1,), name="x")
        return keras.Model({"x": x}, keras.layers.Dense(2)(x))

    def build_inputs(self, split, input_context):
        return MixtureInput(self.manifests, [0.5, 0.5], label_key="y",
                            repeat=split == "train", shuffle=split == "train")(input_context)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def mixture_manifests(directory) -> list[str]:
    """Two 32-example sources of one feature `x` (about 3, far from the source ids 0
    and 1, so a model fed the id instead of `x` gives other outputs)."""
    rng = np.random.default_rng(0)
    manifests = []
    for name in ("a", "b"):
        x = rng.normal(size=(32, 1)).astype("float32") + 3.0
        write_tfrecords({"x": x, "y": (x[:, 0] > 3).astype("int64")}, str(directory / name),
                        num_shards=1)
        manifests.append(str(directory / f"{name}.manifest.json"))
    return manifests
