"""Actions: user code the Trainer calls at fixed points of a run.

Subclass `Action` and override what you need (as with Keras callbacks, Orbit
actions or Lightning callbacks), then pass instances to `Trainer(actions=[...])`.
The built-in profiler and non-finite policy are actions too, so a user action
sees the same points they do. Hooks run on every host, in the host process,
between compiled loops: keep them short, or do the work every Nth call.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import tensorflow as tf
from absl import logging

from tputrain.distribution.communication import (CommunicationOptions, collective_share, gradient_bytes,
                                    measure_allreduce)
from tputrain.context import ActionContext
from tputrain.flops import count_flops, peak_flops, specs_of
from tputrain.guard import NonFiniteError
from tputrain.task import overrides_train_step


class Action:
    """Base class: every hook is a no-op. `logs` are plain floats.

    Each hook gets the run's `ActionContext` first (tputrain/context.py): the step,
    strategy, model, optimizer, checkpointer, progress and plan, `agree` across
    hosts and `stop(reason)`. Reading other Trainer attributes through it still
    works, with a DeprecationWarning.

    `owns_learning_rate`: True when the action sets the optimizer's learning rate
    (e.g. Keras's ReduceLROnPlateau through `KerasCallbacks`): a resume then takes it
    from the checkpoint instead of putting the config's value back.
    """

    owns_learning_rate = False

    def preflight(self, context: ActionContext) -> None:
        """On the chief, once the model is built and before anything is written to
        model_dir: raise ValueError/OSError naming the fix for a configuration that
        cannot work, so it fails in one line instead of after the lock and logs."""

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        """Once per `train()`, after the restore, before the first loop."""

    def loop_metrics(self, context: ActionContext, step: int, steps: int,
                     seconds: float) -> Mapping[str, float]:
        """Before the progress line of each loop (`steps` steps in `seconds`): scalars
        to add to the loop's logs, its progress line and TensorBoard (e.g. comm/*)."""
        return {}

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        """After each compiled loop of training steps; `logs` are the loop's means,
        learning rate and throughput (steps_per_second, examples_per_second, ...)."""

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        """After each evaluation, with its metrics."""

    def on_save(self, context: ActionContext, step: int, path: str | None) -> None:
        """After a checkpoint save was requested (`path` None when nothing was written)."""

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        """Once, when `train()` returns normally, with the final evaluation's metrics."""

    def eval_recorded(self, context: ActionContext, step: int) -> bool:
        """Whether this action's record on disk holds the evaluation at `step`. A resume
        at a step whose evaluation some action did not record (killed in between)
        evaluates it again and calls only those actions' `on_eval_end`."""
        return True

    def end_done(self, context: ActionContext, step: int) -> bool:
        """Whether this action's end-of-run output for a run that ended at `step` is on
        disk. A rerun of a finished run calls `on_train_end` only where it is not."""
        return True


def check_actions(actions: Sequence[Action]) -> list[Action]:
    """The actions as a list; anything that is not an `Action` is named."""
    actions = list(actions)
    if not all(isinstance(a, Action) for a in actions):
        raise TypeError("Trainer.actions must be tputrain.Action instances, got "
                        f"{[type(a).__name__ for a in actions]}")
    return actions


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


class NonFinitePolicyAction(Action):
    """Applies `NonFiniteGuard.policy` after a loop in which the guard tripped:
    raise, or roll the weights back to the last checkpoint."""

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        guard = context.guard
        tripped = guard.take_trip()
        if not tripped:
            return
        if guard.policy == "raise":
            raise NonFiniteError(guard.message(tripped))
        guard.rollbacks += 1
        if guard.rollbacks > guard.max_rollbacks:
            raise NonFiniteError(guard.message(tripped, gave_up=True))
        path = context.checkpointer.restore_weights(
            exclude=("iterator", "step", "nonfinite_steps"))
        if path is None:
            raise NonFiniteError(guard.message(tripped, no_checkpoint=True))
        logging.warning("tputrain: non-finite step %d: rolled the weights back to %s "
                        "(rollback %d of %d); the data continues from step %d", tripped,
                        path, guard.rollbacks, guard.max_rollbacks, step)


class PreemptionAction(Action):
    """After a loop in which any host got SIGTERM: stop there. The Controller then saves
    (every action's `on_save` sees it) and raises `Preempted` (exit code 42)."""

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if context.preempted():
            context.stop("preempted")


class MFUAction(Action):
    """Counts training FLOPs per step and finds the device peak once, at the start;
    the progress line then shows MFU each loop (`Trainer.report_mfu`)."""

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        if context.flops_per_step is not None:
            return
        try:
            context.flops_per_step = count_flops_per_step(context)
            peak = peak_flops(context.plan.precision, context.strategy,
                              **vars(context.options.profiling))
        except Exception as error:  # pylint: disable=broad-except  (a diagnostic, not training)
            logging.warning("tputrain: MFU is not reported: %s: %s", type(error).__name__, error)
            context.report_mfu = False
            return
        context.progress.set_flops(context.flops_per_step, peak.flops_per_second)
        logging.info("tputrain: %.4g FLOPs per step; peak %.4g FLOP/s (%s)",
                     context.flops_per_step, peak.flops_per_second, peak.source)


def count_flops_per_step(context: ActionContext) -> float:
    """Training FLOPs of one step over all replicas (see `tputrain.flops`)."""
    task = context.task
    analytic = task.flops_per_example()
    if analytic is not None:
        return float(analytic) * context.plan.batch.global_batch_size
    if overrides_train_step(task):
        raise ValueError(f"{type(task).__name__} overrides Task.train_step: return an "
                         "analytic count from Task.flops_per_example()")
    per_micro_batch = count_flops(
        lambda batch: task.compute_gradients(batch, context.model, context.optimizer,
                                             context.plan.batch.global_batch_size),
        specs_of(context.inputs.micro_batch_spec()))
    return float(per_micro_batch * context.plan.batch.accumulation_steps
                 * context.strategy.num_replicas_in_sync)


class CommunicationAction(Action):
    """Times one all-reduce of the gradients at the start of train() (several replicas
    only); adds comm/* to each loop (tputrain/distribution/communication.py says how and how well)."""

    def __init__(self, options: CommunicationOptions, seconds: float = 0.25):
        self.options = options
        self.seconds = seconds  # measurement budget: about 1.5x this at start-up
        self.bytes = 0
        self.seconds_per_allreduce = 0.0

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        replicas = context.strategy.num_replicas_in_sync
        variables = context.model.trainable_variables
        self.bytes = gradient_bytes(variables, self.options.allreduce_dtype, replicas)
        if replicas > 1:  # a collective: every host measures, with agreed loop lengths
            self.seconds_per_allreduce = measure_allreduce(
                context.strategy, variables, self.options.allreduce_dtype, self.seconds,
                agree=context.agree)

    def loop_metrics(self, context: ActionContext, step: int, steps: int,
                     seconds: float) -> Mapping[str, float]:
        fraction = min(1.0, steps * self.seconds_per_allreduce / max(seconds, 1e-9))
        return {"comm/gradient_bytes": float(self.bytes), "comm/allreduce_fraction": fraction}
