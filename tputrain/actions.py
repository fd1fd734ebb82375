"""Actions: user code the Trainer calls at fixed points of a run.

Subclass `Action` and override what you need (as with Keras callbacks, Orbit
actions or Lightning callbacks), then pass instances to `Trainer(actions=[...])`.
The built-in profiler and non-finite policy are actions too, so a user action
sees the same points they do. Hooks run on every host, in the host process,
between compiled loops: keep them short, or do the work every Nth call.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping

import tensorflow as tf
from absl import logging

if TYPE_CHECKING:  # annotations only: the Trainer imports this module
    from tputrain.trainer import Trainer


class Action:
    """Base class: every hook is a no-op. `logs` are plain floats."""

    def on_loop_end(self, trainer: "Trainer", step: int, logs: Mapping[str, float]) -> None:
        """After each compiled loop of training steps; `logs` are the loop's means,
        learning rate and throughput (steps_per_second, examples_per_second, ...)."""

    def on_eval_end(self, trainer: "Trainer", step: int, logs: Mapping[str, float]) -> None:
        """After each evaluation, with its metrics."""

    def on_save(self, trainer: "Trainer", step: int, path: str | None) -> None:
        """After a checkpoint save was requested (`path` None when nothing was written)."""

    def on_train_end(self, trainer: "Trainer", step: int, logs: Mapping[str, float]) -> None:
        """Once, when `train()` returns normally, with the final evaluation's metrics."""


class ProfilerAction(Action):
    """Captures a TensorBoard profiler trace of steps [start, stop) (chief only)."""

    def __init__(self, start: int, stop: int, logdir: str):
        self.start, self.stop, self.logdir = start, stop, logdir
        self.running = False

    def update(self, step: int) -> None:
        """Starts at `start`, stops at `stop`: called before and after each loop."""
        if not self.running and self.start <= step < self.stop:
            tf.profiler.experimental.start(self.logdir)
            self.running = True
        elif self.running and step >= self.stop:
            self.close()
            logging.info("tputrain: profile of steps %d-%d written to %s", self.start, self.stop,
                         os.path.join(self.logdir, "plugins", "profile"))

    def on_loop_end(self, trainer: "Trainer", step: int, logs: Mapping[str, float]) -> None:
        self.update(step)

    def close(self) -> None:
        if self.running:
            tf.profiler.experimental.stop()
            self.running = False


class NonFinitePolicyAction(Action):
    """Applies `NonFiniteGuard.policy` after a loop in which the guard tripped:
    raise, or roll the weights back to the last checkpoint."""

    def on_loop_end(self, trainer: "Trainer", step: int, logs: Mapping[str, float]) -> None:
        trainer.apply_nonfinite_policy(step)


class PreemptionAction(Action):
    """After a loop in which any host got SIGTERM: save and raise `Preempted`."""

    def on_loop_end(self, trainer: "Trainer", step: int, logs: Mapping[str, float]) -> None:
        trainer.stop_if_preempted(step)
