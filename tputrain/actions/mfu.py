"""`MFUAction`: training FLOPs a step and the device peak, for the MFU in the progress line."""

from __future__ import annotations

from typing import Mapping

from absl import logging

from tputrain.observe import goodput
from tputrain.core import tracing
from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext
from tputrain.observe.flops import (MEASURED_CPU, count_flops, peak_flops, peak_kind, raise_cpu_peak,
                            specs_of)
from tputrain.loop.remat import remat_disabled


class MFUAction(Action):
    """Counts training FLOPs per step and finds the device peak once; the progress
    line then shows MFU each loop (`Trainer.report_mfu`).

    The count traces the step once more, so it is deferred off the path to the first
    trained step: it runs after the first loop (its line shows no MFU, its rate being
    mostly tracing), or before the loop is built where the plan of steps per XLA
    program reads the ideal step time (`Progress.ideal_step_seconds`).
    """

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        self._not_reported = None
        if context.flops_per_step is None:
            context.progress.count_flops_later(lambda: self._count(context))

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        context.progress.count_pending_flops()
        if self._not_reported:  # told once a loop trained: an error that is the step's
            # own (a user's bug, counted before the loop) is raised by the step, alone
            logging.warning("tputrain: MFU is not reported: %s", self._not_reported)
            self._not_reported = None

    def _count(self, context: ActionContext) -> None:
        if context.flops_per_step is not None:
            return
        try:
            with goodput.timed(context, "actions"):  # set-up, not the loop's host work
                context.flops_per_step = count_flops_per_step(context)
                peak = peak_flops(context.plan.precision, context.strategy,
                                  **vars(context.options.profiling))
        except Exception as error:  # pylint: disable=broad-except  (a diagnostic, not training)
            self._not_reported = f"{type(error).__name__}: {error}"
            context.report_mfu = False
            return
        # A probe, not a table's figure; one host's (the FLOPs are every host's).
        measured = peak.source.startswith(MEASURED_CPU) and context.num_hosts == 1
        context.progress.set_flops(
            context.flops_per_step, peak.flops_per_second,
            raise_peak=(lambda rate: raise_cpu_peak(peak_kind(context.plan.precision), rate))
            if measured else None)
        logging.info("tputrain: %.4g FLOPs per step; peak %.4g FLOP/s (%s)",
                     context.flops_per_step, peak.flops_per_second, peak.source)


def count_flops_per_step(context: ActionContext) -> float:
    """Training FLOPs of one step over all replicas (see `tputrain.observe.flops`)."""
    task = context.task
    analytic = task.flops_per_example()
    if analytic is not None:
        return float(analytic) * context.plan.batch.global_batch_size
    if context.plan.custom_train_step:
        raise ValueError(f"{type(task).__name__} overrides Task.train_step: return an "
                         "analytic count from Task.flops_per_example()")
    with remat_disabled(context.model):  # model FLOPs: not `Trainer.remat`'s recomputation
        per_micro_batch = count_flops(
            tracing.step_code(lambda batch: tracing.user_call(
                task.compute_gradients, batch, context.model, context.optimizer,
                context.plan.batch.global_batch_size)),
            specs_of(context.inputs.micro_batch_spec()))
    return float(per_micro_batch * context.plan.batch.accumulation_steps
                 * context.strategy.num_replicas_in_sync)
