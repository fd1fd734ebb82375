"""`ProfilerAction`: a profiler trace of `Trainer.profile_steps`.

A trace is a diagnostic, as the TensorBoard summaries are
(`tputrain.observe.summary_space`): one that finds the disk full is dropped with a
warning, its half-written run folder removed, and training goes on; the next
checkpoint save stops the run in one line if the disk is still full.
"""

from __future__ import annotations

import os
from typing import Mapping

import tensorflow as tf
from absl import logging

from tputrain.actions.base import Action
from tputrain.checkpointing.files import first_line, is_disk_full
from tputrain.runtime.context import ActionContext
from tputrain.distribution.communication import collective_share


class ProfilerAction(Action):
    """Captures a TensorBoard profiler trace of steps [start, stop) (chief only).
    The Controller also calls `update` before each loop, so the trace starts on time."""

    def __init__(self, start: int, stop: int, logdir: str):
        self.start, self.stop, self.logdir = start, stop, logdir
        self.running = False
        self._runs_before: list[str] = []

    @property
    def profile_dir(self) -> str:
        return os.path.join(self.logdir, "plugins", "profile")

    def update(self, step: int) -> bool:
        """Starts at `start`, stops at `stop`: called before and after each loop.
        True when this call wrote the trace."""
        if not self.running and self.start <= step < self.stop:
            self._runs_before = self._runs()
            tf.profiler.experimental.start(self.logdir)
            self.running = True
        elif self.running and step >= self.stop:
            if self.close():
                logging.info("tputrain: profile of steps %d-%d written to %s", self.start,
                             self.stop, self.profile_dir)
                return True
        return False

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self.update(step) and context.strategy.num_replicas_in_sync > 1:
            self.cross_check(logs.get("comm/allreduce_fraction"))

    def cross_check(self, estimate: float | None) -> float | None:
        """Logs the profile's collective share beside comm/allreduce_fraction's estimate."""
        share = collective_share(self.profile_dir)
        if share is not None:
            logging.info("tputrain: profile: collective ops in flight %.1f%% of the traced time "
                         "(comm/allreduce_fraction estimates %s; the profile's share also counts "
                         "waiting for the slowest replica and overlap with compute)", 100 * share,
                         "n/a" if estimate is None else f"{100 * estimate:.1f}%")
        return share

    def close(self) -> bool:
        """Stops a running trace and writes it: False if none ran or the disk was full."""
        if not self.running:
            return False
        self.running = False
        try:
            tf.profiler.experimental.stop()
        except (tf.errors.OpError, OSError) as error:
            if not is_disk_full(error):
                raise
            self._remove_partial_runs()
            logging.warning(
                "tputrain: the profile of steps %d-%d is not written: no space left on %s (%s); "
                "training goes on and the next checkpoint save stops the run in one line if "
                "the disk is still full", self.start, self.stop, self.logdir, first_line(error))
            return False
        return True

    def _runs(self) -> list[str]:
        """The trace folders (one a trace) under the profile directory."""
        if not tf.io.gfile.isdir(self.profile_dir):
            return []
        return tf.io.gfile.listdir(self.profile_dir)

    def _remove_partial_runs(self) -> None:
        """Removes the folders this trace began: TensorBoard would show a cut trace."""
        for run in set(self._runs()) - set(self._runs_before):
            try:
                tf.io.gfile.rmtree(os.path.join(self.profile_dir, run))
            except (tf.errors.OpError, OSError):  # best effort: the warning says what happened
                pass
