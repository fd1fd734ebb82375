"""The user's compiled model rebuilt in the strategy scope (`KerasTask.build_model`).

`keras.models.clone_model` rebuilds a functional or Sequential model from its layers'
configs. A model class of its own with a `from_config` (Keras-Hub's `GPT2CausalLM`,
whose backbone makes its layers from a few arguments) is rebuilt by that class
instead: `clone_model` turns it into a plain functional model of other layers.

Neither config holds what the user did to the built model: LoRA enabled on some
layers (`backbone.enable_lora(rank)`, `layer.enable_lora(rank)`), layers or
weights frozen, lookup vocabularies and `Normalization` statistics from `adapt`.
`cloned` does the same to the copy (layer by layer, in the same order) and then
copies every weight, the LoRA factors included, so the copy trains exactly the
weights the user's model would. See docs/keras_hub.md.
"""

from __future__ import annotations

from typing import Any, Iterator

import keras


def _rebuilt(source: keras.Model) -> keras.Model:
    """A copy of `source`'s architecture (fresh weights): by its own class's
    `from_config` where a class outside Keras defines one, else `clone_model`."""
    owner = next((k for k in type(source).__mro__ if "from_config" in vars(k)), None)
    if owner is not None and not owner.__module__.startswith("keras."):
        return type(source).from_config(source.get_config())
    # clone_model compiles the copy from the model's compile config: a loss or metric
    # function or class the user registered nowhere is found among the model's own.
    with keras.saving.custom_object_scope(_compiled_objects(source)):
        return keras.models.clone_model(source)


def _compiled_objects(model: keras.Model) -> dict[str, Any]:
    """The functions and classes `model.compile` was given (its losses, metrics,
    optimizer), by the names their serialized config refers to them by."""
    compiled = getattr(model, "_compile_config", None)  # Keras keeps compile's arguments
    found: dict[str, Any] = {}
    for item in _leaves(getattr(compiled, "config", {})):
        target = item if callable(item) and not isinstance(item, type) and hasattr(
            item, "__name__") else type(item)
        if target.__module__.startswith(("keras.", "builtins")):
            continue
        for name in {getattr(target, "__name__", None),
                     keras.saving.get_registered_name(target)}:
            if name:
                found[name] = target
    return found


def _leaves(value: Any) -> Iterator[Any]:
    """The non-container values inside nested lists, tuples and dicts."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        yield value


def _layers(model: keras.Model) -> list[keras.layers.Layer]:
    return list(model._flatten_layers(include_self=False))  # pylint: disable=protected-access


def mirror_lora_and_trainable(source: keras.Model, copy: keras.Model) -> None:
    """`copy`'s layers and weights made trainable or frozen as `source`'s are, with LoRA
    enabled where `source` has it; a ValueError when their layers do not pair up."""
    pairs = list(zip(_layers(source), _layers(copy)))
    if len(_layers(source)) != len(_layers(copy)) or any(  # names: some are made unique
            type(a) is not type(b) for a, b in pairs):
        raise ValueError("the copy's layers are not the model's")
    copy.trainable = source.trainable
    for theirs, ours in pairs:  # parents first: a child's own flag wins
        ours.trainable = theirs.trainable
    for theirs, ours in pairs:
        if getattr(theirs, "lora_enabled", False) and not getattr(ours, "lora_enabled", False):
            ours.enable_lora(theirs.lora_rank, lora_alpha=theirs.lora_alpha)
    mirror_weight_flags(source, copy)


def mirror_weight_flags(source: keras.Model, copy: keras.Model) -> None:
    """Each of `copy`'s weights trainable or frozen as `source`'s is: a weight frozen
    on its own (`layer.kernel.trainable = False`) is in no layer's config."""
    for theirs, ours in zip(source.weights, copy.weights):
        ours.trainable = theirs.trainable


def has_lora(model: keras.Model) -> bool:
    return any(getattr(layer, "lora_enabled", False) for layer in _layers(model))


_LOOKUPS = (keras.layers.StringLookup, keras.layers.IntegerLookup, keras.layers.TextVectorization)


def copy_vocabularies(source: keras.Model, copy: keras.Model) -> None:
    """The vocabularies `adapt` gave the source's lookup layers (StringLookup,
    IntegerLookup, TextVectorization) set on the copy's: they are neither weights nor
    in the layers' configs, and an empty table fails at the first step."""
    for theirs, ours in zip(_layers(source), _layers(copy)):
        if isinstance(theirs, _LOOKUPS) and type(ours) is type(theirs):
            vocabulary = theirs.get_vocabulary()
            if vocabulary and ours.get_vocabulary() != vocabulary:
                idf = (getattr(theirs, "idf_weights", None)
                       if getattr(theirs, "output_mode", None) == "tf_idf" else None)
                if idf is not None:
                    ours.set_vocabulary(vocabulary, idf_weights=keras.ops.convert_to_numpy(idf))
                else:
                    ours.set_vocabulary(vocabulary)


def cloned(source: keras.Model) -> keras.Model:
    """`source` rebuilt (in the caller's scope) with its weights, each weight's trainable
    flag, adapted preprocessing state and LoRA layers; a one-line TypeError naming the
    fix when it cannot be rebuilt, or not the same."""
    try:
        return _cloned(source)
    except Exception as error:  # pylint: disable=broad-except  (named, then re-raised)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise TypeError(f"KerasTask could not rebuild {type(source).__name__}: pass a function "
                        "that builds and compiles it instead (`tputrain.fit(build, ...)`, "
                        f"docs/tasks.md); Keras said: {reason}") from error


def _cloned(source: keras.Model) -> keras.Model:
    copy = _rebuilt(source)
    copy_vocabularies(source, copy)
    lora = has_lora(source)
    if lora:
        mirror_lora_and_trainable(source, copy)
        if [v.path for v in copy.weights] != [v.path for v in source.weights]:
            raise ValueError("the copy's weights are not the model's")
    else:
        mirror_weight_flags(source, copy)
    copy.set_weights(source.get_weights())
    refresh_adapted_state(copy)
    if lora and [v.path for v in copy.trainable_variables] != [
            v.path for v in source.trainable_variables]:
        raise ValueError("the copy's trainable weights are not the model's")
    return copy


def refresh_adapted_state(model: keras.Model) -> None:
    """What preprocessing layers derive from their weights when they load them
    (`Normalization`'s mean and variance constants, from `adapt`'s variables):
    `set_weights` and a checkpoint's restore do not, `finalize_state` does."""
    for layer in _layers(model):
        if callable(getattr(layer, "finalize_state", None)) and layer.built:
            layer.finalize_state()
