"""The Trainer's knobs, validated once: `TrainerOptions` and its parts.

`Trainer(...)` takes these as keyword arguments (and gin binds them as
`Trainer.<name>`, the parts as `CheckpointOptions.<name>`...); `Trainer.options`
holds the validated, frozen result, so what a run will do is visible in one
place. Every knob is reachable from Python; gin only fills these classes
(`tputrain.config.registry`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np
from absl import logging

from tputrain.core.checks import check_int, per_replica_batch

# Builders of a part that reads more than its class does: the gin configuration
# registers ones that fill fields from deprecated gin names (`register_part_builder`).
_PART_BUILDERS: dict[type, Callable[..., Any]] = {}

INPUT_MODES = ("host", "distributed")
REMAT_MODES = ("full", "activations", "larger_than", "list_of_layers")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How checkpoints are written (their cadence and count: `TrainerOptions`).

    Attributes:
      async_save: write checkpoints on a background thread: training goes on while
        the snapshot is written (`tputrain.checkpointing.async_writer`).
      check_finite: refuse to save a state with NaN/Inf in a float variable.
    """

    async_save: bool = False
    check_finite: bool = True

    def __post_init__(self) -> None:
        for name in ("async_save", "check_finite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CheckpointOptions.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class PrecisionOptions:
    """Which dtype the model computes in, and which layers stay float32.

    Attributes:
      policy: "float32", "mixed_bfloat16" or "mixed_float16"; None: the hardware
        default (bf16 on TPU, else float32).
      keep_float32_layers: names or globs of layers kept in float32 under a mixed
        policy (what `tputrain audit-precision` flags).
    """

    policy: str | None = None
    keep_float32_layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        layers = self.keep_float32_layers
        if isinstance(layers, str) or not all(isinstance(l, str) for l in layers):
            raise ValueError("PrecisionOptions.keep_float32_layers must be a list of layer "
                             f"names, got {layers!r}")
        object.__setattr__(self, "keep_float32_layers", tuple(layers))


@dataclasses.dataclass(frozen=True)
class ProfilingOptions:
    """What model FLOPs utilization is measured against (`Trainer.report_mfu`).

    Attributes:
      device_kind: overrides detection, e.g. "TPU v5e" or "A100".
      peak_flops_per_device: peak FLOP/s of one device, for hardware not in
        `tputrain.observe.flops.PEAK_FLOPS` (no CPU probe then either).
    """

    device_kind: str | None = None
    peak_flops_per_device: float | None = None

    def __post_init__(self) -> None:
        peak = self.peak_flops_per_device
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))
                                 or not peak > 0):
            raise ValueError("ProfilingOptions.peak_flops_per_device must be a number > 0, "
                             f"got {peak!r}")


@dataclasses.dataclass(frozen=True)
class RematOptions:
    """What the backward pass recomputes instead of keeping (`keras.RematScope`'s modes).

    Attributes:
      mode: "full" (every layer and op of the model), "activations" (the
        activation functions of layers that have one, e.g. `Dense(activation=...)`),
        "larger_than" (layers whose output has more than `output_size_threshold`
        elements) or "list_of_layers" (the layers named in `layer_names`).
      output_size_threshold: elements per output (batch included) for "larger_than".
      layer_names: layer names for "list_of_layers".
    """

    mode: str = "full"
    output_size_threshold: int = 1024
    layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in REMAT_MODES:
            raise ValueError(f"RematOptions.mode must be one of {REMAT_MODES}, got {self.mode!r}")
        check_int("RematOptions", "output_size_threshold", self.output_size_threshold, 0)
        names = self.layer_names
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"RematOptions.layer_names must be a list of layer names, got {names!r}")
        if self.mode == "list_of_layers" and not names:
            raise ValueError('RematOptions(mode="list_of_layers") needs layer_names')
        object.__setattr__(self, "layer_names", tuple(names))


def _check_eval_splits(splits: Any) -> tuple[str, ...]:
    """Distinct set names, none "train" (the train split) nor holding "/" (a set's
    metrics are "<set>/<metric>")."""
    names = tuple(splits) if isinstance(splits, (list, tuple)) else None
    if not names or len(set(names)) != len(names) or not all(
            isinstance(n, str) and n and "/" not in n and n != "train" for n in names):
        raise ValueError("Trainer.eval_splits must be a non-empty tuple of distinct split names "
                         f"(not 'train', no '/'), e.g. ('validation', 'test'); got {splits!r}")
    return names


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """How a Trainer runs: cadence, batch, precision, input and compilation.

    Attributes:
      train_steps: total optimizer steps; a rerun continues up to this number.
      steps_per_loop: steps per compiled host call; loops also stop at eval and
        checkpoint boundaries.
      global_batch_size: examples per step over all replicas; None (the Trainer's
        default): a `KerasTask`'s own batch (`KerasTask.global_batch_size`; another
        value is refused), else 64.
      eval_every: evaluate every N steps (and at the end); None: only at the end.
      eval_steps: eval batches per evaluation (of each eval set); None: the whole
        (finite) eval split.
      eval_splits: the eval sets, each `Task.build_inputs(name, ...)`, evaluated in
        turn: e.g. ("validation", "test"). The default ("eval",) reports its metrics
        unprefixed ("accuracy", TensorBoard eval/); other sets as "<set>/accuracy"
        (TensorBoard eval/<set>/), which BestCheckpoint and EarlyStopping can watch.
      checkpoint_every: save every N steps (and at the end); None: as eval_every,
        or 1000.
      keep_checkpoints: how many checkpoints to keep.
      precision: `PrecisionOptions`; a policy name ("float32", "mixed_bfloat16",
        "mixed_float16") stands for `PrecisionOptions(policy=name)`; None for
        `PrecisionOptions()` (bf16 on TPU, else float32).
      seed: seeds weight initialisation and Keras random ops: the Trainer calls
        `keras.utils.set_random_seed(seed)` as it builds, which seeds the process's
        Python, NumPy and TensorFlow global generators too (a script that draws from
        them after building a Trainer draws seed's stream; `tputrain.fit` puts
        Python's and NumPy's back as the caller left them, as `model.fit` does).
      input_mode: "host" keeps a plain per-host iterator that is checkpointed
        (exact data resume) and splits each step's batches across local replicas;
        "distributed" uses `distribute_datasets_from_function` (device prefetch,
        needed for multi-host TPU pods) and resumes by skipping consumed batches.
        None picks "host" (exact resume, at any step in the same time) everywhere
        but on a multi-host TPU slice, whose one client cannot feed every host's
        TPUs from one iterator: there "distributed" (the start-up line says so, and
        that a resume re-reads the consumed batches).
      jit_compile: compile the step with XLA. On one replica the whole per-replica
        step (forward, backward, update) is compiled; on several replicas
        `Task.compute_gradients` (forward and backward) and, after the all-reduce,
        the optimizer's update as one program on each device
        (`tputrain/loop/update.py`): XLA cannot compile MirroredStrategy's
        cross-device variable updates in one program (on CPU it fails with "Trying
        to access resource ... located in device CPU:1 from device CPU:0"). TPUs
        compile everything anyway; the flag changes nothing there.
        "auto" (the default) compiles the whole step on one CPU/GPU replica when
        XLA can lower it (measured faster here in float32: the MLP and the
        Transformer of `benchmarks/train_loop.py`, see docs/performance.md) and
        falls back, with a warning, when it cannot; on several replicas it compiles
        the update on each device (less CPU time a step than TensorFlow's
        per-variable kernels: the `resume` rows of docs/performance.md) for
        Keras's and tputrain's optimizers in float32 and mixed_bfloat16; it
        compiles nothing for mixed_float16 on a CPU (nor bf16 matmuls: XLA's CPU
        backend lacks oneDNN's), nor, on one CPU replica, a model with random ops
        such as Dropout (XLA's CPU random-number generation is far slower than
        TensorFlow's kernels), nor a conv net where TensorFlow runs oneDNN on the CPU
        (its convolutions are faster than XLA's CPU ones; in bf16 on one replica
        only GELUs and layer norms are compiled). Wherever "auto" leaves the
        forward pass uncompiled (not on a TPU), Keras's channels-last batch
        norms run as TensorFlow's fused kernel while the step traces, with
        Keras's maths (`tputrain/loop/batch_norm.py`); False swaps nothing.
      plan_trial: with jit_compile="auto" on a CPU, time the plausible XLA plans
        (the rules' above first, then jit_compile=True's, none) for a few steps
        each on the real model and a train batch before the first loop, on the
        run's state written back after each (the weights are those of a run
        without it), and train with the fastest; the choice is logged as a table
        and recorded in `model_dir/plan.json` and for the machine (under
        `TPUTRAIN_CACHE_DIR`), so a resume, or another run of the model on the
        same machine, runs it without a trial (`tputrain.loop.plan_trial`,
        docs/performance.md). Its time is in goodput's compile bucket and bounded:
        it tries no further plan once the next would take it over 10% of the
        run's estimated time (it trains with the best plan timed so far; its
        table names those not tried). "auto" (the default): for runs of at least
        10x the trial's steps; a shorter run, or a resume of a run that recorded
        no plan, keeps the rules' plan and records nothing. True: also on such a
        resume (a short run records the rules' plan). False: never.
      accumulation_steps: split each step's `global_batch_size` examples into N
        micro-batches, sum their gradients and apply them once: the same update as
        one N-times-larger batch (batch-norm statistics aside) in 1/N the memory.
        Inputs are then built with a global batch of `global_batch_size / N`.
      profile_steps: `(start, stop)` captures a TensorBoard profiler trace of steps
        [start, stop) into `model_dir/train` (open TensorBoard's Profile tab).
      report_mfu: count FLOPs per step (or use `Task.flops_per_example`) and log
        model FLOPs utilization against the device's peak (`tputrain.observe.flops`).
      steps_per_fetch: host input mode: take the batches of this many steps with one
        `get_next` (the dataset is batched once more on the host). Each fetch costs a
        thread hand-off whatever the batch size, which is a noticeable share of a
        sub-millisecond step; K steps per fetch pay it once. The batch-to-replica
        order is unchanged (the same weights as 1). It shrinks (logged) to the largest
        divisor of steps_per_loop, checkpoint_every, eval_every, train_steps and
        profile_steps, so that no fetch is split by a loop boundary.
      steps_per_program: where the whole step is one XLA program on one replica,
        read one batch a step (`steps_per_fetch=1`, host input), run this many steps
        in one XLA program launch: each launch costs host work (the compilation
        cache lookup, the variables' buffers, the executor's hand-off) that K steps
        pay once. "auto" (the default): the
        largest divisor of steps_per_loop up to 32 whose K batches (stacked in the
        program) take at most 64 MiB and whose K steps take at most 0.25 s at the
        device's peak FLOP/s (when counted: `report_mfu`); 1 for large batches or
        long steps. A loop whose length is not a multiple of it ends with one launch
        of the same program on fewer steps (no new program is compiled); the weights
        are those of one step a launch.
        SIGTERM is then noticed between programs, and a guard trip stops inside one.
      class_weight: `{class id: weight}`, as Keras `fit`'s: each train example's
        loss (and train metrics) weighted by its label's class, 1.0 for classes
        not listed; labels are class ids, or one-hot (their argmax). For a train
        split of `(features, labels)`; the eval split is not weighted.
      checkpoint: `CheckpointOptions` (async writes, the finite check); None:
        `CheckpointOptions()`.
      profiling: `ProfilingOptions` (the peak MFU is measured against); None:
        `ProfilingOptions()`.
      ema_decay: keep an exponential moving average of the trainable weights
        (float32, checkpointed; `average = decay * average + (1 - decay) * weights`
        after each applied step, from the first step's weights), which evaluation,
        `BestCheckpoint`, predict and export use; training continues on the raw
        weights (`tputrain.optim.ema`). E.g. 0.999; None: no average.
      remat: rematerialization: activations are recomputed in the backward pass
        instead of kept, for less device memory at the cost of compute (MFU still
        counts the model's FLOPs, not the recomputation). None (the default): off;
        a mode ("full", "activations", "larger_than", "list_of_layers") stands for
        `RematOptions(mode=...)`; or a `RematOptions`. See docs/performance.md.
      progress_bar: a live bar (step, rate, ETA) between the loop lines: "auto" (the
        default) on a terminal or in a Jupyter notebook, the plain lines alone in
        files, pipes and CI; "on" or "off" (`tputrain.observe.progress_bar`).
    """

    train_steps: int = 1000
    steps_per_loop: int = 100
    global_batch_size: int = 64
    eval_every: int | None = None
    eval_steps: int | None = None
    eval_splits: tuple[str, ...] = ("eval",)
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    precision: str | PrecisionOptions | None = None
    seed: int = 0
    input_mode: str | None = None
    jit_compile: bool | str = "auto"
    accumulation_steps: int = 1
    profile_steps: tuple[int, int] | None = None
    report_mfu: bool = True
    steps_per_fetch: int = 1
    steps_per_program: int | str = "auto"
    class_weight: Mapping[int, float] | None = None
    checkpoint: CheckpointOptions | None = None
    profiling: ProfilingOptions | None = None
    ema_decay: float | None = None
    remat: str | RematOptions | None = None
    progress_bar: str = "auto"
    plan_trial: bool | str = "auto"

    def __post_init__(self) -> None:
        _fill_parts(self)
        object.__setattr__(self, "ema_decay", _check_ema_decay(self.ema_decay))
        object.__setattr__(self, "remat", _check_remat(self.remat))
        object.__setattr__(self, "eval_splits", _check_eval_splits(self.eval_splits))
        for name in ("train_steps", "steps_per_loop", "global_batch_size",
                     "accumulation_steps", "keep_checkpoints", "seed"):
            check_int("Trainer", name, getattr(self, name), 0 if name == "seed" else 1)
        for name in ("eval_every", "eval_steps", "checkpoint_every"):
            check_int("Trainer", name, getattr(self, name), 1, allow_none=True)
        if self.progress_bar not in ("auto", "on", "off"):
            raise ValueError("Trainer.progress_bar must be 'auto', 'on' or 'off', "
                             f"got {self.progress_bar!r}")
        object.__setattr__(self, "jit_compile", _bool_or_auto("jit_compile", self.jit_compile))
        if self.steps_per_program != "auto":
            if isinstance(self.steps_per_program, str):
                raise ValueError("Trainer.steps_per_program must be an int >= 1 or 'auto', "
                                 f"got {self.steps_per_program!r}")
            object.__setattr__(self, "steps_per_program", check_int(
                "Trainer", "steps_per_program", self.steps_per_program, 1))
        if self.input_mode is not None and self.input_mode not in INPUT_MODES:
            raise ValueError(f"Trainer.input_mode must be one of {INPUT_MODES}, "
                             f"got {self.input_mode!r}")
        ints = {name: int(getattr(self, name)) for name in (
            "train_steps", "steps_per_loop", "global_batch_size", "accumulation_steps",
            "keep_checkpoints", "seed")}
        for name, value in ints.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "checkpoint_every",
                           self.checkpoint_every or self.eval_every or 1000)
        object.__setattr__(self, "report_mfu", bool(self.report_mfu))
        object.__setattr__(self, "plan_trial", _bool_or_auto("plan_trial", self.plan_trial))
        object.__setattr__(self, "class_weight", _check_class_weight(self.class_weight))
        object.__setattr__(self, "profile_steps", _check_profile_steps(self.profile_steps))
        object.__setattr__(self, "steps_per_fetch", _check_steps_per_fetch(
            self.steps_per_fetch, steps_per_loop=self.steps_per_loop,
            train_steps=self.train_steps, checkpoint_every=self.checkpoint_every,
            eval_every=self.eval_every, profile_steps=self.profile_steps))

    def check_replicas(self, replicas: int, custom_train_step: bool, task_name: str) -> None:
        """Checks what depends on the strategy: the batch must split evenly over the
        replicas (and micro-batches); a Task.train_step override limits accumulation
        and multi-replica XLA."""
        if custom_train_step and self.accumulation_steps > 1:
            raise ValueError(
                f"{task_name} overrides Task.train_step, which cannot be split into "
                "micro-batches: override Task.compute_gradients instead, or set "
                "Trainer.accumulation_steps=1")
        per_replica_batch(self.global_batch_size, replicas, self.accumulation_steps)
        if self.jit_compile is True and custom_train_step and replicas > 1:
            raise ValueError(
                f"jit_compile on {replicas} replicas compiles Task.compute_gradients only, but "
                f"{task_name} overrides Task.train_step: override compute_gradients "
                "instead, or set Trainer.jit_compile=False")


def register_part_builder(cls: type, builder: Callable[..., Any] | None) -> None:
    """How `build_part(cls, ...)` builds `cls` from now on (None: the class itself).

    The gin configuration registers one per options class with deprecated gin names
    (`tputrain.config.registry.LEGACY`); the class and its constructor stay as written.
    """
    if builder is None:
        _PART_BUILDERS.pop(cls, None)
    else:
        _PART_BUILDERS[cls] = builder


def build_part(cls: type, **given: Any) -> Any:
    """An options part the caller left unset (or gave only a policy name), as a run
    builds it: `cls(**given)`, or its registered builder (`register_part_builder`)."""
    return _PART_BUILDERS.get(cls, cls)(**given)


def _fill_parts(options: TrainerOptions) -> None:
    """Each part as its options class (built with its defaults when not given)."""
    precision = options.precision
    if precision is None or isinstance(precision, str):
        precision = (build_part(PrecisionOptions) if precision is None
                     else build_part(PrecisionOptions, policy=precision))
    for name, cls, value in (
            ("precision", PrecisionOptions, precision),
            ("checkpoint", CheckpointOptions, options.checkpoint or build_part(CheckpointOptions)),
            ("profiling", ProfilingOptions, options.profiling or build_part(ProfilingOptions))):
        if not isinstance(value, cls):
            raise TypeError(f"Trainer.{name} must be a tputrain.{cls.__name__}, "
                            f"got {type(value).__name__}")
        object.__setattr__(options, name, value)


def _check_remat(remat: Any) -> RematOptions | None:
    """None, or the mode as `RematOptions`."""
    if remat is None or isinstance(remat, RematOptions):
        return remat
    if isinstance(remat, str) and remat in REMAT_MODES:
        return RematOptions(mode=remat)
    raise ValueError(f"Trainer.remat must be one of {(None,) + REMAT_MODES} or a "
                     f"tputrain.RematOptions, got {remat!r}")


AUTO_PROGRAM_STEPS = 32  # steps_per_program="auto": at most this many steps,
AUTO_PROGRAM_BYTES = 64 << 20  # at most this many bytes of their batches,
AUTO_PROGRAM_IDEAL_SECONDS = 0.25  # and at most this long at the device's peak FLOP/s


def program_steps(options: TrainerOptions, batch_bytes: int,
                  ideal_step_seconds: float | None = None) -> int:
    """`steps_per_program` as a number. "auto" is the largest divisor of
    steps_per_loop up to `AUTO_PROGRAM_STEPS` (25 for the default 100) whose batches
    (`batch_bytes` each, stacked in the program) fit in `AUTO_PROGRAM_BYTES` and
    whose steps take at most `AUTO_PROGRAM_IDEAL_SECONDS` at peak FLOP/s (about a
    second at 25% MFU: SIGTERM is noticed between programs, and a launch's cost only
    matters for short steps)."""
    if options.steps_per_program != "auto":
        return int(options.steps_per_program)
    most = min(AUTO_PROGRAM_STEPS, max(1, AUTO_PROGRAM_BYTES // max(batch_bytes, 1)))
    if ideal_step_seconds:
        most = min(most, max(1, int(AUTO_PROGRAM_IDEAL_SECONDS / ideal_step_seconds)))
    return max(k for k in range(1, most + 1) if options.steps_per_loop % k == 0)


def _check_class_weight(class_weight: Any) -> dict[int, float] | None:
    """`{class id >= 0: weight >= 0}` as plain ints and floats, or None."""
    if class_weight is None:
        return None
    if not isinstance(class_weight, Mapping) or not class_weight:
        raise ValueError("Trainer.class_weight must be a non-empty dict {class id: weight}, "
                         f"got {class_weight!r}")
    checked = {}
    for key, value in class_weight.items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
            raise ValueError(f"Trainer.class_weight: class ids are ints >= 0, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"Trainer.class_weight: the weight of class {key} must be a "
                             f"finite number >= 0, got {value!r}")
        checked[int(key)] = float(value)
    return checked


def _bool_or_auto(name: str, value: Any) -> bool | str:
    """True, False or "auto"; an int 0 or 1 or a NumPy bool as the bool (the plan asks
    `is True`: a 1 let through would run as False)."""
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, (bool, int, np.bool_, np.integer)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"Trainer.{name} must be True, False or 'auto', got {value!r}")


def _check_ema_decay(decay: Any) -> float | None:
    """A float in (0, 1), or None: 1 would never move, 0 would be the raw weights."""
    if decay is None:
        return None
    if isinstance(decay, bool) or not isinstance(decay, (int, float, np.floating)) \
            or not math.isfinite(decay) or not 0 < decay < 1:
        raise ValueError("Trainer.ema_decay must be a number in (0, 1) such as 0.999, "
                         f"or None, got {decay!r}")
    return float(decay)


def _check_profile_steps(profile_steps: Any) -> tuple[int, int] | None:
    if profile_steps is None:
        return None
    try:
        start, stop = (int(s) for s in profile_steps)
    except (TypeError, ValueError):
        raise ValueError(f"Trainer.profile_steps must be (start, stop), got {profile_steps!r}") from None
    if not 0 <= start < stop:
        raise ValueError(f"Trainer.profile_steps=({start}, {stop}) needs 0 <= start < stop, "
                         "e.g. (10, 15) to trace five steps after warm-up")
    return start, stop


def _check_steps_per_fetch(steps_per_fetch: Any, **boundaries: Any) -> int:
    """The fetch size actually used: the largest divisor of every loop boundary.

    Loops end on fetch boundaries, so no fetch is ever split. A config that sets
    `steps_per_fetch=100` keeps working when a user overrides `steps_per_loop=20`:
    the fetch shrinks to 20 (logged) instead of the run failing.
    """
    if isinstance(steps_per_fetch, bool) or not isinstance(steps_per_fetch, int) \
            or steps_per_fetch < 1:
        raise ValueError(f"Trainer.steps_per_fetch must be an int >= 1, got {steps_per_fetch!r}")
    fetch, reasons = steps_per_fetch, []
    for name, value in boundaries.items():
        for number in (value if isinstance(value, tuple) else (value,)):
            if number is not None and int(number) % fetch:
                fetch = math.gcd(fetch, int(number))
                reasons.append(f"Trainer.{name}={value}")
    if fetch != steps_per_fetch:
        logging.info("tputrain: steps_per_fetch %d -> %d so that fetches divide %s",
                     steps_per_fetch, fetch, ", ".join(reasons))
    return fetch
