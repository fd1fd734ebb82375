"""What `tputrain.find_batch` measured, and the gin params it suggests from it.

A `FindBatchResult` holds one `Trial` per per-replica batch tried, in the order
tried. The suggested batch is the largest that fit, unless a doubling bought
less than `min_gain` more examples/s: then the one before it (a larger batch
that is not faster only makes the optimisation harder). The learning rate is
scaled from the configured (global batch, rate) by `lr_rule`
(`tputrain.scale_learning_rate`), with a linear warmup over `WARMUP_FRACTION`
of the rescaled steps: a starting point to check against the loss curve, not a
guarantee of the same convergence.
"""

from __future__ import annotations

import dataclasses
import math

from tputrain.optim.schedules import scale_learning_rate

WARMUP_FRACTION = 0.05  # of the train steps, when the batch grows (Goyal et al. use ~5%)


@dataclasses.dataclass
class Trial:
    """One per-replica batch: its throughput, or why it did not run (`error`)."""

    per_replica_batch: int
    global_batch: int
    examples_per_second: float | None
    mfu: float | None  # model FLOPs utilization in [0, 1]; None where not computable
    memory_bytes: int | None  # peak device memory of the first replica, where reported
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.error is None

    def row(self) -> str:
        """One line of the table."""
        head = f"{self.per_replica_batch:>11}  {self.global_batch:>8}"
        if not self.fits:
            return f"{head}  {self.error[:64]}"  # in full in the stop reason
        mfu = "-" if self.mfu is None else f"{100 * self.mfu:.1f}%"
        memory = "-" if self.memory_bytes is None else f"{self.memory_bytes / 2**30:.2f} GiB"
        return f"{head}  {self.examples_per_second:>12,.0f}  {mfu:>7}  {memory:>10}"


HEADER = f"{'per-replica':>11}  {'global':>8}  {'examples/s':>12}  {'MFU':>7}  {'memory':>10}"


@dataclasses.dataclass
class FindBatchResult:
    """The trials, why the climb stopped, and the configuration the suggestion scales.

    `global_batch_size`, `learning_rate` and `train_steps` are the configured
    ones (`learning_rate` None when the optimizer's rate is a schedule other
    than `WarmupDecay`); `constant_rate` says the configured rate was a float.
    """

    trials: list[Trial]
    stop_reason: str
    replicas: int
    global_batch_size: int
    learning_rate: float | None
    train_steps: int
    min_gain: float | None
    constant_rate: bool = True
    input_note: str = ""

    @property
    def suggested(self) -> Trial | None:
        """The largest batch that fit, unless a doubling gained less than `min_gain`."""
        best = None
        for trial in self.trials:
            if not trial.fits:
                break  # any later trials bisect below the failure: the largest that fit
            if (best is not None and self.min_gain is not None
                    and trial.examples_per_second < (1 + self.min_gain) * best.examples_per_second):
                return best
            best = trial
        return max((t for t in self.trials if t.fits), key=lambda t: t.per_replica_batch,
                   default=None)

    def learning_rate_for(self, rule: str) -> float | None:
        """The configured rate scaled to the suggested global batch by `rule`."""
        suggested = self.suggested
        rate = scale_learning_rate(self.learning_rate or 1.0, suggested.global_batch
                                   if suggested else 1, self.global_batch_size, rule=rule)
        return rate if self.learning_rate is not None and suggested else None

    def suggestion(self, rule: str) -> list[str]:
        """Gin params for the suggested batch (one a line), or why there is none."""
        trial, rate = self.suggested, self.learning_rate_for(rule)
        if trial is None:
            return ["no batch fit: lower --start_batch, or keep the batch and add "
                    "Trainer.accumulation_steps"]
        steps = max(1, round(self.train_steps * self.global_batch_size / trial.global_batch))
        lines = [f"Trainer.global_batch_size = {trial.global_batch}",
                 f"Trainer.train_steps = {steps}"]
        if rate is None:
            factor = scale_learning_rate(1.0, trial.global_batch, self.global_batch_size, rule)
            return lines + [f"scale your learning rate by {factor:.4g} ({rule} rule)"]
        warmup = math.ceil(WARMUP_FRACTION * steps) if trial.global_batch > self.global_batch_size else 0
        if warmup == 0 and self.constant_rate:  # a constant rate: the schedule would restate it
            return lines + ([] if rate == self.learning_rate
                            else [f"build_optimizer.learning_rate = {rate:.6g}"])
        lines += ["build_optimizer.learning_rate = @warmup_schedule()",
                  f"warmup_schedule.learning_rate = {rate:.6g}",
                  f"warmup_schedule.total_steps = {steps}",
                  f"warmup_schedule.warmup_steps = {warmup}"]
        return lines + (["warmup_schedule.decay = 'constant'"] if self.constant_rate else [])

    def report(self, rule: str) -> str:
        """The table, why the climb stopped, and the suggestion."""
        lines = [HEADER] + [trial.row() for trial in self.trials]
        lines += ["", f"stopped: {self.stop_reason}"]
        lines += [f"input: {self.input_note}"] if self.input_note else []
        rate = "" if self.learning_rate is None else f" at learning rate {self.learning_rate:.6g}"
        lines += ["", f"suggestion (lr_rule={rule}, from global batch {self.global_batch_size}"
                  f"{rate}; the same examples seen):"]
        return "\n".join(lines + [f"  {line}" for line in self.suggestion(rule)])
