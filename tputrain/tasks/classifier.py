"""An MLP image classifier whose inputs are any tputrain input builders (gin-bound).

The model and loss are fixed; the data comes from two callables that take the
`InputContext` and return per-replica `(features, label)` batches, such as
`TFDSInput` or `TFRecordInput`. A gin file picks them, e.g.
`MLPClassifierTask.train_input = @train/TFDSInput()` (see configs/tfds_mnist.gin).
"""

from __future__ import annotations

from typing import Callable, Sequence

import keras
import tensorflow as tf

from tputrain.data import InputContext
from tputrain.task import Task

InputBuilder = Callable[[InputContext], tf.data.Dataset]


class MLPClassifierTask(Task):
    """Flattens `image_key`, scales it by `scale`, then Dense layers to `num_classes` logits.

    Args:
        train_input, eval_input: input builders for the two splits (called once per
            host with the InputContext).
        num_classes: logits per example.
        hidden_units: widths of the hidden ReLU layers.
        image_key: the feature holding the image (any static shape, any number type).
        scale: multiplies the image after the cast to float (1/255 for uint8 pixels).
    """

    def __init__(self, train_input: InputBuilder, eval_input: InputBuilder,
                 num_classes: int = 10, hidden_units: Sequence[int] = (128,),
                 image_key: str = "image", scale: float = 1.0 / 255):
        for name, builder in (("train_input", train_input), ("eval_input", eval_input)):
            if not callable(builder):
                raise TypeError(f"MLPClassifierTask.{name} must be an input builder such as "
                                f"@train/TFDSInput(), got {builder!r}")
        self.inputs = {"train": train_input, "eval": eval_input}
        self.splits = tuple(self.inputs)
        self.num_classes = num_classes
        self.hidden_units = tuple(hidden_units)
        self.image_key = image_key
        self.scale = scale
        self._image_spec: tf.TensorSpec | None = None

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        dataset = self.inputs[split](input_context)
        features = dataset.element_spec[0]
        if self.image_key not in features:
            raise ValueError(f"MLPClassifierTask.image_key {self.image_key!r} is not a feature "
                             f"of the {split} input: use one of {sorted(features)}")
        spec = features[self.image_key]
        self._image_spec = tf.TensorSpec(spec.shape[1:], spec.dtype)
        return dataset

    def build_model(self) -> keras.Model:
        if self._image_spec is None:
            raise RuntimeError("MLPClassifierTask.build_model needs the inputs built first "
                               "(the Trainer builds them before the model)")
        image = keras.Input(tuple(self._image_spec.shape), dtype=self._image_spec.dtype.name,
                            name=self.image_key)
        x = keras.layers.Flatten()(image)
        x = keras.layers.Rescaling(self.scale)(x)  # casts to the compute dtype first
        for index, units in enumerate(self.hidden_units):  # named: InitCheckpoint matches by name
            x = keras.layers.Dense(units, activation="relu", name=f"hidden_{index}")(x)
        logits = keras.layers.Dense(self.num_classes, dtype="float32", name="logits")(x)
        return keras.Model({self.image_key: image}, logits, name="mlp_classifier")

    def compute_loss(self, labels, outputs) -> tf.Tensor:
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]
