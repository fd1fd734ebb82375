"""Random layers draw per-replica randomness on N replicas: the replica id folded into
every seed a model's `SeedGenerator`s hand out.

Why: a Keras 3 `SeedGenerator` keeps its state (`[seed, draws]`) in one variable;
created under MirroredStrategy it is mirrored, every replica reads the same state
and advances it the same way, so `Dropout`, `GaussianNoise` and the random
augmentation layers drew the same mask or noise on every replica at every step.

`fold_replica_into_seeds` wraps each generator's `next()`: in a replica context with
2+ replicas in sync, the seed it returns is `stateless_fold_in(seed, replica id in
sync)` (as T5X and MaxText fold the replica or host index into the key). The id is
global under MultiWorkerMirroredStrategy, so workers differ too. The state variable
is untouched: it advances as before, its copies stay equal, and the checkpoint
saves it as before, so the stream is a function of (state, replica) alone: a
resume, or other loop and checkpoint boundaries, draw the same masks. With one
replica (or outside `strategy.run`) the seed is returned as it was: one-replica
runs are bitwise what they were.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf


def seed_generators(model: keras.Model) -> list[Any]:
    """Every `SeedGenerator` of `model`'s layers, once each."""
    found: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):  # pylint: disable=protected-access
        for generator in getattr(layer, "_seed_generators", []):
            found[id(generator)] = generator
    return list(found.values())


def _replica_id() -> Any | None:
    """The global replica id in a replica context of 2+ replicas in sync, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context.replica_id_in_sync_group


def _folding(draw: Callable[..., Any]) -> Callable[..., Any]:
    def next(ordered: bool = True) -> Any:  # pylint: disable=redefined-builtin
        seed = draw(ordered=ordered)
        replica = _replica_id()
        if replica is None:
            return seed
        return tf.random.experimental.stateless_fold_in(seed, tf.cast(replica, tf.int64))
    next.folds_replica = True
    return next


def fold_replica_into_seeds(model: keras.Model) -> None:
    """Makes every `SeedGenerator` of `model` fold the replica id into its seeds (an
    instance attribute over the class's `next`; applied once, idempotent)."""
    for generator in seed_generators(model):
        if not getattr(generator.next, "folds_replica", False):
            generator.next = _folding(generator.next)
