"""The run plan: the Trainer's options resolved once against the strategy.

`TrainerOptions` are what the user asked for; `RunPlan` is what the run does:
the input mode (and why), the precision, the batch split (`BatchPlan`), the
hosts, steps per fetch, whether the Task brings its own step, what XLA compiles
once the model is built (`with_xla`, `tputrain.loop.xla_plan`), and steps per
program once the host loop is. `Inputs`, the step, `HostLoop`, progress and the
actions read it; nothing copies it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import tensorflow as tf

from tputrain.checkpointing.integrity import InputLayoutError
from tputrain.distribution.strategy import check_devices_exist
from tputrain.loop.hosts import host_topology, is_chief
from tputrain.loop.inputs import default_input_mode
from tputrain.loop.random_draws import features_spec
from tputrain.loop.xla_plan import XLA_OFF, XlaPlan, decide_xla
from tputrain.options import TrainerOptions


# Plan fields the strategy or the step's build decide (not settable as options).
RESOLVED = ("input_mode", "precision", "jit_compile", "steps_per_program", "steps_per_fetch",
            "global_batch_size", "accumulation_steps", "ema_decay")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one step's examples split: over hosts, replicas and micro-batches."""

    global_batch_size: int
    replicas: int
    accumulation_steps: int
    num_hosts: int
    host_id: int

    @property
    def per_replica(self) -> int:
        """Examples per replica per step (all its micro-batches)."""
        return self.global_batch_size // self.replicas

    @property
    def micro_batch(self) -> int:
        """Examples per replica per micro-batch."""
        return self.per_replica // self.accumulation_steps

    @property
    def global_micro_batch(self) -> int:
        """Examples per micro-batch over all replicas: what the train input is built with."""
        return self.global_batch_size // self.accumulation_steps

    @property
    def local_replicas(self) -> int:
        return self.replicas // self.num_hosts


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The options resolved for this strategy (frozen; `with_xla` fills in XLA once
    the model is built, `launched` the steps per program).

    The option fields it does not resolve (train_steps, eval_every, ...) are read
    from `options` by the properties below, so `plan.<knob>` is the value the run uses.
    """

    options: TrainerOptions
    batch: BatchPlan
    is_chief: bool
    input_mode: str
    input_mode_reason: str
    precision: str
    custom_train_step: bool  # the Task overrides Task.train_step (`overrides_train_step`)
    jit_compile: bool | str = "auto"  # False once XLA refused the step ("auto")
    xla_plan: XlaPlan | None = None  # None until the model is built (`with_xla`)
    steps_per_program: int | str = "auto"  # a number once the host loop is built

    # The options the plan does not resolve, as given.
    train_steps = property(lambda self: self.options.train_steps)
    steps_per_loop = property(lambda self: self.options.steps_per_loop)
    global_batch_size = property(lambda self: self.options.global_batch_size)
    eval_every = property(lambda self: self.options.eval_every)
    eval_steps = property(lambda self: self.options.eval_steps)
    eval_splits = property(lambda self: self.options.eval_splits)
    checkpoint_every = property(lambda self: self.options.checkpoint_every)
    keep_checkpoints = property(lambda self: self.options.keep_checkpoints)
    seed = property(lambda self: self.options.seed)
    accumulation_steps = property(lambda self: self.options.accumulation_steps)
    profile_steps = property(lambda self: self.options.profile_steps)
    report_mfu = property(lambda self: self.options.report_mfu)
    class_weight = property(lambda self: self.options.class_weight)
    checkpoint = property(lambda self: self.options.checkpoint)
    profiling = property(lambda self: self.options.profiling)
    ema_decay = property(lambda self: self.options.ema_decay)
    remat = property(lambda self: self.options.remat)
    progress_bar = property(lambda self: self.options.progress_bar)

    @property
    def steps_per_fetch(self) -> int:
        return self.options.steps_per_fetch

    def check_resume_step(self, step: int, model_dir: str) -> None:
        """Host input is read in whole fetches: a resume must start on a fetch boundary."""
        if step % self.steps_per_fetch:
            raise InputLayoutError(
                f"the checkpoint in {model_dir} is at step {step}, not a multiple of "
                f"Trainer.steps_per_fetch={self.steps_per_fetch}: resume with a "
                "steps_per_fetch that divides it (e.g. 1)")

    def options_note(self, name: str) -> str:
        """`name` as asked and as planned, for an error message."""
        return f"asked {getattr(self.options, name)!r}, planned {getattr(self, name)!r}"

    @property
    def xla(self) -> str:
        """What XLA compiles and why, in words (the start-up line's)."""
        return self.xla_plan.why if self.xla_plan is not None else "not built yet"

    def with_xla(self, strategy: tf.distribute.Strategy, model: keras.Model,
                 optimizer: keras.optimizers.Optimizer, train_element_spec: Any,
                 source_key: str | tuple[str, ...] | None) -> "RunPlan":
        """This plan with what `jit_compile` compiles for the built model
        (`tputrain.loop.xla_plan.decide_xla`); `source_key`: the features the step
        strips (a mixture's source id, packed rows' tags)."""
        features = features_spec(train_element_spec, self.batch.accumulation_steps, source_key)
        return dataclasses.replace(self, xla_plan=decide_xla(
            self.jit_compile, self.precision, self.custom_train_step, strategy, model,
            optimizer, features))

    def without_xla(self) -> "RunPlan":
        """This plan once XLA refused the step (jit_compile="auto"): it runs uncompiled."""
        return dataclasses.replace(self, jit_compile=False, xla_plan=XLA_OFF)

    def launched(self, built: "RunPlan", steps_per_program: int) -> "RunPlan":
        """This plan with what building the step (`built`, the step's plan) and the host
        loop decided: XLA, unless refused, and the steps per program."""
        return dataclasses.replace(self, jit_compile=built.jit_compile, xla_plan=built.xla_plan,
                                   steps_per_program=steps_per_program)

    def summary(self) -> str:
        """What the run will do, in one line (logged at start-up)."""
        batch = self.batch
        return (f"{batch.replicas} replica(s) on {batch.num_hosts} host(s), global batch "
                f"{batch.global_batch_size} ({batch.per_replica} a replica"
                + (f", micro-batches of {batch.micro_batch}" if batch.accumulation_steps > 1
                   else "")
                + f"), precision {self.precision}, input mode {self.input_mode} "
                f"({self.input_mode_reason}), steps per fetch {self.steps_per_fetch}, "
                f"remat {self.options.remat.mode if self.options.remat else 'off'}")


def resolve_plan(options: TrainerOptions, strategy: tf.distribute.Strategy,
                 precision: Callable[[], str],
                 custom_train_step: bool, task_name: str) -> RunPlan:
    """Checks the options against `strategy` and resolves them (the one place the
    batch split and the input mode are decided); `precision` is resolved (it sets
    the Keras policy) once the checks passed."""
    check_devices_exist(strategy)
    replicas = strategy.num_replicas_in_sync
    options.check_replicas(replicas, custom_train_step, task_name)
    num_hosts, host_id = host_topology(strategy)
    batch = BatchPlan(options.global_batch_size, replicas, options.accumulation_steps,
                      num_hosts, host_id)
    mode, reason = ((options.input_mode, "as configured") if options.input_mode
                    else default_input_mode(strategy))
    if options.steps_per_fetch > 1 and mode != "host":
        raise ValueError(f"Trainer.steps_per_fetch={options.steps_per_fetch} needs "
                         "input_mode='host'; distributed input prefetches to the devices "
                         "already: set steps_per_fetch=1")
    return RunPlan(options, batch, is_chief(strategy), mode, reason, precision(),
                   custom_train_step, options.jit_compile,
                   steps_per_program=options.steps_per_program)
