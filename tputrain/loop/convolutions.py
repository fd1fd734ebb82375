"""Whether a model has Keras convolution layers: on a CPU, XLA's convolutions change
what `jit_compile="auto"` and `steps_per_program="auto"` choose (docs/performance.md)."""

from __future__ import annotations

import keras

_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                 keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D,
                 keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)


def has_convolutions(model: keras.Model) -> bool:
    """Whether any of the model's layers is a Keras convolution (a `tf.nn.conv2d`
    called from a custom layer is not seen)."""
    layers = model._flatten_layers(include_self=False, recursive=True)  # pylint: disable=protected-access
    return any(isinstance(layer, _CONVOLUTIONS) for layer in layers)
