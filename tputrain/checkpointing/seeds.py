"""Keras' seed generators, saved with the model for an exact resume.

Keras does not expose the `SeedGenerator`s to `tf.train.Checkpoint`, so without
tracking them explicitly dropout masks after a resume differ from an
uninterrupted run.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def seed_generator_states(model: keras.Model) -> list[tf.Variable]:
    """Returns the state variables of every `SeedGenerator` in `model`'s layers."""
    states, seen = [], set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for generator in getattr(layer, "_seed_generators", []):
            state = generator.state
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states
