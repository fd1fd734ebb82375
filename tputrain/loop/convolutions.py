"""Whether a model has Keras convolution layers, and whether TensorFlow's CPU kernels
run through oneDNN: on a CPU, both change what `jit_compile="auto"` and
`steps_per_program="auto"` choose (docs/performance.md)."""

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


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its CPU kernels through oneDNN: on by default on x86 CPUs
    with AVX-512 VNNI and newer, off with TF_ENABLE_ONEDNN_OPTS=0. Its float32
    convolutions then beat XLA's CPU ones. TensorFlow's own answer (no public API)."""
    try:
        from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):  # another build: assume not
        return False


def convolutions_on_onednn(model: keras.Model, on_cpu: bool) -> bool:
    """Whether a conv net's convolutions run on oneDNN (TensorFlow's CPU kernels on x86
    CPUs with AVX-512 VNNI and newer): there its float32 and bf16 convolutions beat
    XLA's CPU ones, so "auto" compiles nothing of such a model's step but, in bf16
    on one replica, its GELUs and layer norms (docs/performance.md)."""
    return on_cpu and has_convolutions(model) and onednn_enabled()
