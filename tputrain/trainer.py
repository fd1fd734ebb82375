"""The Trainer: compiled train/eval loops, checkpoints and progress around a Task.

A *step* is one optimizer update on one global batch (every replica processes
its per-replica slice). A *loop* is up to `steps_per_loop` steps inside a
single `tf.function` call, so the host pays Python overhead once per loop.

Data flows one way: strategy -> precision policy -> the task builds its model,
optimizer, metrics (in `strategy.scope()`) and inputs -> compiled loops ->
checkpoints and summaries in `model_dir`.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any, Callable, Mapping, Sequence

import gin
import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpoint import Checkpointer, seed_generator_states
from tputrain.checks import check_int
from tputrain.data import InputContext
from tputrain.flops import count_flops, peak_flops, specs_of
from tputrain.layer_precision import override_layer_dtypes
from tputrain.lock import lock_model_dir
from tputrain.precision import set_precision_policy, wrap_optimizer_for_policy
from tputrain.progress import Progress, Stopwatch
from tputrain.strategy import resolve_strategy
from tputrain.task import EVAL_REGULARIZATION, EVAL_WEIGHT, Task
from tputrain.actions import (Action, NonFinitePolicyAction, PreemptionAction,
                               ProfilerAction)
from tputrain.allreduce import reduce_gradients_first
from tputrain.console import default_progress
from tputrain.controller import EXHAUSTED, Controller
from tputrain.guard import NonFiniteError, NonFiniteGuard
from tputrain.preemption import Preempted, PreemptionWatcher
from tputrain.validate import (check_model_dir, iterator_state_bytes,
                               probe_inputs, variable_bytes)

_INPUT_MODES = ("host", "distributed")


def _host_topology(strategy: tf.distribute.Strategy) -> tuple[int, int]:
    """Returns (number of input pipelines/hosts, this host's index)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver:
        spec = resolver.cluster_spec().as_dict()
        hosts = [("chief", i) for i in range(len(spec.get("chief", [])))]
        hosts += [("worker", i) for i in range(len(spec.get("worker", [])))]
        if (resolver.task_type, resolver.task_id) in hosts:
            return len(hosts), hosts.index((resolver.task_type, resolver.task_id))
    return 1, 0


def _default_input_mode(strategy: tf.distribute.Strategy) -> tuple[str, str]:
    """("host" or "distributed", why): exact resume unless the strategy cannot have it."""
    hosts = getattr(strategy.extended, "num_hosts", 1)
    if isinstance(strategy, tf.distribute.TPUStrategy) and hosts > 1:
        return "distributed", (f"a {hosts}-host TPU slice is fed by a pipeline per host; "
                               "a resume re-reads and skips the consumed batches")
    return "host", "exact resume: the data position is checkpointed"


def _replicas_per_pipeline(context: tf.distribute.InputContext) -> int:
    """Replicas one input pipeline feeds under `distribute_datasets_from_function`."""
    return context.num_replicas_in_sync // context.num_input_pipelines


def _is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Only the chief writes the real checkpoints and summaries."""
    return bool(getattr(strategy.extended, "should_checkpoint", True))


def _check_static(element_spec: Any, split: str, per_replica_batch: int) -> None:
    """Fails early on dynamic shapes or a batch that is not the per-replica batch."""
    for path, spec in _flatten_with_paths(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is None:
            continue
        if not shape.is_fully_defined():
            raise ValueError(
                f"{split} input {path!r} has dynamic shape {shape}: TPUs and compiled loops "
                "need static shapes; batch with drop_remainder=True and pad variable-length "
                "features to a fixed length")
        if shape.rank and shape[0] != per_replica_batch:
            raise ValueError(
                f"{split} input {path!r} has batch dimension {shape[0]} but the per-replica "
                f"batch is {per_replica_batch}: batch with "
                "input_context.get_per_replica_batch_size(input_context.global_batch_size)")


def _is_weighted(element_spec: Any) -> bool:
    """Eval batches of `(features, labels, weights)`: padded, weight 0 on padding."""
    return isinstance(element_spec, tuple) and len(element_spec) == 3


def _with_weights(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`(features, labels)` batches as `(features, labels, ones)`: weighted, so that
    a host with fewer eval batches can pad with zero-weight ones (see `_padded`)."""
    if _is_weighted(dataset.element_spec):
        return dataset

    def add_weights(features, labels):
        rows = tf.shape(tf.nest.flatten(features)[0])[0]
        return features, labels, tf.ones([rows], tf.float32)
    return dataset.map(add_weights)


def _padded(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """A weighted eval dataset followed by endless all-zero, zero-weight batches
    (to fill the last step's replicas); any other dataset unchanged."""
    if not _is_weighted(dataset.element_spec):
        return dataset
    zeros = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), dataset.element_spec)
    return dataset.concatenate(tf.data.Dataset.from_tensors(zeros).repeat())


def _eval_means(totals: Mapping[str, Any], steps: int) -> dict[str, float]:
    """Per-step means of the eval logs; with padded batches, the loss is the mean
    over real examples (see `Task.eval_step`)."""
    totals = {name: float(value) for name, value in totals.items()}
    weight = totals.pop(EVAL_WEIGHT, None)
    regularization = totals.pop(EVAL_REGULARIZATION, 0.0)
    logs = {name: value / steps for name, value in totals.items()}
    if weight is not None and "loss" in totals:
        logs["loss"] = (totals["loss"] / weight if weight else float("nan")) + regularization / steps
    return logs


def _learning_rate_variables(optimizer: keras.optimizers.Optimizer) -> list[Any]:
    """The optimizer's learning-rate variables (a wrapper's and its inner one's).

    A float learning rate is a variable that checkpoints hold; a resume takes it
    from the config (see `Checkpointer.config_owned`). Schedules, weight decay,
    momentum and clipping are Python attributes: the config's value by construction.
    """
    return [v for v in optimizer.variables if v.name == "learning_rate"]


def _op_determinism() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is on (no public getter)."""
    from tensorflow.python.framework import config as tf_config

    return bool(getattr(tf_config, "is_op_determinism_enabled", lambda: False)())


def _flatten_with_paths(structure: Any) -> list[tuple[str, Any]]:
    return [("/".join(map(str, path)) or "<root>", value)
            for path, value in keras.tree.flatten_with_path(structure)]


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


@gin.configurable
class Trainer:
    """Trains a `Task` under a distribution strategy, with exact-resume checkpoints.

    Args:
      task: the user's model, data and loss.
      model_dir: checkpoints, TensorBoard events and the operative gin config.
      strategy: a `tf.distribute.Strategy`; None resolves one (`resolve_strategy`).
      train_steps: total optimizer steps; a rerun continues up to this number.
      steps_per_loop: steps per compiled host call; loops also stop at eval and
        checkpoint boundaries.
      global_batch_size: examples per step over all replicas.
      eval_every: evaluate every N steps (and at the end); None: only at the end.
      eval_steps: eval batches per evaluation; None: the whole (finite) eval split.
      checkpoint_every: save every N steps (and at the end); None: as eval_every,
        or 1000.
      keep_checkpoints: how many checkpoints to keep.
      precision: "float32", "mixed_bfloat16" or "mixed_float16"; None keeps the
        gin binding of `set_precision_policy` (bf16 on TPU, else float32).
      seed: seeds weight initialisation and Keras random ops.
      input_mode: "host" keeps a plain per-host iterator that is checkpointed
        (exact data resume) and splits each step's batches across local replicas;
        "distributed" uses `distribute_datasets_from_function` (device prefetch,
        needed for multi-host TPU pods) and resumes by skipping consumed batches.
        None picks "host" (exact resume, at any step in the same time) everywhere
        but on a multi-host TPU slice, whose one client cannot feed every host's
        TPUs from one iterator: there "distributed" (the start-up line says so, and
        that a resume re-reads the consumed batches).
      jit_compile: compile the step with XLA. On one replica the whole per-replica
        step (forward, backward, update) is compiled; on several replicas only
        `Task.compute_gradients` (forward and backward) is, because XLA cannot
        compile MirroredStrategy's cross-device variable updates (on CPU it fails
        with "Trying to access resource ... located in device CPU:1 from device
        CPU:0"). TPUs compile everything anyway; the flag changes nothing there.
        "auto" (the default) compiles the whole step on one CPU/GPU replica when
        XLA can lower it (measured faster here in float32: the MLP and the
        Transformer of `benchmarks/train_loop.py`, see docs/performance.md) and
        falls back, with a warning, when it cannot; it compiles nothing on several
        replicas (only the forward/backward could be) nor for mixed precision on a
        CPU (XLA's CPU backend lacks oneDNN's bf16 matmuls: slower there).
      accumulation_steps: split each step's `global_batch_size` examples into N
        micro-batches, sum their gradients and apply them once: the same update as
        one N-times-larger batch (batch-norm statistics aside) in 1/N the memory.
        Inputs are then built with a global batch of `global_batch_size / N`.
      profile_steps: `(start, stop)` captures a TensorBoard profiler trace of steps
        [start, stop) into `model_dir/train` (open TensorBoard's Profile tab).
      report_mfu: count FLOPs per step (or use `Task.flops_per_example`) and log
        model FLOPs utilization against the device's peak (`tputrain.flops`).
      steps_per_fetch: host input mode: take the batches of this many steps with one
        `get_next` (the dataset is batched once more on the host). Each fetch costs a
        thread hand-off whatever the batch size, which is a noticeable share of a
        sub-millisecond step; K steps per fetch pay it once. The batch-to-replica
        order is unchanged (the same weights as 1). It shrinks (logged) to the largest
        divisor of steps_per_loop, checkpoint_every, eval_every, train_steps and
        profile_steps, so that no fetch is split by a loop boundary.
      guard: the NaN/Inf guard (`tputrain.NonFiniteGuard(policy=...)`); None builds
        one from gin (policy "raise" by default).
      actions: `tputrain.Action`s called after each loop, evaluation and save and at
        the end (tputrain.actions).
    """

    def __init__(self, task: Task, model_dir: str, strategy: tf.distribute.Strategy | None = None,
                 train_steps: int = 1000, steps_per_loop: int = 100,
                 global_batch_size: int = 64, eval_every: int | None = None,
                 eval_steps: int | None = None, checkpoint_every: int | None = None,
                 keep_checkpoints: int = 3, precision: str | None = None, seed: int = 0,
                 input_mode: str | None = None, jit_compile: bool | str = "auto",
                 accumulation_steps: int = 1, profile_steps: tuple[int, int] | None = None,
                 report_mfu: bool = True, steps_per_fetch: int = 1,
                 guard: NonFiniteGuard | None = None, actions: Sequence[Action] = ()):
        for name, value in (("train_steps", train_steps), ("steps_per_loop", steps_per_loop),
                            ("global_batch_size", global_batch_size),
                            ("accumulation_steps", accumulation_steps),
                            ("keep_checkpoints", keep_checkpoints), ("seed", seed)):
            check_int("Trainer", name, value, 0 if name == "seed" else 1)
        for name, value in (("eval_every", eval_every), ("eval_steps", eval_steps),
                            ("checkpoint_every", checkpoint_every)):
            check_int("Trainer", name, value, 1, allow_none=True)
        if not isinstance(task, Task):
            raise TypeError(f"Trainer.task must be a tputrain.Task, got {type(task).__name__}")
        if not model_dir:
            raise ValueError("Trainer.model_dir is empty: pass --model_dir or bind Trainer.model_dir")
        self.task = task
        self.train_steps = int(train_steps)
        self.steps_per_loop = int(steps_per_loop)
        self.global_batch_size = int(global_batch_size)
        self.eval_every = eval_every
        self.eval_steps = eval_steps
        self.checkpoint_every = checkpoint_every or eval_every or 1000
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f"Trainer.jit_compile must be True, False or 'auto', got {jit_compile!r}")
        self.jit_compile = jit_compile
        self.accumulation_steps = int(accumulation_steps)
        self.profile_steps = _check_profile_steps(profile_steps)
        self.steps_per_fetch = _check_steps_per_fetch(
            steps_per_fetch, steps_per_loop=self.steps_per_loop, train_steps=self.train_steps,
            checkpoint_every=self.checkpoint_every, eval_every=eval_every,
            profile_steps=self.profile_steps)
        self.report_mfu = bool(report_mfu)
        self.actions = list(actions)
        if not all(isinstance(a, Action) for a in self.actions):
            raise TypeError("Trainer.actions must be tputrain.Action instances, got "
                            f"{[type(a).__name__ for a in self.actions]}")
        default_progress()  # a plain Python script shows progress, as the CLI does
        self._custom_train_step = type(task).train_step is not Task.train_step
        self.flops_per_step: float | None = None
        if self._custom_train_step and self.accumulation_steps > 1:
            raise ValueError(
                f"{type(task).__name__} overrides Task.train_step, which cannot be split into "
                "micro-batches: override Task.compute_gradients instead, or set "
                "Trainer.accumulation_steps=1")

        self.strategy = strategy or resolve_strategy()
        replicas = self.strategy.num_replicas_in_sync
        if self.global_batch_size % replicas:
            raise ValueError(
                f"global batch {self.global_batch_size} is not divisible by {replicas} replicas: "
                f"use a multiple of {replicas} (e.g. {replicas * max(1, round(self.global_batch_size / replicas))})")
        if self.global_batch_size % (replicas * self.accumulation_steps):
            raise ValueError(
                f"global batch {self.global_batch_size} does not split into "
                f"{self.accumulation_steps} micro-batches over {replicas} replicas: use a "
                f"multiple of {replicas * self.accumulation_steps}")
        if self.jit_compile is True and self._custom_train_step and replicas > 1:
            raise ValueError(
                f"jit_compile on {replicas} replicas compiles Task.compute_gradients only, but "
                f"{type(task).__name__} overrides Task.train_step: override compute_gradients "
                "instead, or set Trainer.jit_compile=False")
        self.num_hosts, self.host_id = _host_topology(self.strategy)
        self.local_replicas = replicas // self.num_hosts
        self.input_mode, mode_reason = ((input_mode, "as configured") if input_mode
                                        else _default_input_mode(self.strategy))
        if self.input_mode not in _INPUT_MODES:
            raise ValueError(f"Trainer.input_mode must be one of {_INPUT_MODES}, got {input_mode!r}")
        if self.steps_per_fetch > 1 and self.input_mode != "host":
            raise ValueError(f"Trainer.steps_per_fetch={self.steps_per_fetch} needs "
                             "input_mode='host'; distributed input prefetches to the devices "
                             "already: set steps_per_fetch=1")
        self.precision = (set_precision_policy(precision, strategy=self.strategy)
                          if precision is not None else set_precision_policy(strategy=self.strategy))
        keras.utils.set_random_seed(seed)

        # Inputs first: bad data fails before anything is built or written.
        self._train_dataset = self._build_dataset("train")
        probe_inputs(self._train_dataset, "train")  # corrupt records fail here, not mid-run
        # The eval split too: a missing eval pattern must not wait for the end of training.
        self._eval_dataset = self._build_dataset("eval")
        probe_inputs(self._eval_dataset, "eval")
        with self.strategy.scope():
            self.model = task.build_model()
            self._ensure_built(self._micro_batch_spec())
            # gin `override_layer_dtypes.keep_float32_layers`: layers the precision
            # audit found too sensitive for bf16/fp16 compute in float32.
            override_layer_dtypes(self.model)
            # Built here, in scope, before the first step: slot variables are then
            # mirrored and a restore can fill them directly.
            # Under mixed_float16 any task's optimizer gets Keras 3 loss scaling (the
            # step differentiates optimizer.scale_loss(loss)); a no-op otherwise.
            self.optimizer = wrap_optimizer_for_policy(task.build_optimizer())
            self.optimizer.build(self.model.trainable_variables)
            self.train_metrics = list(task.build_metrics())
            self.eval_metrics = list(task.build_metrics())
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # NaN/Inf losses or gradients are caught inside the step (tputrain.guard).
            self.guard = guard if guard is not None else NonFiniteGuard()
            self.guard.build()
            self.guard.wrap_optimizer(self.optimizer)
            reduce_gradients_first(self.optimizer)  # outermost: clipping and guard see the sum

        self.is_chief = _is_chief(self.strategy)
        self.model_dir = model_dir
        # Non-chief workers must still take part in saves; they write to a temp dir.
        self._work_dir = model_dir if self.is_chief else tempfile.mkdtemp(prefix="tputrain-worker-")
        trackables: dict[str, Any] = dict(model=self.model, optimizer=self.optimizer,
                                          seeds=seed_generator_states(self.model),
                                          nonfinite_steps=self.guard.nonfinite_steps)
        self._train_iterator = None
        per_host: dict[str, Any] = {}
        if self.input_mode == "host":  # each host's own data position
            self._train_iterator = iter(self._fetch_groups(self._train_dataset))
            per_host["iterator"] = self._train_iterator
        self._max_over_hosts_fn: Callable | None = None
        self.checkpointer = Checkpointer(os.path.join(self._work_dir, "checkpoints"), self.step,
                                         every=self.checkpoint_every, keep=keep_checkpoints,
                                         # every worker resumes from the chief's checkpoints
                                         restore_directory=os.path.join(model_dir, "checkpoints"),
                                         # the config, not the checkpoint, sets the rate
                                         config_owned=_learning_rate_variables(self.optimizer),
                                         per_host=per_host, host=(self.host_id, self.num_hosts),
                                         barrier=lambda: self._max_over_hosts(0), **trackables)
        self._preemption = PreemptionWatcher()  # SIGTERM -> stop at a step boundary
        if self.is_chief:  # inputs are checked; nothing has been written yet
            self._preflight()
        self.progress = Progress(self._work_dir if self.is_chief else None,
                                 self.train_steps, self.global_batch_size)
        self._eval_iterator = None
        self._eval_batches: int | None = None
        self._train_loop_fn: Callable | None = None
        self._train_step_fn: Callable | None = None
        self._eval_loop_fn: Callable | None = None
        logging.info("tputrain: %s, %d replica(s) on %d host(s), global batch %d, precision %s, "
                     "input mode %s (%s), XLA %s", type(self.strategy).__name__, replicas,
                     self.num_hosts, self.global_batch_size, self.precision, self.input_mode,
                     mode_reason, self._xla_plan()[2])

    def _xla_plan(self) -> tuple[bool, bool, str]:
        """(compile the whole step, compile forward/backward only, why) for `jit_compile`."""
        if isinstance(self.strategy, tf.distribute.TPUStrategy):
            return False, False, "on (TPU: always compiled)"
        replicas = self.strategy.num_replicas_in_sync
        if self.jit_compile is True:
            return (replicas == 1, replicas > 1, "on (the whole step)" if replicas == 1
                    else "on (forward and backward only)")
        if self.jit_compile != "auto":
            return False, False, "off"
        if replicas > 1:
            return False, False, f"auto: off on {replicas} replicas"
        on_cpu = not any("GPU" in d.upper() for d in self.strategy.extended.worker_devices)
        if on_cpu and self.precision != "float32":
            # XLA's CPU backend has no oneDNN bf16 matmuls: the Transformer's bf16 step
            # took 320 ms compiled against 250 ms uncompiled (docs/performance.md).
            return False, False, f"auto: off for {self.precision} on CPU"
        return True, False, "auto: the whole step, if it compiles"

    # ----------------------------------------------------------------- inputs

    def _input_context(self, tf_context: tf.distribute.InputContext | None = None,
                       global_batch_size: int | None = None) -> InputContext:
        global_batch_size = global_batch_size or self.global_batch_size
        if tf_context is not None:
            return InputContext.from_tf(tf_context, global_batch_size)
        return InputContext(num_input_pipelines=self.num_hosts, input_pipeline_id=self.host_id,
                            num_replicas_in_sync=self.strategy.num_replicas_in_sync,
                            global_batch_size=global_batch_size)

    def _input_batch(self, split: str) -> int:
        """The global batch the task's inputs are built with: a micro-batch when training
        with gradient accumulation."""
        return self.global_batch_size // (self.accumulation_steps if split == "train" else 1)

    def _group_micro_batches(self, dataset: tf.data.Dataset, split: str) -> tf.data.Dataset:
        """With accumulation, one element holds a replica's N micro-batches stacked on a
        new leading axis, so one step still takes one element per replica."""
        if split != "train" or self.accumulation_steps == 1:
            return dataset
        return dataset.batch(self.accumulation_steps, drop_remainder=True)

    def _micro_batch_spec(self) -> Any:
        """Element spec of one per-replica (micro-)batch of the train split."""
        spec = self._train_dataset.element_spec
        if self.accumulation_steps == 1:
            return spec
        return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec)

    def _build_dataset(self, split: str) -> tf.data.Dataset:
        """Builds this host's dataset of per-replica batches and checks its shapes."""
        batch = self._input_batch(split)
        dataset = self.task.build_inputs(split, self._input_context(global_batch_size=batch))
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"Task.build_inputs({split!r}) must return a tf.data.Dataset, "
                            f"got {type(dataset).__name__}")
        per_replica = batch // self.strategy.num_replicas_in_sync
        _check_static(dataset.element_spec, split, per_replica)
        return self._group_micro_batches(dataset, split)

    def _ensure_built(self, element_spec: Any) -> None:
        """Builds subclassed models (no Input layer) by calling them on zeros."""
        if self.model.built and self.model.variables:
            return
        features_spec = element_spec[0]
        zeros = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), features_spec)
        self.model(zeros, training=False)

    def _distributed_iterator(self, split: str, skip_steps: int = 0):
        """distribute_datasets_from_function; skips `skip_steps` steps of data."""
        def dataset_fn(tf_context):
            dataset = self.task.build_inputs(
                split, self._input_context(tf_context, self._input_batch(split)))
            dataset = self._group_micro_batches(dataset, split)
            # Each pipeline feeds its replicas one batch each per step (a TPU pod has
            # one client but a pipeline per host: not self.local_replicas).
            replicas = _replicas_per_pipeline(tf_context)
            return dataset.skip(skip_steps * replicas) if skip_steps else dataset
        return iter(self.strategy.distribute_datasets_from_function(dataset_fn))

    def _next(self, iterator) -> tuple[tf.Tensor, Any]:
        """In a tf.function: (has_value, distributed batch) for one step.

        Host mode takes one per-replica batch for each local replica from the plain
        iterator and places them with `experimental_distribute_values_from_function`.
        """
        if self.input_mode == "distributed":
            optional = iterator.get_next_as_optional()
            return optional.has_value(), optional
        optionals = [iterator.get_next_as_optional() for _ in range(self.local_replicas)]
        has_value = tf.reduce_all(tf.stack([o.has_value() for o in optionals]))
        return has_value, optionals

    def _fetch_groups(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """One element holds the per-replica batches of `steps_per_fetch` steps:
        shape `[steps_per_fetch, local_replicas, per-replica batch, ...]`.

        The host's prefetch, owned here: each step's per-replica batches are
        stacked and buffered in the background (`steps_per_fetch` steps deep), so a
        fetch only takes ready batches, as the device prefetch of
        `distribute_datasets_from_function` would (benchmarks/resume.py). The buffer
        holds per-step groups whatever `steps_per_fetch` is, and the outer batch op
        saves only its input's position, so checkpoints of the iterator stay valid
        when steps_per_fetch changes.
        """
        per_step = dataset.batch(self.local_replicas, drop_remainder=True)
        grouped = per_step.prefetch(self.steps_per_fetch).batch(self.steps_per_fetch,
                                                                drop_remainder=True)
        # tf.data would otherwise inject a prefetch after the outer batch, and a
        # checkpoint would then hold whole groups of the old size: resuming with
        # another steps_per_fetch would fail on their shape.
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        return grouped.with_options(options)

    def _distribute_from_group(self, group: Any, j: tf.Tensor) -> Any:
        """Step `j` of a fetched group: replica r takes `group[j, r]`, the order one
        fetch per step would give."""
        local = self.local_replicas
        batches = [tf.nest.map_structure(lambda t, r=r: t[j, r], group) for r in range(local)]
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: batches[ctx.replica_id_in_sync_group % local])

    def _distribute(self, value) -> Any:
        if self.input_mode == "distributed":
            return value.get_value()
        batches = [o.get_value() for o in value]
        local = self.local_replicas
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: batches[ctx.replica_id_in_sync_group % local])

    # ------------------------------------------------------------------ steps

    def _reduce(self, per_replica_logs: dict[str, Any]) -> dict[str, tf.Tensor]:
        return {name: self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
                for name, value in per_replica_logs.items()}

    def _replica_train_step(self, batch: Any) -> dict[str, tf.Tensor]:
        return self._train_step_fn(batch)

    def _build_train_step(self) -> Callable[[Any], dict[str, tf.Tensor]]:
        """The per-replica step (replica context), with accumulation and XLA as configured.

        Without an overridden `Task.train_step` the Trainer composes the step from
        `Task.compute_gradients` (once per micro-batch), the summed gradients'
        `apply_gradients` and `Task.update_metrics`: the same maths as
        `Task.train_step`, but the forward/backward can be compiled on its own.
        """
        compile_step, compile_gradients, _ = self._xla_plan()
        # With the guard, the conditional update is kept out of the step's XLA program
        # (see NonFiniteGuard.compile_apply): forward/backward and update compile apart.
        split = (compile_step and not self._custom_train_step
                 and self.guard.guards_apply(self.optimizer))

        if self._custom_train_step:
            def step(batch):
                return self.task.train_step(batch, self.model, self.optimizer,
                                            self.train_metrics, self.global_batch_size)
        else:
            # micro_batches is passed only when accumulating, so a Task that overrides
            # compute_gradients without it still works without accumulation.
            extra = {"micro_batches": self.accumulation_steps} if self.accumulation_steps > 1 else {}

            def compute(batch):
                return self.task.compute_gradients(batch, self.model, self.optimizer,
                                                   self.global_batch_size, **extra)
            if compile_gradients or split:
                compute = tf.function(compute, jit_compile=True)

            def step(batch):
                gradients, loss = self._accumulate_gradients(batch, compute)
                self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
                return {"loss": loss}
        if not compile_step:
            return step
        compiled = tf.function(step, jit_compile=True)
        if self.jit_compile == "auto" and not self._compiles(compiled):
            return self._build_train_step()  # now without XLA
        if split:
            self.guard.compile_apply()
            return step
        return compiled

    def _compiles(self, compiled: Callable) -> bool:
        """jit_compile="auto": whether XLA can compile the step (lowered, not run).

        A step XLA refuses (an op without an XLA kernel, e.g. a py_function) then
        runs uncompiled, with a log line naming the reason, instead of failing.
        """
        spec = self._train_dataset.element_spec
        zeros = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), spec)
        try:
            self.strategy.run(lambda batch: compiled.experimental_get_compiler_ir(batch)(
                stage="hlo"), args=(zeros,))
        except (tf.errors.OpError, ValueError, TypeError) as error:
            first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            logging.warning("tputrain: jit_compile='auto': the step does not compile with XLA "
                            "(%s: %s); it runs without XLA", type(error).__name__, first_line)
            self.jit_compile = False
            return False
        return True

    def _accumulate_gradients(self, batch: Any, compute: Callable) -> tuple[list[Any], tf.Tensor]:
        """Replica context: gradients and loss summed over the step's micro-batches.

        Each micro-batch's loss is already divided by the *global* batch, so the sums
        equal the gradients and loss of the whole step's batch.
        """
        if self.accumulation_steps == 1:
            gradients, loss, outputs = compute(batch)
            self.task.update_metrics(self.train_metrics, batch[1], outputs)
            return list(gradients), loss
        variables = self.model.trainable_variables
        unused = set()  # indices of variables without a gradient: they stay None, not zero

        def micro_step(i, sums, loss):
            micro = tf.nest.map_structure(lambda t: t[i], batch)
            gradients, micro_loss, outputs = compute(micro)
            self.task.update_metrics(self.train_metrics, micro[1], outputs)
            new_sums = []
            for index, (total, gradient) in enumerate(zip(sums, gradients)):
                if gradient is None:
                    unused.add(index)
                    new_sums.append(total)
                else:  # IndexedSlices (embeddings) become dense sums
                    new_sums.append(total + tf.cast(tf.convert_to_tensor(gradient), total.dtype))
            return i + 1, new_sums, loss + tf.cast(micro_loss, tf.float32)

        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        _, sums, loss = tf.while_loop(
            lambda i, *_: i < self.accumulation_steps, micro_step,
            (tf.constant(0), zeros, tf.constant(0.0, tf.float32)))
        return [None if i in unused else s for i, s in enumerate(sums)], loss

    def _replica_eval_step(self, batch: Any) -> dict[str, tf.Tensor]:
        return self.task.eval_step(batch, self.model, self.eval_metrics, self.global_batch_size)

    def _make_loop(self, replica_step: Callable, count_steps: bool) -> Callable:
        """Compiles `num_steps` steps into one tf.function (a `tf.range` host loop).

        The first step is peeled so the accumulators get the step's log structure;
        later steps stop cleanly when the data ends (`get_next_as_optional`), so a
        partial loop is never replayed. Returns (summed logs, steps run, seconds
        spent waiting for input).

        Input wait: one fetch (`get_next`) per step, or per `steps_per_fetch` steps
        when training, bracketed by two timestamps. The loop body of the previous
        step has finished when the first runs (a while-loop iteration starts once
        the last one's stateful ops are done); the second runs once the batch is
        there, and the step's ops wait for it, so the executor cannot slip the
        step's work in between. The difference is the time the loop was blocked on
        input, including the fetch's own hand-off cost.
        """
        # Host-mode training fetches groups (see `_fetch_groups`), even of one step.
        grouped = count_steps and self.input_mode == "host"
        fetch = self.steps_per_fetch if grouped else 1

        def one_step(batch):
            logs = self._reduce(self.strategy.run(replica_step, args=(batch,)))
            if count_steps:  # outside strategy.run: a mirrored counter diverges inside it
                self.step.assign_add(1)
                self.guard.observe(logs, self.step)
            return logs

        def timed_next(iterator):
            """(has_value, value, seconds waited, tensor the batch must wait for)."""
            def next_value():
                if not grouped:
                    return self._next(iterator)
                optional = iterator.get_next_as_optional()
                return optional.has_value(), optional
            if _op_determinism():  # tf.timestamp is refused under op determinism
                has_value, value = next_value()
                return has_value, value, tf.constant(0.0, tf.float64), has_value
            start = tf.timestamp()
            has_value, value = next_value()
            with tf.control_dependencies([has_value]):
                end = tf.timestamp()
            return has_value, value, end - start, end

        def batches_of(value, ready):
            """The fetched group of batches (host training), else the step's batch."""
            with tf.control_dependencies([ready]):
                return value.get_value() if grouped else self._distribute(value)

        def first_step(batches):
            return one_step(self._distribute_from_group(batches, tf.constant(0))
                            if grouped else batches)

        def steps_on(batches, totals, steps, first):
            """Runs the steps of one fetch from step `first` on; returns the new sums."""
            if fetch == 1:
                if first == 0:
                    totals = tf.nest.map_structure(tf.add, totals, first_step(batches))
                    steps += 1
                return totals, steps
            for j in tf.range(first, fetch):
                totals = tf.nest.map_structure(
                    tf.add, totals, one_step(self._distribute_from_group(batches, j)))
                steps += 1
            return totals, steps

        @tf.function
        def loop(iterator, num_steps):
            has_value, value, input_wait, ready = timed_next(iterator)
            with tf.control_dependencies([tf.debugging.Assert(has_value, [EXHAUSTED])]):
                batches = batches_of(value, ready)
                totals = first_step(batches)
                steps = tf.constant(1, tf.int32)
                totals, steps = steps_on(batches, totals, steps, first=1)
            for _ in tf.range(num_steps // fetch - 1):
                if self._stop_requested(count_steps):  # before taking the next batch
                    break
                has_value, value, waited, ready = timed_next(iterator)
                input_wait += waited
                if not has_value:
                    break
                totals, steps = steps_on(batches_of(value, ready), totals, steps, first=0)
            return totals, steps, input_wait

        return loop

    # ------------------------------------------------------------------- loops

    def run_loop(self, num_steps: int) -> tuple[dict[str, float], int, float]:
        """Runs up to `num_steps` train steps in one compiled call (no cadence, no
        actions): (mean logs and train metrics, steps run, seconds waiting for input).
        `Controller` calls it; tools that time the raw loop (diagnose) too."""
        if self._train_loop_fn is None:
            self._train_step_fn = self._build_train_step()
            self._train_loop_fn = self._make_loop(self._replica_train_step, count_steps=True)
        for metric in self.train_metrics:
            metric.reset_state()
        totals, steps, input_wait = self._train_loop_fn(
            self._train_iterator, tf.constant(num_steps, tf.int32))
        steps = int(steps)
        logs = {name: float(value) / steps for name, value in totals.items()}
        logs.update({m.name: float(m.result()) for m in self.train_metrics})
        return logs, steps, float(input_wait)

    _train_loop = run_loop  # the name diagnose/benchmarks used before run_loop was public

    def next_boundary(self, step: int) -> int:
        """Steps until the next loop end: steps_per_loop, eval, checkpoint or the end."""
        limits = [self.steps_per_loop, self.train_steps - step,
                  self.checkpoint_every - step % self.checkpoint_every]
        if self.eval_every:
            limits.append(self.eval_every - step % self.eval_every)
        if self.profile_steps:  # the trace covers exactly [start, stop)
            limits += [b - step for b in self.profile_steps if b > step]
        return max(1, min(limits))

    # ------------------------------------------------------- MFU and profiling

    def _count_flops_per_step(self) -> float:
        """Training FLOPs of one step over all replicas (see `tputrain.flops`)."""
        analytic = self.task.flops_per_example()
        if analytic is not None:
            return float(analytic) * self.global_batch_size
        if self._custom_train_step:
            raise ValueError(f"{type(self.task).__name__} overrides Task.train_step: return an "
                             "analytic count from Task.flops_per_example()")
        per_micro_batch = count_flops(
            lambda batch: self.task.compute_gradients(batch, self.model, self.optimizer,
                                                      self.global_batch_size),
            specs_of(self._micro_batch_spec()))
        return float(per_micro_batch * self.accumulation_steps
                     * self.strategy.num_replicas_in_sync)

    def _setup_mfu(self) -> None:
        """Counts FLOPs per step and finds the peak once; MFU is then logged each loop."""
        if not self.report_mfu or self.flops_per_step is not None:
            return
        try:
            self.flops_per_step = self._count_flops_per_step()
            peak = peak_flops(self.precision, self.strategy)
        except Exception as error:  # pylint: disable=broad-except  (a diagnostic, not training)
            logging.warning("tputrain: MFU is not reported: %s: %s", type(error).__name__, error)
            self.report_mfu = False
            return
        self.progress.set_flops(self.flops_per_step, peak.flops_per_second)
        logging.info("tputrain: %.4g FLOPs per step; peak %.4g FLOP/s (%s)",
                     self.flops_per_step, peak.flops_per_second, peak.source)

    @property
    def current_step(self) -> int:
        """The global step (optimizer updates done), as a Python int."""
        return int(self.step.numpy())

    def train(self, num_steps: int | None = None) -> dict[str, float]:
        """Trains `num_steps` more steps (None: up to `train_steps`), resuming from the
        latest checkpoint in model_dir; evaluates and saves on the configured cadence
        and at the end, and returns the last evaluation's metrics.
        """
        self.checkpointer.restore_latest()
        step = self.current_step
        if num_steps is not None:
            check_int("Trainer.train", "num_steps", num_steps, 1)
        until = self.train_steps if num_steps is None else step + int(num_steps)
        if step >= until:
            logging.info("tputrain: %s is at step %d >= train_steps %d; nothing to train",
                         self.model_dir, step, self.train_steps)
            return self.evaluate_weights()
        if step % self.steps_per_fetch:
            raise ValueError(
                f"the checkpoint in {self.model_dir} is at step {step}, not a multiple of "
                f"Trainer.steps_per_fetch={self.steps_per_fetch}: resume with a "
                "steps_per_fetch that divides it (e.g. 1)")
        if self.input_mode == "distributed":
            self._train_iterator = self._distributed_iterator("train", skip_steps=step)
        logging.info("tputrain: training from step %d to %d", step, until)
        self._setup_mfu()
        self._preemption.install()
        try:
            return Controller(self, self._actions()).run(until)
        finally:
            self.checkpointer.sync()  # an async write in flight completes before we return
            self._preemption.uninstall()
            self.progress.close()
            self._cleanup_worker_dir()

    def _actions(self) -> list[Action]:
        """The built-in actions (profiler, non-finite policy, preemption), then the user's."""
        built_in: list[Action] = []
        if self.profile_steps and self.is_chief:
            built_in.append(ProfilerAction(*self.profile_steps, os.path.join(self.model_dir, "train")))
        return built_in + [NonFinitePolicyAction(), PreemptionAction()] + self.actions

    def evaluate(self) -> dict[str, float]:
        """Restores the latest checkpoint of model_dir, then evaluates it (see
        `evaluate_weights`); says so when there is none and the weights are the
        initial ones."""
        path = self.checkpointer.restore_latest()
        if path is None:
            logging.warning("tputrain: no checkpoint in %s: evaluating the initial (untrained) "
                            "weights", self.model_dir)
        logs = self.evaluate_weights()
        for action in self.actions:
            action.on_eval_end(self, self.current_step, logs)
        return logs

    def evaluate_weights(self) -> dict[str, float]:
        """Evaluates the weights in memory on the eval split; returns {"loss": ..., metrics}.

        The eval iterator is created once and reused (freeing tf.data iterators can
        block for seconds); each evaluation sees the same `eval_steps` batches, or the
        whole finite eval split when eval_steps is None. Every host runs the same
        number of steps (the most any host needs); hosts with fewer batches pad with
        zero-weight batches, so uneven shards neither hang a pod nor skew the mean.
        """
        if self._eval_loop_fn is None:
            self._build_eval()
        for metric in self.eval_metrics:
            metric.reset_state()
        with Stopwatch() as watch:
            totals, steps, _ = self._eval_loop_fn(self._eval_iterator,
                                                  tf.constant(self._eval_batches, tf.int32))
            logs = _eval_means(totals, int(steps))
            logs.update({m.name: float(m.result()) for m in self.eval_metrics})
        self.progress.eval_done(self.current_step, logs, watch.seconds, int(steps))
        return logs

    def _build_eval(self) -> None:
        """Agrees on the eval step count across hosts; builds the eval iterator and loop."""
        weighted = self.num_hosts > 1 or _is_weighted(self._eval_dataset.element_spec)
        self._eval_batches = self._max_over_hosts(self._local_eval_steps(weighted))

        def prepare(dataset: tf.data.Dataset, replicas: int) -> tf.data.Dataset:
            """`replicas` per-replica batches a step, `_eval_batches` steps, repeated."""
            return _padded(_with_weights(dataset) if weighted else dataset).take(
                self._eval_batches * replicas).repeat()

        if self.input_mode == "distributed":
            self._eval_iterator = iter(self.strategy.distribute_datasets_from_function(
                lambda c: prepare(self.task.build_inputs("eval", self._input_context(c)),
                                  _replicas_per_pipeline(c))))
        else:
            self._eval_iterator = iter(prepare(self._eval_dataset, self.local_replicas))
        self._eval_loop_fn = self._make_loop(self._replica_eval_step, count_steps=False)

    def _local_eval_steps(self, padded: bool) -> int:
        """Steps this host's eval split fills: `eval_steps`, or all of its batches (the
        last step topped up with zero-weight batches when `padded`)."""
        if self.eval_steps is not None:
            return int(self.eval_steps)
        count = int(self._eval_dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
        steps = -(-count // self.local_replicas) if padded else count // self.local_replicas
        if steps < 1 and self.num_hosts == 1:
            raise ValueError(
                f"the eval split has {count} per-replica batches, fewer than the "
                f"{self.local_replicas} local replicas: use a smaller global batch, "
                "more eval data, or pad the eval split (TFRecordInput.pad_remainder)")
        return steps

    def _max_over_hosts(self, value: int) -> int:
        """The largest `value` any host passes: a collective, every host must call it."""
        if self.num_hosts == 1:
            return value
        if self._max_over_hosts_fn is None:
            # ReduceOp has no MAX: gather every replica's value, then take the largest.
            self._max_over_hosts_fn = tf.function(lambda v: tf.reduce_max(self.strategy.gather(
                self.strategy.run(lambda x: tf.reshape(x, [1]), args=(v,)), axis=0)))
        return int(self._max_over_hosts_fn(tf.constant(value, tf.int64)))

    def _cleanup_worker_dir(self) -> None:
        if not self.is_chief:
            shutil.rmtree(self._work_dir, ignore_errors=True)

    # ------------------------------------------------------ fault tolerance

    def _preflight(self) -> None:
        """Chief, before the first write: is the checkpoint there this model's, and can
        model_dir take checkpoints (writable, room for keep + 1 of them, the data
        iterator's state included)?"""
        self.checkpointer.check_compatible()
        size = variable_bytes(self.model.variables) + variable_bytes(self.optimizer.variables)
        if self.input_mode == "host":  # the iterator is checkpointed: shuffle buffers and all
            size += iterator_state_bytes(self._fetch_groups(self._train_dataset))
        check_model_dir(self.model_dir, size, keep=self.checkpointer.keep)
        lock_model_dir(self.model_dir)  # one run per model_dir, until this process ends

    def _stop_requested(self, count_steps: bool) -> Any:
        """In the compiled train loop: stop before the next step (guard or SIGTERM)?

        Several hosts must stop at the same step, so they honour SIGTERM at loop
        boundaries only (`_preempted` agrees on it with an all-reduce).
        """
        if not count_steps:
            return False
        stop = self.guard.should_stop()
        if self.num_hosts == 1:
            stop = tf.logical_or(stop, self._preemption.flag.read_value())
        return stop

    def _preempted(self) -> bool:
        """Whether any host was asked to stop (all hosts then stop at this step)."""
        return self._max_over_hosts(int(self._preemption.requested)) > 0

    def guard_logs(self) -> dict[str, float]:
        """`nonfinite_steps` for the logs, once any step was non-finite."""
        count = int(self.guard.nonfinite_steps.numpy())
        return {"nonfinite_steps": float(count)} if count else {}

    def apply_nonfinite_policy(self, step: int) -> None:
        """After a loop: raise or roll back if the guard tripped (NonFiniteGuard.policy)."""
        tripped = self.guard.take_trip()
        if not tripped:
            return
        if self.guard.policy == "raise":
            raise NonFiniteError(self.guard.message(tripped))
        self.guard.rollbacks += 1
        if self.guard.rollbacks > self.guard.max_rollbacks:
            raise NonFiniteError(self.guard.message(tripped, gave_up=True))
        path = self.checkpointer.restore_weights(exclude=("iterator", "step", "nonfinite_steps"))
        if path is None:
            raise NonFiniteError(self.guard.message(tripped, no_checkpoint=True))
        logging.warning("tputrain: non-finite step %d: rolled the weights back to %s "
                        "(rollback %d of %d); the data continues from step %d", tripped,
                        path, self.guard.rollbacks, self.guard.max_rollbacks, step)

    def stop_if_preempted(self, step: int) -> None:
        """After a loop: if any host got SIGTERM, save and raise `Preempted` (exit 42)."""
        if self._preempted():
            path = self.checkpointer.save()
            preempted = Preempted(step, path)
            logging.warning("tputrain: %s", preempted)
            raise preempted
