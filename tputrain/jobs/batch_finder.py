"""The batch-size finder: the largest per-replica batch that fits and still pays.

Batch size is the first factor of accelerator efficiency: start from the
largest batch that fits and scale the learning rate to it. `find_batch` tries
per-replica batches upward for a Task and strategy, doubling from the start
batch, then bisecting between the last that fit and the first that ran out of
memory, to `resolution`. Each is a Trainer of its own in a temporary directory
(nothing is written to the run's model_dir), so what is compiled and timed is
the run's very train loop (`Trainer.run_loop`) on the Task's own train input,
with `accumulation_steps=1`: memory is what is measured, and accumulation is
the way past it. One step a launch (`steps_per_program=1`) unless the options
say otherwise: "auto" would compile a second, many-step program per batch.

The climb ends at an out of memory (at compile or at run:
`tf.errors.ResourceExhaustedError`, or XLA's "ran out of memory" in another
error), at `max_batch`, or when a doubling buys less than `min_gain` more
examples/s. Another error at a larger batch than the first (e.g. more
examples than the data holds) ends it too, named, without bisecting toward it.
`tputrain find-batch` runs it on a gin config; `batch_report`
formats the table and the suggested gin params.
"""

from __future__ import annotations

import math
import numbers
import re
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.actions import count_flops_per_step
from tputrain.jobs.batch_report import FindBatchResult, Trial
from tputrain.core.builders import configured
from tputrain.distribution.strategy import resolve_strategy
from tputrain.observe.flops import model_flops_utilization, peak_flops
from tputrain.optim.schedules import WarmupDecay
from tputrain.runtime.context import ActionContext
from tputrain.runtime.run_view import RunView
from tputrain.task import Task
from tputrain.trainer import Trainer  # builds one Trainer per batch tried

__all__ = ["FindBatchResult", "Trial", "find_batch", "is_out_of_memory"]

_OUT_OF_MEMORY = re.compile(r"out of memory|resource_exhausted", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
    """A TensorFlow error that says the program or its buffers did not fit."""
    if isinstance(error, tf.errors.ResourceExhaustedError):
        return True
    return isinstance(error, tf.errors.OpError) and bool(_OUT_OF_MEMORY.search(str(error)))


def _failure(error: BaseException) -> str:
    """A trial's error in the table: "out of memory", or the first line of another
    (a larger batch can fail otherwise, e.g. more than the data holds)."""
    if is_out_of_memory(error):
        return "out of memory"
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"


def configured_learning_rate(task: Task) -> tuple[float | None, bool]:
    """(the peak rate of the task's optimizer, whether it is a constant float); None
    for a schedule other than `WarmupDecay`, whose peak cannot be read."""
    rate = getattr(task.build_optimizer(), "_learning_rate", None)
    if isinstance(rate, WarmupDecay):
        return rate.peak_learning_rate, False
    if rate is None or isinstance(rate, tf.keras.optimizers.schedules.LearningRateSchedule) \
            or callable(rate):
        return None, False
    return float(np.asarray(rate)), True


def _first_device(strategy: tf.distribute.Strategy) -> str:
    spec = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0])
    return f"{spec.device_type}:{spec.device_index or 0}"


def _peak_memory(device: str, reset: bool = False) -> int | None:
    """Peak bytes allocated on `device` since the last reset; None where the device
    does not report it (CPUs)."""
    try:
        if reset:
            tf.config.experimental.reset_memory_stats(device)
            return None
        return int(tf.config.experimental.get_memory_info(device)["peak"])
    except (ValueError, tf.errors.OpError):
        return None


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def examples_per_second(view: RunView, seconds: float) -> float:
    """The Trainer's compiled train loop, timed for about `seconds` after a compiling
    loop: examples per second (the loop length fits a quarter of `seconds`)."""
    if view.plan.input_mode == "distributed":
        view.set_train_iterator(view.inputs.distributed_iterator("train"))
    # Loops are multiples of a fetch (host mode) and of a program's steps: one trace.
    program = view.plan.steps_per_program if isinstance(view.plan.steps_per_program, int) else 1
    unit = math.lcm(int(view.plan.steps_per_fetch), program)
    view.run_loop(unit)  # traces and compiles: an out of memory shows here or next
    (_, done, _), elapsed = _timed(lambda: view.run_loop(unit))
    longest = max(unit, view.plan.options.steps_per_loop // unit * unit)
    steps = int(seconds / 4 / max(elapsed / max(done, 1), 1e-9)) // unit * unit
    steps = min(longest, max(unit, steps))
    total_steps, total_seconds, loops = 0, 0.0, 0
    while loops < 2 or total_seconds < seconds:
        (_, done, _), elapsed = _timed(lambda: view.run_loop(steps))
        total_steps, total_seconds, loops = total_steps + done, total_seconds + elapsed, loops + 1
    return total_steps * view.plan.batch.global_batch_size / total_seconds


class _Finder:
    """Builds, times and closes one Trainer per batch; climbs and bisects."""

    def __init__(self, task: Task, strategy: tf.distribute.Strategy, seconds: float,
                 trainer_class: Callable[..., Trainer], options: dict[str, Any]):
        self.task, self.strategy, self.seconds = task, strategy, seconds
        self.trainer_class, self.options = trainer_class, options
        self.replicas = strategy.num_replicas_in_sync
        self.device = _first_device(strategy)
        self.trials: list[Trial] = []
        self.train_steps: int | None = None
        self.peak: float | None = None  # FLOP/s, found once

    def _mfu(self, context: ActionContext, rate: float) -> float | None:
        """MFU at `rate` examples/s where tputrain.observe.flops can count the step."""
        if not context.report_mfu:
            return None
        try:
            if self.peak is None:
                self.peak = peak_flops(context.plan.precision, self.strategy,
                                       **vars(context.plan.options.profiling)).flops_per_second
            flops = count_flops_per_step(context)
        except Exception as error:  # pylint: disable=broad-except  (a diagnostic column)
            logging.warning("tputrain: no MFU: %s: %s", type(error).__name__, error)
            return None
        per_step = context.plan.batch.global_batch_size
        return model_flops_utilization(flops, rate / per_step, self.peak)

    def measure(self, batch: int) -> Trial:
        """One per-replica batch in a Trainer of its own, in a temporary model_dir."""
        global_batch = batch * self.replicas
        logging.info("tputrain: find-batch: per-replica batch %d", batch)
        work_dir = tempfile.mkdtemp(prefix="tputrain-find-batch-")
        _peak_memory(self.device, reset=True)
        try:
            options = {"steps_per_program": 1, **self.options,
                       "global_batch_size": global_batch, "accumulation_steps": 1}
            with self.trainer_class(self.task, model_dir=work_dir, strategy=self.strategy,
                                    **options) as trainer:
                self.train_steps = self.train_steps or trainer.train_steps
                rate = examples_per_second(trainer.view(), self.seconds)
                trial = Trial(batch, global_batch, rate, None, _peak_memory(self.device))
                trial.mfu = self._mfu(trainer.context, rate)
        except Exception as error:  # pylint: disable=broad-except  (sorted below)
            if not self.trials and not is_out_of_memory(error):
                raise  # the start batch: a config or data error, not a limit
            trial = Trial(batch, global_batch, None, None, None, error=_failure(error))
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
        self.trials.append(trial)
        return trial

    def climb(self, start: int, max_batch: int, min_gain: float | None) -> tuple[int | None, int | None, str]:
        """Doubles from `start`: (the last batch that fit, the first that did not, or
        None, and why the climb stopped)."""
        batch, last = min(start, max_batch), None
        while True:
            trial = self.measure(batch)
            if not trial.fits:
                return (last.per_replica_batch if last else None), batch, ""
            if last is not None and min_gain is not None and \
                    trial.examples_per_second < (1 + min_gain) * last.examples_per_second:
                gain = trial.examples_per_second / last.examples_per_second - 1
                return batch, None, (f"per-replica batch {batch} gained {100 * gain:+.1f}% "
                                     f"examples/s over {last.per_replica_batch}, less than "
                                     f"min_gain {100 * min_gain:g}%")
            if batch >= max_batch:
                return batch, None, f"reached max_batch {max_batch} (per replica)"
            last, batch = trial, min(2 * batch, max_batch)

    def bisect(self, fit: int | None, failed: int, resolution: int) -> str:
        """Narrows [last fit, first out of memory) to `resolution`; why it stopped.
        Another error (more examples than the data holds) is not bisected toward: a
        batch near the whole data set is no suggestion."""
        if fit is None:
            return f"{self.trials[0].error} at the start batch {failed} per replica"
        error = self.trials[-1].error
        if error != "out of memory":
            return (f"{error} at per-replica batch {failed} (largest that fit: {fit}; not "
                    "bisected: the limit is not memory)")
        while failed - fit > resolution:
            middle = fit + max(resolution, (failed - fit) // 2 // resolution * resolution)
            if middle >= failed:
                break
            if self.measure(middle).fits:
                fit = middle
            else:
                failed = middle
        error = next(t.error for t in self.trials if t.per_replica_batch == failed)
        return (f"{error} from per-replica batch {failed} (largest that fit: {fit}; "
                f"resolution {resolution})")


def _check(name: str, value: float | None, least: float) -> None:
    if value is not None and not value >= least:
        raise ValueError(f"find_batch: {name} must be >= {least:g}, got {value}")


def _check_gain(min_gain: Any) -> None:
    """A finite fraction >= 0 or None, quoted as given: every comparison with NaN is
    false, so `min_gain=nan` silently never stopped the climb."""
    if min_gain is None:
        return
    if isinstance(min_gain, bool) or not isinstance(min_gain, numbers.Real):
        raise TypeError(f"find_batch: min_gain must be a fraction such as 0.05 (5% more "
                        f"examples/s a doubling) or None, got {min_gain!r}")
    if not (math.isfinite(min_gain) and min_gain >= 0):
        raise ValueError(f"find_batch: min_gain must be a finite fraction >= 0 such as 0.05 "
                         f"(None: never stop for it), got {min_gain!r}")


def find_batch(task: Task, strategy: tf.distribute.Strategy | None = None, *,
               global_batch_size: int = 64, learning_rate: float | None = None,
               start_batch: int | None = None, max_batch: int = 4096,
               min_gain: float | None = 0.05, resolution: int = 8, seconds: float = 2.0,
               trainer_class: Callable[..., Trainer] = Trainer,
               **trainer_options: Any) -> FindBatchResult:
    """Finds the per-replica batch to train `task` with on `strategy`.

    Args:
      task: the Task; its own train input feeds the timed loops.
      strategy: None resolves one (`tputrain.resolve_strategy`).
      global_batch_size: the configured global batch: the start (divided by the
        replicas) unless `start_batch`, and the reference of the learning rate.
      learning_rate: the rate that works at `global_batch_size`; None reads the
        task's optimizer (a float, or a `WarmupDecay`'s peak).
      start_batch: the first per-replica batch tried.
      max_batch: the largest per-replica batch tried.
      min_gain: stop when a doubling buys less than this fraction more
        examples/s; None never stops for it.
      resolution: bisection stops when the first failure is this close
        (per replica) above the last batch that fit; its midpoints are
        multiples of it above that batch.
      seconds: timed seconds per batch, after the compiling loop.
      trainer_class: what builds each Trainer (the CLI's is gin-configured).
      **trainer_options: other `Trainer` keywords (steps_per_loop, precision...).
    """
    _check("start_batch", start_batch, 1)
    _check("max_batch", max_batch, 1)
    _check("resolution", resolution, 1)
    _check("seconds", seconds, 1e-9)
    _check_gain(min_gain)
    strategy = strategy or configured("resolve_strategy", resolve_strategy)()
    replicas = strategy.num_replicas_in_sync
    constant = True
    if learning_rate is None:
        learning_rate, constant = configured_learning_rate(task)
    finder = _Finder(task, strategy, seconds, trainer_class, trainer_options)
    start = start_batch or max(1, global_batch_size // replicas)
    fit, failed, reason = finder.climb(start, max_batch, min_gain)
    if failed is not None:
        reason = finder.bisect(fit, failed, resolution)
    return FindBatchResult(
        trials=finder.trials, stop_reason=reason, replicas=replicas,
        global_batch_size=global_batch_size, learning_rate=learning_rate,
        train_steps=finder.train_steps or 1, min_gain=min_gain, constant_rate=constant,
        input_note="the task's own train input through the Trainer's compiled train loop, "
                   f"accumulation_steps=1, steps_per_program="
                   f"{trainer_options.get('steps_per_program', 1)}")
