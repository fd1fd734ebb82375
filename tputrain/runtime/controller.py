"""The Controller: the cadence of a run (train loops, evaluation, checkpoints, actions).

The Trainer knows how to run one compiled loop (`Trainer.run_loop`), evaluate
and save; the Controller decides when, and calls the actions after each loop,
evaluation and save. Read this file to change *when* things happen; read
trainer.py to change *how* a step runs.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import tensorflow as tf
from absl import logging

from tputrain.loop import compile_cache
from tputrain.runtime import process_exit
from tputrain.actions import Action, ProfilerAction
from tputrain.runtime.context import ActionContext, ActionList, learning_rate
from tputrain.data import explain_parse_error
from tputrain.loop.host_loop import EXHAUSTED
from tputrain.runtime.model_state import check_trainable_unchanged
from tputrain.fault_tolerance.preemption import Preempted
from tputrain.observe.progress import Stopwatch
from tputrain.runtime.validate import input_data_error


class Run(Protocol):
    """What the Controller drives (the Trainer is one): the cadence knobs, one compiled
    loop, one evaluation, and the context its actions see."""

    train_steps: int
    steps_per_loop: int
    checkpoint_every: int
    eval_every: int | None
    profile_steps: tuple[int, int] | None
    context: ActionContext

    def run_loop(self, num_steps: int) -> tuple[dict[str, float], int, float]: ...

    def evaluate_weights(self) -> dict[str, float]: ...


class Controller:
    """Runs `trainer` to a target step: loops, then actions, eval and saves when due."""

    def __init__(self, trainer: Run, actions: Sequence[Action]):
        self.trainer = trainer
        self.actions = list(actions)
        self.until = trainer.train_steps
        process_exit.track(trainer)  # its iterators are not freed at exit (a wait on tf.data)

    @property
    def hooks(self) -> ActionList:
        """Every action's hooks, called in order with the run's context."""
        return ActionList(self.trainer.context, self.actions)

    @property
    def context(self) -> ActionContext:
        return self.trainer.context

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
        with Stopwatch() as watch, compile_cache.reading(trainer, "train"):
            try:
                logs, steps, input_wait = trainer.run_loop(self.next_boundary(step))
            except tf.errors.DataLossError as error:  # the compile cache's, or the data's
                raise (compile_cache.read_error(error)
                       or input_data_error(error, "train", f"after step {step}")) from None
            except tf.errors.InvalidArgumentError as error:
                if EXHAUSTED not in str(error):  # a record unlike its feature spec?
                    raise (compile_cache.read_error(error) or explain_parse_error(error)) from None
                logging.warning("tputrain: the train input ended at step %d of %d: the run "
                                "stops there (to train every step, `repeat()` the train "
                                "split, or lower Trainer.train_steps)", step,
                                self.until)
                return None
        return logs, steps, watch.seconds, input_wait

    def _after_loop(self, step: int, logs: dict[str, float], steps: int, seconds: float,
                    input_wait: float) -> None:
        context, hooks = self.context, self.hooks
        logs["learning_rate"] = learning_rate(context.optimizer)
        nonfinite = int(context.guard.nonfinite_steps.numpy())
        if nonfinite:  # shown once any step was non-finite
            logs["nonfinite_steps"] = float(nonfinite)
        logs.update(hooks.collect(step, steps, seconds))
        logs.update(context.progress.train_loop_done(step, steps, seconds, logs, input_wait))
        hooks.call("on_loop_end", step, logs)

    def evaluate(self) -> dict[str, float]:
        logs = self.trainer.evaluate_weights()
        self.hooks.call("on_eval_end", self.context.step, logs)
        return logs

    def save(self) -> str | None:
        path = self.context.checkpointer.save()
        self.hooks.call("on_save", self.context.step, path)
        return path

    def _unrecorded(self, step: int) -> list[Action]:
        return self.hooks.where_not("eval_recorded", step)

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
        self.hooks.call("on_eval_end", step, logs, only=missing)
        return logs

    def complete(self, step: int) -> dict[str, float]:
        """A rerun of a run that reached its last step: only what a kill (or a full disk)
        cut short of its end, i.e. the final evaluation where an action did not record it
        and end-of-run outputs (the export) that are not on disk; returns the evaluation."""
        hooks = self.hooks
        logs = self.trainer.evaluate_weights()
        missing = self._unrecorded(step)
        hooks.call("on_eval_end", step, logs, only=missing)
        unfinished = hooks.where_not("end_done", step)
        if missing or unfinished:
            logging.info("tputrain: completing the end of the run at step %d: %s", step,
                         ", ".join(type(a).__name__ for a in dict.fromkeys(missing + unfinished)))
        hooks.call("on_train_end", step, logs, only=unfinished)
        return logs

    def run(self, until: int) -> dict[str, float]:
        """Trains from the current step to `until`; returns the final evaluation. An
        exception (a preemption's included) reaches every action's `on_train_error` first."""
        try:
            return self._run(until)
        except BaseException as error:
            self.hooks.call("on_train_error", self.context.step, error)
            raise

    def _run(self, until: int) -> dict[str, float]:
        context, hooks = self.context, self.hooks
        step = context.step
        self.until = until
        # The progress line counts to the job's end: train_steps, or further when
        # train(num_steps) goes past it.
        context.progress.train_steps = max(until, self.trainer.train_steps)
        eval_logs: dict[str, float] = {}
        evaluated_at = None
        # An action calls context.stop(reason) to end training early, e.g.
        # tputrain.EarlyStopping; the built-in PreemptionAction stops with "preempted".
        context.reset_stop()
        profilers = [a for a in self.actions if isinstance(a, ProfilerAction)]
        hooks.call("on_train_begin", step)
        recovered = self._evaluate_unrecorded(step)
        if recovered is not None:
            eval_logs, evaluated_at = recovered, step
        try:
            while step < until and not context.stop_training:
                for profiler in profilers:
                    profiler.update(step)
                check_trainable_unchanged(context.model)  # an action's enable_lora: refused
                result = self._loop(step)
                if result is None:
                    break
                step = context.step
                self._after_loop(step, *result)
                if context.stop_reason == "preempted":
                    break  # save now: a preempted machine has seconds, not an eval
                eval_every = self.trainer.eval_every
                if eval_every and step % eval_every == 0 and step < until:
                    eval_logs, evaluated_at = self.evaluate(), step
                if context.checkpointer.due(step):
                    self.save()
            path = self.save()  # every action sees it (goodput counts it)
            if context.stop_reason == "preempted":
                raise _preempted(step, path)
            if not (context.stop_training and evaluated_at == step):  # stopped after an eval
                eval_logs = self.evaluate()
        finally:
            for profiler in profilers:
                profiler.close()
        hooks.call("on_train_end", step, eval_logs)
        return eval_logs


def _preempted(step: int, path: str | None) -> Preempted:
    """The exit (code 42) after a preemption's checkpoint, logged."""
    preempted = Preempted(step, path)
    logging.warning("tputrain: %s", preempted)
    return preempted
