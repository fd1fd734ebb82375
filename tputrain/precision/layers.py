"""Per-layer precision: keep named layers in float32 under a mixed policy.

Most layers lose nothing measurable in bfloat16, but a few cannot afford 8 bits of
mantissa: large offsets that later cancel, long sums, exponentials of large
values. `tputrain audit-precision` finds them; this module keeps them in float32
while the rest of the model computes in bf16/fp16:

    PrecisionOptions.keep_float32_layers = ['offset_cancel', 'block_3/*']

(`tputrain.PrecisionOptions`; in Python, `Trainer(precision=PrecisionOptions(...))`).
The Trainer (and the audit) apply it right after `Task.build_model()`. Keras 3
reads a layer's dtype policy on every call and casts floating inputs to it, so
changing the policy of a built layer changes how it computes; its variables are
float32 under every mixed policy already.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Sequence

import keras


def sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """`layer` and every layer nested in it (MultiHeadAttention's projections, ...)."""
    return list(layer._flatten_layers(include_self=True, recursive=True))  # pylint: disable=protected-access


def set_layer_dtype(layer: keras.layers.Layer, policy: str | keras.DTypePolicy) -> None:
    """Sets the dtype policy of `layer` and of every layer nested in it."""
    for sub in sublayers(layer):
        sub.dtype_policy = policy


def find_layers(model: keras.Model, patterns: Iterable[str]) -> list[keras.layers.Layer]:
    """Layers of `model` (nested ones included) whose name matches a pattern.

    Patterns are exact names or shell globs (`block_*`). A pattern that matches
    nothing is an error naming the model's layers, so a typo cannot silently
    leave a sensitive layer in bf16.
    """
    layers = [l for l in sublayers(model) if l is not model]
    found: list[keras.layers.Layer] = []
    for pattern in patterns:
        matches = [l for l in layers if fnmatch.fnmatchcase(l.name, pattern)]
        if not matches:
            names = ", ".join(l.name for l in model.layers if not isinstance(l, keras.layers.InputLayer))
            raise ValueError(
                f"keep_float32_layers: no layer of model {model.name!r} is named {pattern!r}; "
                f"its layers are: {names}. Name the layer (keras.layers.X(..., name='...')) "
                "and use that name, or a glob such as 'block_*'")
        found.extend(l for l in matches if l not in found)
    return found


def override_layer_dtypes(model: keras.Model,
                          keep_float32_layers: Sequence[str] = ()) -> keras.Model:
    """Keeps the layers named in `keep_float32_layers` (and their sublayers) in float32.

    Returns `model` (changed in place). Call it after the model is built, under
    the policy it will train with; under float32 it only checks the names.
    """
    for layer in find_layers(model, keep_float32_layers):
        set_layer_dtype(layer, "float32")
    return model
