"""Learning-rate schedules: linear warmup, then cosine, linear or constant decay.

Large global batches (TPU pods) need two things to train like small ones: a
learning rate scaled with the batch (the linear scaling rule, Goyal et al. 2017:
`lr * global_batch / reference_batch`) and a warmup, because that scaled rate is
too large for the random initial weights. `warmup_schedule` does both and is
what gin binds as `build_optimizer.learning_rate = @warmup_schedule()`.

A schedule is evaluated at the optimizer's `iterations` before each update, so
step 0 is the first update. With gradient accumulation a step is one update
(N micro-batches), not one micro-batch.
"""

from __future__ import annotations

import math

import keras

DECAYS = ("cosine", "linear", "constant")
LR_RULES = ("linear", "sqrt")  # scale_learning_rate's rules


def scale_learning_rate(learning_rate: float, global_batch_size: int,
                        reference_batch_size: int, rule: str = "linear") -> float:
    """The learning rate for `global_batch_size`, scaled from the one that works at
    `reference_batch_size` (e.g. the paper's 0.1 at batch 256).

    `rule` "linear" (Goyal et al. 2017, for SGD with momentum) multiplies by
    `global_batch_size / reference_batch_size`; "sqrt" by its square root, the
    gentler rule often used with Adam-type optimizers (the gradient noise falls
    with the square root of the batch). Either wants a warmup at large batches.
    """
    if global_batch_size < 1 or reference_batch_size < 1:
        raise ValueError(f"batch sizes must be >= 1, got global {global_batch_size} and "
                         f"reference {reference_batch_size}")
    if rule not in LR_RULES:
        raise ValueError(f"unknown learning-rate rule {rule!r}: use one of {', '.join(LR_RULES)}")
    ratio = global_batch_size / reference_batch_size
    return float(learning_rate) * (ratio if rule == "linear" else math.sqrt(ratio))


@keras.saving.register_keras_serializable(package="tputrain")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from 0 to `peak_learning_rate`, then decay to `end_learning_rate`.

    * steps `[0, warmup_steps)`: `peak * step / warmup_steps`;
    * steps `[warmup_steps, total_steps]`: with progress `p` from 0 to 1,
      "cosine": `end + (peak - end) * (1 + cos(pi p)) / 2`,
      "linear": `peak + (end - peak) * p`, "constant": `peak`;
    * after `total_steps`: `end` (`peak` for "constant").
    """

    def __init__(self, peak_learning_rate: float, total_steps: int, warmup_steps: int = 0,
                 decay: str = "cosine", end_learning_rate: float = 0.0):
        if decay not in DECAYS:
            raise ValueError(f"unknown decay {decay!r}: use one of {', '.join(DECAYS)}")
        if warmup_steps < 0 or total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got "
                             f"{warmup_steps} and {total_steps}")
        if warmup_steps > total_steps:
            raise ValueError(f"warmup_steps {warmup_steps} is longer than total_steps "
                             f"{total_steps}: lower warmup_steps or raise total_steps")
        self.peak_learning_rate = float(peak_learning_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.end_learning_rate = float(end_learning_rate)

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        peak, end = self.peak_learning_rate, self.end_learning_rate
        warmup = float(self.warmup_steps)
        decay_steps = float(max(1, self.total_steps - self.warmup_steps))
        progress = keras.ops.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if self.decay == "cosine":
            decayed = end + (peak - end) * 0.5 * (1.0 + keras.ops.cos(math.pi * progress))
        elif self.decay == "linear":
            decayed = peak + (end - peak) * progress
        else:
            decayed = keras.ops.full_like(progress, peak)
        if self.warmup_steps == 0:
            return decayed
        return keras.ops.where(step < warmup, peak * step / warmup, decayed)

    def get_config(self) -> dict:
        return dict(peak_learning_rate=self.peak_learning_rate, total_steps=self.total_steps,
                    warmup_steps=self.warmup_steps, decay=self.decay,
                    end_learning_rate=self.end_learning_rate)


def warmup_schedule(learning_rate: float, total_steps: int,
                    warmup_steps: int = 0, decay: str = "cosine",
                    end_learning_rate: float = 0.0,
                    global_batch_size: int | None = None,
                    reference_batch_size: int | None = None) -> WarmupDecay:
    """Builds a `WarmupDecay`, optionally applying the linear scaling rule.

    With `reference_batch_size` set, the peak is `learning_rate * global_batch_size
    / reference_batch_size` (and `end_learning_rate` is scaled alike). Bind the
    global batch with the same gin macro as the Trainer's, e.g.
    `GLOBAL_BATCH = 1024`, `Trainer.global_batch_size = %GLOBAL_BATCH`,
    `warmup_schedule.global_batch_size = %GLOBAL_BATCH`.
    """
    if reference_batch_size is not None:
        if global_batch_size is None:
            raise ValueError(
                "warmup_schedule.reference_batch_size is set but global_batch_size is not: "
                "bind warmup_schedule.global_batch_size to the Trainer's global batch "
                "(e.g. both to a %GLOBAL_BATCH macro)")
        learning_rate = scale_learning_rate(learning_rate, global_batch_size, reference_batch_size)
        end_learning_rate = scale_learning_rate(end_learning_rate, global_batch_size,
                                                reference_batch_size)
    return WarmupDecay(learning_rate, total_steps=total_steps, warmup_steps=warmup_steps,
                       decay=decay, end_learning_rate=end_learning_rate)
