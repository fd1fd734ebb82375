"""Checkpoints: periodic, keep-N, restore-latest, and what exact resume needs.

A checkpoint holds the model, the optimizer (with its slots), the step, the
host's input iterator (the data position, including shuffle buffers) and the
state of every Keras `SeedGenerator` in the model. Keras does not expose the
seed generators to `tf.train.Checkpoint`, so without tracking them explicitly
dropout masks after a resume differ from an uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from absl import logging


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


class Checkpointer:
    """Saves every `every` steps into `directory`, keeps `keep`, restores the latest.

    `CheckpointManager` writes the data files before it updates the `checkpoint`
    index file, so a save interrupted mid-write is never chosen on restore. If the
    newest listed checkpoint cannot be read, older ones are tried with a warning.
    """

    def __init__(self, directory: str, step: tf.Variable, every: int, keep: int = 3,
                 **trackables: Any):
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {every}")
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        self.directory = directory
        self.every = every
        self.step = step
        self.checkpoint = tf.train.Checkpoint(step=step, **trackables)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, directory, max_to_keep=keep, step_counter=step)

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore_latest(self) -> str | None:
        """Restores the newest readable checkpoint; returns its path or None."""
        candidates = list(reversed(self.manager.checkpoints))
        for index, path in enumerate(candidates):
            try:
                status = self.checkpoint.restore(path)
                status.assert_existing_objects_matched()
            except (tf.errors.OpError, ValueError, AssertionError) as error:
                if index + 1 == len(candidates):
                    raise
                logging.warning("tputrain: checkpoint %s is unreadable (%s); trying %s",
                                path, str(error).splitlines()[0], candidates[index + 1])
                continue
            logging.info("tputrain: restored %s (step %d)", path, int(self.step.numpy()))
            return path
        return None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self) -> str:
        """Saves at the current step unless a checkpoint for it already exists."""
        step = int(self.step.numpy())
        latest = self.latest
        if latest and latest.endswith(f"-{step}"):
            return latest
        path = self.manager.save(checkpoint_number=step)
        logging.info("tputrain: saved checkpoint %s", path)
        return path
