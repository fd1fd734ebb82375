"""`ProfilerAction`: a profiler trace of `Trainer.profile_steps`."""

from __future__ import annotations

import os
from typing import Mapping

import tensorflow as tf
from absl import logging

from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext
from tputrain.distribution.communication import collective_share


class ProfilerAction(Action):
    """Captures a TensorBoard profiler trace of steps [start, stop) (chief only).
    The Controller also calls `update` before each loop, so the trace starts on time."""

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

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        was_running = self.running
        self.update(step)
        if was_running and not self.running and context.strategy.num_replicas_in_sync > 1:
            self.cross_check(logs.get("comm/allreduce_fraction"))

    def cross_check(self, estimate: float | None) -> float | None:
        """Logs the profile's collective share beside comm/allreduce_fraction's estimate."""
        share = collective_share(os.path.join(self.logdir, "plugins", "profile"))
        if share is not None:
            logging.info("tputrain: profile: collective ops in flight %.1f%% of the traced time "
                         "(comm/allreduce_fraction estimates %s; the profile's share also counts "
                         "waiting for the slowest replica and overlap with compute)", 100 * share,
                         "n/a" if estimate is None else f"{100 * estimate:.1f}%")
        return share

    def close(self) -> None:
        if self.running:
            tf.profiler.experimental.stop()
            self.running = False
