"""The Trainer: builds a run from a Task (strategy -> precision -> inputs -> model,
optimizer, metrics in `strategy.scope()` -> checkpoints) and runs its compiled loops.

A *step* is one optimizer update on one global batch; a *loop* is up to
`steps_per_loop` steps in one `tf.function` call. Where the parts live: inputs
`loop/inputs.py`, the step `loop/step.py`, the host loop `loop/host_loop.py`,
evaluation `loop/evaluation.py`, when to evaluate and save `controller.py`,
checkpoints `checkpointing/`, knobs `options.py` (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Any, Mapping, Sequence

import keras
import tensorflow as tf
from absl import logging

from tputrain.actions import (Action, CommunicationAction, MFUAction, NonFinitePolicyAction,
                              PreemptionAction, ProfilerAction, check_actions,
                              checkpointed_states)
from tputrain.jobs.aggregation import with_aggregates
from tputrain.keras_task import KerasTask
from tputrain.core.builders import configured
from tputrain.checkpointing.manager import Checkpointer
from tputrain.checkpointing.config_owned import ConfigOwned
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.checkpointing.model_variables import model_trackables
from tputrain.checkpointing.seeds import seed_generator_states
from tputrain.loop import compile_cache
from tputrain.core.checks import check_int
from tputrain.distribution.communication import CommunicationOptions
from tputrain.actions.config_summary import ConfigSummaryAction
from tputrain.runtime.context import ActionContext, ActionList
from tputrain.observe.console import default_progress
from tputrain.runtime.controller import Controller
from tputrain.distribution.strategy import resolve_strategy
from tputrain.optim.ema import averaged_weights, build_average
from tputrain.observe.goodput import GoodputAction, StartupClock, timed
from tputrain.fault_tolerance.guard import NonFiniteGuard
from tputrain.checkpointing.input_layout import LayoutChange
from tputrain.loop.host_loop import train_loop
from tputrain.loop.plan_trial import TrialRun, chosen_plan
from tputrain.loop.hosts import MaxOverHosts
from tputrain.loop.inputs import Inputs
from tputrain.loop.replica_stats import ReplicaStatistics
from tputrain.loop.source_counts import checkpointed, source_logs
from tputrain.loop.step import StepBuilder
from tputrain.loop.labels import check_first_labels
from tputrain.runtime.model_state import ModelState, build_model_state
from tputrain.options import (CheckpointOptions, PrecisionOptions, ProfilingOptions, RematOptions,
                              TrainerOptions)
from tputrain.runtime.plan import RESOLVED, RunPlan, resolve_plan
from tputrain.precision import resolve_precision
from tputrain.precision.policy import users_policy_kept
from tputrain.fault_tolerance.preemption import PreemptionWatcher
from tputrain.jobs.predict import predict as predict_outputs
from tputrain.runtime.preflight import preflight
from tputrain.observe.progress import Progress, summary_root
from tputrain.observe.progress_bar import ProgressBarAction
from tputrain.runtime.run_view import RunView
from tputrain.task import Task, overrides_train_step
from tputrain.runtime.trainable_change import TrainableSet
from tputrain.tuning.report import with_trial_report
from tputrain.runtime.validate import check_split_names, check_splits, named_splits, reading_input


def _planned(name: str) -> property:
    """`trainer.<knob>`: the value the run uses, read from its plan (not a copy).
    Setting one the strategy does not decide (e.g. `train_steps` in a notebook before
    another train()) re-validates the options and the plan follows."""
    def set_option(self: "Trainer", value: Any) -> None:
        if name in RESOLVED:
            raise AttributeError(f"Trainer.{name} is resolved at construction "
                                 f"({self.plan.options_note(name)}): build a new Trainer")
        self.options = dataclasses.replace(self.options, **{name: value})
        self.plan = dataclasses.replace(self.plan, options=self.options)
        self.context.plan = self.plan
        self.context.options = self.options
    return property(lambda self: getattr(self.plan, name), set_option, doc=f"plan.{name}")


def _from_context(name: str) -> property:
    """Run state the actions share: read and written through the context."""
    return property(lambda self: getattr(self.context, name),
                    lambda self, value: setattr(self.context, name, value))


def _configured_strategy(communication: CommunicationOptions) -> tf.distribute.Strategy:
    """The gin-configured resolver when the gin registry is loaded (`resolve_strategy.*`
    bindings apply; tputrain/core/builders.py), else the plain one."""
    return configured("resolve_strategy", resolve_strategy)(communication=communication)


def _check_arguments(task: Task, model_dir: str) -> None:
    if not isinstance(task, Task):
        raise TypeError(f"Trainer.task must be a tputrain.Task, got {type(task).__name__}")
    if not model_dir:
        raise ValueError("Trainer.model_dir is empty: pass --model_dir or bind Trainer.model_dir")


def _known_batch(task: Task) -> int | None:
    """The global batch a KerasTask's data comes in (`KerasTask.global_batch_size`), or
    None for a Task that builds batches of any size."""
    known = task.global_batch_size if isinstance(task, KerasTask) else None
    return None if known is None else int(known)


def _task_batch(task: Task) -> int:
    """The task's known global batch, else TrainerOptions' default."""
    known = _known_batch(task)
    return TrainerOptions.global_batch_size if known is None else known


def _check_task_batch(task: Task, global_batch_size: int) -> None:
    """A KerasTask's batch is its data's, as under `model.fit`: another one is refused."""
    known = _known_batch(task)
    if known is not None and known != global_batch_size:
        raise ValueError(f"Trainer.global_batch_size={global_batch_size} but the task's data "
                         f"comes in batches of KerasTask.global_batch_size={known}: pass "
                         f"global_batch_size={known} (or none), or batch the data in "
                         f"{global_batch_size}")


def _build_inputs(task: Task, strategy: tf.distribute.Strategy, plan: Any) -> Inputs:
    """The host's inputs; an eval set the Task has no data for is one line (the Task's
    `splits`, or a KeyError naming the set while they are built)."""
    eval_splits = plan.options.eval_splits
    check_split_names(task, eval_splits)
    with named_splits(task, eval_splits):
        return Inputs(task, strategy, plan)

def _built_loop(trainer: "Trainer") -> tuple[Any, int]:
    """The compiled train loop for the step's plan, and its steps per program."""
    return train_loop(trainer._steps, trainer.inputs, trainer.plan, trainer.step, trainer.guard,
                      trainer.ema, trainer._stop_requested,
                      lambda: trainer.progress.ideal_step_seconds)


def _tried_plans(trainer: "Trainer") -> tuple[Any, int] | None:
    """plan_trial: the XLA plan model_dir's record or the trial picks, before the loop
    is built (tputrain/loop/plan_trial.py), and its loop if the trial built it last;
    the trial's time is compile time (goodput)."""
    until, ema, inputs = trainer._until, trainer.ema, trainer.inputs
    stand_in, trainer._first_train_batch = trainer._first_train_batch, None  # the trial's only
    trial = TrialRun(trainer._steps, lambda: _built_loop(trainer),
                     lambda: inputs.stand_in_iterator(stand_in),
                     [trainer.step, *(ema.averages + [ema.state.updates] if ema else [])])
    choice = chosen_plan(trial, inputs.train_dataset.element_spec, trainer.model_dir,
                         trainer.num_hosts, None if until is None else until - trainer.current_step,
                         lambda: timed(trainer.context, "compile"), trainer.current_step)
    if choice is None:
        return None
    trainer._steps.run_plan = dataclasses.replace(trainer._steps.run_plan, xla_plan=choice.plan)
    return choice.loop


def _position_input(trainer: "Trainer", step: int) -> None:
    """The train iterator at `step`'s data position where no saved one restored it,
    from the recorded layout and its host history: distributed mode's (built there
    if positional, else skipping the consumed batches), and a positional input's in
    host mode (built there, unless it already is)."""
    layout, inputs = trainer.checkpointer.recorded_layout, trainer.inputs
    if trainer.input_mode == "distributed":
        trainer._train_iterator = inputs.distributed_iterator(
            "train", skip_steps=layout.input_steps(step), layout_history=layout.history())
    elif inputs.positional_train and step != trainer._input_step:
        trainer._train_iterator = inputs.positioned_iterator(layout, step)
        trainer._input_step = step


def _input_step_after(trainer: "Trainer", steps: int) -> int | None:
    """The step the host iterator is at after a loop of `steps`: it reads whole
    fetches, so None (unknown) when a stop cut one short."""
    known = trainer._input_step is not None and steps % trainer.plan.steps_per_fetch == 0
    return trainer._input_step + steps if known else None


class RunKnobs:
    """The Trainer's knobs as the run uses them, read from its plan (`options` are the
    user's), and the run state the actions share, read through their context."""

    plan: RunPlan
    context: ActionContext | None

    train_steps = _planned("train_steps")
    steps_per_loop = _planned("steps_per_loop")
    global_batch_size = _planned("global_batch_size")
    eval_every = _planned("eval_every")
    eval_steps = _planned("eval_steps")
    checkpoint_every = _planned("checkpoint_every")
    keep_checkpoints = _planned("keep_checkpoints")
    seed = _planned("seed")
    accumulation_steps = _planned("accumulation_steps")
    profile_steps = _planned("profile_steps")
    steps_per_fetch = _planned("steps_per_fetch")
    class_weight = _planned("class_weight")
    input_mode = _planned("input_mode")
    precision = _planned("precision")
    jit_compile = _planned("jit_compile")
    steps_per_program = _planned("steps_per_program")
    checkpoint = _planned("checkpoint")
    profiling = _planned("profiling")
    ema_decay = _planned("ema_decay")
    num_hosts = property(lambda self: self.plan.batch.num_hosts)
    host_id = property(lambda self: self.plan.batch.host_id)
    local_replicas = property(lambda self: self.plan.batch.local_replicas)
    is_chief = property(lambda self: self.plan.is_chief)
    eval_splits = property(lambda self: self.plan.options.eval_splits)  # the eval sets' names
    stop_training = _from_context("stop_training")
    stop_reason = _from_context("stop_reason")
    flops_per_step = _from_context("flops_per_step")
    report_mfu = _from_context("report_mfu")


def _check_open(trainer: "Trainer", what: str) -> None:
    if trainer.closed:
        raise RuntimeError(f"Trainer.{what}: this Trainer is closed (Trainer.close or the "
                           "end of its `with` block): build a new Trainer")


def _run_view(trainer: "Trainer") -> RunView:
    """What a job reads of this run (tputrain/runtime/run_view.py), as it is now."""
    _check_open(trainer, "view")  # export, predict... of a closed one
    return RunView(
        task=trainer.task, model=trainer.model, optimizer=trainer.optimizer,
        strategy=trainer.strategy, inputs=trainer.inputs, plan=trainer.plan,
        model_dir=trainer.model_dir, checkpointer=trainer.checkpointer,
        progress=trainer.progress, ema=trainer.ema, actions=trainer.actions,
        communication=trainer.communication, step=trainer.step, agree=trainer.agree,
        evaluate_weights=trainer.evaluate_weights, run_loop=trainer.run_loop,
        set_train_iterator=trainer.set_train_iterator, train_iterator=trainer.train_iterator)


def _config_owned_rate(optimizer: Any, actions: Sequence[Action]) -> ConfigOwned:
    """A float learning rate is a variable: the config's value wins over the
    checkpoint's, unless an action sets it during the run (`Action.owns_learning_rate`),
    named by `learning_rate_setters` (a Keras callback's class) or its class."""
    setters = ", ".join(name for action in actions if action.owns_learning_rate
                        for name in getattr(action, "learning_rate_setters",
                                            [type(action).__name__]))
    return ConfigOwned([v for v in optimizer.variables if v.name == "learning_rate"],
                       set_by=setters)


class Trainer(RunKnobs, TrainableSet):

    """Trains a `Task` under a distribution strategy, with exact-resume checkpoints.

    Args:
      task: the user's model, data and loss.
      model_dir: checkpoints, TensorBoard events and the operative gin config.
      strategy: a `tf.distribute.Strategy`; None resolves one (`resolve_strategy`).
      guard: the NaN/Inf guard (`tputrain.NonFiniteGuard`); None: policy "raise".
      actions: `tputrain.Action`s, called at each loop, evaluation, save and the end.
      communication: all-reduce dtype and collective options (`CommunicationOptions`).
      The other keywords (train_steps, global_batch_size, precision, checkpoint...)
      are the fields of `tputrain.TrainerOptions`, documented there.
    """

    def __init__(self, task: Task, model_dir: str, strategy: tf.distribute.Strategy | None = None,
                 train_steps: int = 1000, steps_per_loop: int = 100,
                 global_batch_size: int | None = None, eval_every: int | None = None,
                 eval_steps: int | None = None, eval_splits: Sequence[str] = ("eval",),
                 checkpoint_every: int | None = None,
                 keep_checkpoints: int = 3, precision: str | PrecisionOptions | None = None, seed: int = 0,
                 input_mode: str | None = None, jit_compile: bool | str = "auto",
                 accumulation_steps: int = 1, profile_steps: tuple[int, int] | None = None,
                 report_mfu: bool = True, steps_per_fetch: int = 1,
                 steps_per_program: int | str = "auto", progress_bar: str = "auto",
                 class_weight: Mapping[int, float] | None = None,
                 guard: NonFiniteGuard | None = None, actions: Sequence[Action] = (),
                 communication: CommunicationOptions | None = None,
                 checkpoint: CheckpointOptions | None = None,
                 profiling: ProfilingOptions | None = None, ema_decay: float | None = None,
                 remat: str | RematOptions | None = None, plan_trial: bool | str = "auto"):
        self.options = TrainerOptions(
            train_steps=train_steps, steps_per_loop=steps_per_loop,
            global_batch_size=_task_batch(task) if global_batch_size is None else global_batch_size,
            eval_every=eval_every, eval_steps=eval_steps,
            eval_splits=eval_splits,
            checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
            precision=precision, seed=seed, input_mode=input_mode, jit_compile=jit_compile,
            accumulation_steps=accumulation_steps, profile_steps=profile_steps,
            report_mfu=report_mfu, steps_per_fetch=steps_per_fetch,
            steps_per_program=steps_per_program, class_weight=class_weight, progress_bar=progress_bar,
            checkpoint=checkpoint, profiling=profiling, ema_decay=ema_decay, remat=remat,
            plan_trial=plan_trial)
        _check_arguments(task, model_dir)
        _check_task_batch(task, self.options.global_batch_size)
        self.actions = with_trial_report(check_actions(actions))  # tuning/report.py
        self.startup = StartupClock()  # goodput.py
        self._closed = False
        self.context: ActionContext | None = None  # once the checkpointer is built
        default_progress()  # a plain Python script shows progress, as the CLI does
        self.task = task
        self.model_dir = model_dir
        self.communication = communication or CommunicationOptions()
        self.strategy = strategy or _configured_strategy(self.communication)
        with users_policy_kept():  # the run's precision policy only while it builds
            self.plan = self.startup.mark("strategy", resolve_plan(
                self.options, self.strategy, lambda: resolve_precision(self.options.precision.policy, self.strategy),
                overrides_train_step(task), type(task).__name__))
            self._max_over_hosts = MaxOverHosts(self.strategy, self.num_hosts)
            keras.utils.set_random_seed(self.seed)
            compile_cache.report()  # set when tputrain was imported
            self.inputs = _build_inputs(task, self.strategy, self.plan)
            first = self.startup.mark("data", check_splits(self.inputs, self.eval_splits,
                                                           self.eval_steps))
            self._first_train_batch = first.get("train")  # the plan trial's stand-in batch
            state = self._build_model(guard, first)
            self._build_checkpointer()
            self._build_step(state)
            self._build_evaluator()
        logging.info("tputrain: %s, %s, XLA %s", type(self.strategy).__name__, self.plan.summary(), self.plan.xla)

    def _build_model(self, guard: NonFiniteGuard | None, first: Any) -> ModelState:
        """The model and what updates it, in the strategy's scope (model_state.py); the
        labels of the splits' `first` batches checked against it; its weights' EMA."""
        state = self.startup.mark("model", build_model_state(
            self.task, self.strategy, self.inputs.micro_batch_spec()[0],
            self.options.precision.keep_float32_layers, guard, self.options.remat))
        self.model = state.model
        self.optimizer = state.optimizer
        self.train_metrics = state.train_metrics
        self.eval_metrics = state.eval_metrics
        self.step = state.step
        self.guard = state.guard
        check_first_labels(first, self.model, self.task, self.inputs)  # tputrain/loop/labels.py
        self.ema = build_average(self.strategy, self.model, self.options.ema_decay)  # ema.py
        return state

    def _build_step(self, state: ModelState) -> None:
        """The plan's XLA decision for the built model, then the step that reads it."""
        train_spec = self.inputs.train_dataset.element_spec
        counter = self.inputs.source_counter
        self.plan = self.plan.with_xla(self.strategy, self.model, self.optimizer, train_spec,
                                       counter.key if counter is not None else None)
        self._steps = StepBuilder(self.plan, self.task, state, self.strategy, train_spec,
                                  self.communication.allreduce_dtype, counter)
        self._launch(self.plan.steps_per_program)

    def _launch(self, steps_per_program: int | str) -> None:
        """The plan with what building the step decided (the context sees it too)."""
        self.plan = self.plan.launched(self._steps.run_plan, steps_per_program)
        self.context.plan = self.plan

    def _context(self) -> ActionContext:
        """What the actions see of this run (tputrain/runtime/context.py)."""
        return ActionContext(
            step_variable=self.step, agree=self._max_over_hosts, preempted=self.preempted,
            strategy=self.strategy, model=self.model, optimizer=self.optimizer,
            checkpointer=self.checkpointer, progress=self.progress, plan=self.plan,
            task=self.task, guard=self.guard, inputs=self.inputs, model_dir=self.model_dir,
            train_metrics=self.train_metrics, eval_metrics=self.eval_metrics,
            actions=self.actions, startup=self.startup, options=self.options,
            report_mfu=self.options.report_mfu, ema=self.ema, view=self.view)

    def _build_checkpointer(self) -> None:
        """Checkpoints (the chief's; other workers write a temp dir), pre-flight, progress."""
        self._work_dir = (self.model_dir if self.is_chief  # the others take part in saves
                          else tempfile.mkdtemp(prefix="tputrain-worker-"))
        self._train_iterator = None
        self._train_loop_fn = None
        self._until: int | None = None  # the step train() trains to (the plan trial's)
        self._replica_stats: ReplicaStatistics | None = None
        if self.input_mode == "host":  # each host's own data position
            self._train_iterator = iter(self.inputs.fetch_groups(self.inputs.train_dataset))
        self._input_step: int | None = 0  # the step the host iterator is at (None: unknown)
        self.checkpointer = self._new_checkpointer(self.inputs.saved_state(self._train_iterator))
        self._preemption = PreemptionWatcher()  # SIGTERM -> stop at a step boundary
        self._communication = CommunicationAction(self.communication)  # timed once
        self.progress = Progress.for_run(summary_root(self._work_dir) if self.is_chief else None,
                                         self.plan)
        self.context = self._context()
        if self.is_chief:  # inputs are checked; nothing has been written yet
            self._preflight()

    def _new_checkpointer(self, per_host: dict[str, Any]) -> Checkpointer:
        """The checkpoint of the model, its optimizer, EMA, step and data position."""
        return Checkpointer(
            RunDirectory(self._work_dir).checkpoints, self.step, every=self.checkpoint_every,
            restore_directory=RunDirectory(self.model_dir).checkpoints,  # the chief's
            config_owned=_config_owned_rate(self.optimizer, self.actions),
            keep=self.keep_checkpoints, per_host=per_host, host=(self.host_id, self.num_hosts),
            barrier=lambda: self._max_over_hosts(0), input_layout=self.inputs.layout(),
            reposition=self._reposition_input, action_state=checkpointed_states(self.actions),
            **model_trackables(self.model), optimizer=self.optimizer,  # "model" first: its keys
            seeds=seed_generator_states(self.model), nonfinite_steps=self.guard.nonfinite_steps,
            **({"ema": self.ema.state} if self.ema else {}), **checkpointed(
                self.inputs.source_counter), async_save=self.checkpoint.async_save,
            check_finite=self.checkpoint.check_finite)  # (a mixture's per-source counts)

    def _preflight(self) -> None:
        """The chief's checks and lock before its first write (tputrain/runtime/preflight.py);
        `sidecar.ReadOnlyTrainer` overrides it: it reads beside the lock's holder."""
        preflight(self.context)

    def _reposition_input(self, change: LayoutChange) -> None:
        """The checkpoint's iterator was saved for other batches (another layout): the
        fresh one is read past the examples consumed instead, and the log says so."""
        self.plan.check_resume_step(change.step, self.model_dir)
        skipped = self.inputs.read_past(self._train_iterator, change)
        logging.warning("tputrain: %s", change.recovered(skipped))

    # ------------------------------------------------------------ public API

    @property
    def current_step(self) -> int:  # the global step (optimizer updates done)
        return int(self.step.numpy())

    @property
    def train_iterator(self) -> Any:
        """The iterator the next loop reads (None before train() in distributed mode)."""
        return self._train_iterator

    view = _run_view  # what a job (predict, export, diagnose...) reads of this run

    def agree(self, value: int) -> int:
        """The largest `value` over all hosts (a collective: every host calls it)."""
        return self._max_over_hosts(value)

    def close(self) -> None:
        """Releases this Trainer's input iterators now (freeing a tf.data iterator can block:
        a sweep or notebook pays it here, not at random later). Idempotent; train() then raises."""
        if self._closed:
            return
        self.checkpointer.sync()  # an async write of the iterator completes first
        # The checkpointer's tf.train.Checkpoint holds the host iterator: all go now.
        self._closed = True
        self._train_iterator = None
        self._train_loop_fn = None
        self.checkpointer = self.context.checkpointer = None
        self._evaluator.close()

    closed = property(lambda self: self._closed)  # close() was called

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # This host's train dataset, as build_inputs returned it.
    train_dataset = property(lambda self: self.inputs.train_dataset)

    def set_train_iterator(self, iterator: Any) -> None:
        """Trains from `iterator` instead of the Task's (not checkpointed; for tools)."""
        self._train_iterator = iterator
        self._input_step = None  # a positional input is built at the step again

    def train(self, num_steps: int | None = None) -> dict[str, float]:
        """Trains `num_steps` more steps (None: up to `train_steps`), resuming from the
        latest checkpoint in model_dir; evaluates and saves on the configured cadence
        and at the end, and returns the last evaluation's metrics."""
        _check_open(self, "train")
        self._restore_latest()
        step = self.current_step
        if num_steps is not None:
            check_int("Trainer.train", "num_steps", num_steps, 1)
        until = self.train_steps if num_steps is None else step + int(num_steps)
        if step >= until:
            logging.info("tputrain: %s is at step %d >= train_steps %d; nothing to train",
                         self.model_dir, step, self.train_steps)
            return Controller(self, self._actions()).complete(step)
        self.plan.check_resume_step(step, self.model_dir)
        self._count_eval_sets()  # a corrupt eval record fails now, not at an evaluation
        _position_input(self, step)
        logging.info("tputrain: training from step %d to %d", step, until)
        self._until = until
        self._preemption.install()
        try:
            return Controller(self, self._actions()).run(until)
        finally:
            self.checkpointer.sync()  # an async write in flight completes before we return
            self._preemption.uninstall()
            self.progress.close()
            if not self.is_chief:
                shutil.rmtree(self._work_dir, ignore_errors=True)

    def _actions(self) -> list[Action]:
        """The built-in actions (goodput first: tputrain/observe/goodput.py), then the user's."""
        built_in: list[Action] = [GoodputAction(), ConfigSummaryAction(),
                                  self._communication]
        built_in += [MFUAction()] if self.report_mfu else []
        if self.profile_steps and self.is_chief:
            logdir = os.path.join(summary_root(self.model_dir), "train")  # beside the events
            built_in.append(ProfilerAction(*self.profile_steps, logdir))
        return built_in + [NonFinitePolicyAction(), PreemptionAction(), ProgressBarAction()] + self.actions

    def evaluate(self) -> dict[str, float]:
        """Restores the latest checkpoint of model_dir, then evaluates it; says so when
        there is none and the weights are the initial ones."""
        _check_open(self, "evaluate")
        if self._restore_latest() is None:
            logging.warning("tputrain: no checkpoint in %s: evaluating the initial (untrained) "
                            "weights", self.model_dir)
        logs = self.evaluate_weights()
        ActionList(self.context, self.actions).call("on_eval_end", self.current_step, logs)
        return logs

    def predict(self, source: Any = "eval", log_every: int = 100) -> Any:
        """The latest checkpoint's float32 outputs, each example once, in order: a split,
        a TFRecord glob, NumPy arrays or a dataset of batches (predict.py)."""
        _check_open(self, "predict")
        return predict_outputs(self.view(), source, log_every)

    def evaluate_weights(self) -> dict[str, float]:
        """Evaluates the weights in memory (their EMA with `ema_decay`): {"loss": ...}."""
        _check_open(self, "evaluate_weights")
        with (averaged_weights(self.ema) as averaged, compile_cache.reading(self, "eval"),
              reading_input("eval", f"at the evaluation of step {self.current_step}")):
            return self._evaluator.run(self.progress, self.current_step, averaged,
                                       lambda split, result: with_aggregates(self.view(), *result, split))

    def run_loop(self, num_steps: int) -> tuple[dict[str, float], int, float]:
        """Runs up to `num_steps` train steps in one compiled call (no cadence, no
        actions): (mean logs and train metrics, steps run, seconds waiting for input)."""
        _check_open(self, "run_loop")
        if self._train_loop_fn is None:
            self._train_loop_fn, program_steps = _tried_plans(self) or _built_loop(self)
            self._launch(program_steps)  # jit_compile "auto" -> False if XLA refused the step
        for metric in self.train_metrics:
            metric.reset_state()
        if self._replica_stats is None:  # the model is built (ensure_built)
            self._replica_stats = ReplicaStatistics(self.strategy, self.model)
        self._replica_stats.begin()
        totals, steps, input_wait = self._train_loop_fn(self._train_iterator, num_steps)
        self._input_step = _input_step_after(self, int(steps))
        self._replica_stats.average()  # copies made one (or refused) before a save or eval
        return _loop_logs(self, totals, int(steps)), int(steps), float(input_wait)

    def _stop_requested(self) -> Any:
        """In the compiled loop: stop before the next step (guard trip or SIGTERM)? Several
        hosts stop at loop boundaries only, agreed by `preempted()`."""
        stop = self.guard.should_stop()
        if self.num_hosts == 1:
            stop = tf.logical_or(stop, self._preemption.flag.read_value())
        return stop

    def preempted(self) -> bool:
        """Whether any host was asked to stop (a collective: all hosts then stop here)."""
        return self._max_over_hosts(int(self._preemption.requested)) > 0


def _loop_logs(trainer: Trainer, totals: dict[str, Any], steps: int) -> dict[str, float]:
    """A train loop's logs: the step logs' means, the train metrics and the source counts."""
    logs = {name: float(value) / steps for name, value in totals.items()}
    logs.update({m.name: float(m.result()) for m in trainer.train_metrics})
    return {**logs, **source_logs(trainer.inputs.source_counter)}
