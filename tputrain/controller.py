"""The Controller: the cadence of a run (train loops, evaluation, checkpoints, actions).

The Trainer knows how to run one compiled loop (`Trainer.run_loop`), evaluate
and save; the Controller decides when, and calls the actions after each loop,
evaluation and save. Read this file to change *when* things happen; read
trainer.py to change *how* a step runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import keras
import tensorflow as tf
from absl import logging

from tputrain.actions import Action, ProfilerAction
from tputrain.data import explain_parse_error
from tputrain.loop.host_loop import EXHAUSTED
from tputrain.preemption import Preempted
from tputrain.progress import Stopwatch
from tputrain.validate import input_data_error

if TYPE_CHECKING:  # annotations only: the Trainer imports this module
    from tputrain.trainer import Trainer



class Controller:
    """Runs `trainer` to a target step: loops, then actions, eval and saves when due."""

    def __init__(self, trainer: "Trainer", actions: Sequence[Action]):
        self.trainer = trainer
        self.actions = list(actions)
        self.until = trainer.train_steps

    def next_boundary(self, step: int) -> int:
        """Steps until the next loop end: steps_per_loop, eval, checkpoint or the end."""
        trainer = self.trainer
        limits = [trainer.steps_per_loop, self.until - step,
                  trainer.checkpoint_every - step % trainer.checkpoint_every]
        if trainer.eval_every:
            limits.append(trainer.eval_every - step % trainer.eval_every)
        if trainer.profile_steps:  # the trace covers exactly [start, stop)
            limits += [b - step for b in trainer.profile_steps if b > step]
        return max(1, min(limits))

    def _loop(self, step: int) -> tuple[dict[str, float], int, float, float] | None:
        """One compiled loop from `step`; None when the train input ended."""
        trainer = self.trainer
        with Stopwatch() as watch:
            try:
                logs, steps, input_wait = trainer.run_loop(self.next_boundary(step))
            except tf.errors.DataLossError as error:
                raise input_data_error(error, "train", f"after step {step}") from None
            except tf.errors.InvalidArgumentError as error:
                if EXHAUSTED not in str(error):  # a record unlike its feature spec?
                    raise explain_parse_error(error) from None
                logging.warning("tputrain: train input ended at step %d", step)
                return None
        return logs, steps, watch.seconds, input_wait

    def _after_loop(self, step: int, logs: dict[str, float], steps: int, seconds: float,
                    input_wait: float) -> None:
        trainer = self.trainer
        logs["learning_rate"] = float(keras.ops.convert_to_numpy(trainer.optimizer.learning_rate))
        nonfinite = int(trainer.guard.nonfinite_steps.numpy())
        if nonfinite:  # shown once any step was non-finite
            logs["nonfinite_steps"] = float(nonfinite)
        for action in self.actions:
            logs.update(action.loop_metrics(trainer, step, steps, seconds))
        logs.update(trainer.progress.train_loop_done(step, steps, seconds, logs, input_wait))
        for action in self.actions:
            action.on_loop_end(trainer, step, logs)

    def evaluate(self) -> dict[str, float]:
        trainer = self.trainer
        logs = trainer.evaluate_weights()
        for action in self.actions:
            action.on_eval_end(trainer, trainer.current_step, logs)
        return logs

    def save(self) -> str | None:
        trainer = self.trainer
        path = trainer.checkpointer.save()
        for action in self.actions:
            action.on_save(trainer, trainer.current_step, path)
        return path

    def _unrecorded(self, step: int) -> list[Action]:
        return [a for a in self.actions if not a.eval_recorded(self.trainer, step)]

    def _evaluate_unrecorded(self, step: int) -> dict[str, float] | None:
        """A resume at an eval step that some action has not recorded (a kill between the
        checkpoint and the record): evaluates it again for those actions only, so the
        best checkpoint and the early-stopping record are the uninterrupted run's."""
        trainer = self.trainer
        if not (step and trainer.eval_every and step % trainer.eval_every == 0):
            return None
        missing = self._unrecorded(step)
        if not missing:
            return None
        logging.info("tputrain: the evaluation at step %d is not recorded by %s: evaluating "
                     "it again", step, ", ".join(type(a).__name__ for a in missing))
        logs = trainer.evaluate_weights()
        for action in missing:
            action.on_eval_end(trainer, step, logs)
        return logs

    def complete(self, step: int) -> dict[str, float]:
        """A rerun of a run that reached its last step: only what a kill (or a full disk)
        cut short of its end, i.e. the final evaluation where an action did not record it
        and end-of-run outputs (the export) that are not on disk; returns the evaluation."""
        trainer = self.trainer
        logs = trainer.evaluate_weights()
        missing = self._unrecorded(step)
        for action in missing:
            action.on_eval_end(trainer, step, logs)
        unfinished = [a for a in self.actions if not a.end_done(trainer, step)]
        if missing or unfinished:
            logging.info("tputrain: completing the end of the run at step %d: %s", step,
                         ", ".join(type(a).__name__ for a in dict.fromkeys(missing + unfinished)))
        for action in unfinished:
            action.on_train_end(trainer, step, logs)
        return logs

    def run(self, until: int) -> dict[str, float]:
        """Trains from the current step to `until`; returns the final evaluation."""
        trainer = self.trainer
        step = trainer.current_step
        self.until = until
        # The progress line counts to the job's end: train_steps, or further when
        # train(num_steps) goes past it.
        trainer.progress.train_steps = max(until, trainer.train_steps)
        eval_logs: dict[str, float] = {}
        evaluated_at = None
        # An action sets this to end training early, e.g. tputrain.EarlyStopping; the
        # built-in PreemptionAction also sets stop_reason = "preempted".
        trainer.stop_training, trainer.stop_reason = False, None
        profilers = [a for a in self.actions if isinstance(a, ProfilerAction)]
        for action in self.actions:
            action.on_train_begin(trainer, step)
        recovered = self._evaluate_unrecorded(step)
        if recovered is not None:
            eval_logs, evaluated_at = recovered, step
        try:
            while step < until and not trainer.stop_training:
                for profiler in profilers:
                    profiler.update(step)
                result = self._loop(step)
                if result is None:
                    break
                step = trainer.current_step
                self._after_loop(step, *result)
                if trainer.stop_reason == "preempted":
                    break  # save now: a preempted machine has seconds, not an eval
                if trainer.eval_every and step % trainer.eval_every == 0 and step < until:
                    eval_logs, evaluated_at = self.evaluate(), step
                if trainer.checkpointer.due(step):
                    self.save()
            path = self.save()  # every action sees it (goodput counts it)
            if trainer.stop_reason == "preempted":
                raise _preempted(step, path)
            if not (trainer.stop_training and evaluated_at == step):  # stopped after an eval
                eval_logs = self.evaluate()
        finally:
            for profiler in profilers:
                profiler.close()
        for action in self.actions:
            action.on_train_end(trainer, step, eval_logs)
        return eval_logs


def _preempted(step: int, path: str | None) -> Preempted:
    """The exit (code 42) after a preemption's checkpoint, logged."""
    preempted = Preempted(step, path)
    logging.warning("tputrain: %s", preempted)
    return preempted
