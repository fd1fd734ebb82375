"""What an action sees of a run: `ActionContext`, and `ActionList`, which calls
every action's hook in order.

Actions (built-in and the user's) get a context, not the Trainer: the step, the
strategy, model, optimizer, checkpointer and progress, the resolved plan, a way to
agree on a number across hosts and a way to stop the run with a reason. Its fields
are written out below; nothing reads through to the Trainer. The Trainer's knobs
an action used to read through it (`REPLACEMENTS`) still answer, with a
DeprecationWarning naming the field to use instead.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import keras
import tensorflow as tf

if TYPE_CHECKING:  # annotations only
    from tputrain.checkpointing.manager import Checkpointer
    from tputrain.optim.ema import ExponentialAverage
    from tputrain.fault_tolerance.guard import NonFiniteGuard
    from tputrain.loop.inputs import Inputs
    from tputrain.options import TrainerOptions
    from tputrain.runtime.plan import RunPlan
    from tputrain.observe.progress import Progress
    from tputrain.runtime.run_view import RunView
    from tputrain.task import Task

# Trainer knobs an action read through its context, and the context field to use.
REPLACEMENTS = {"current_step": "step", "steps_per_loop": "plan.options.steps_per_loop",
                "train_steps": "plan.options.train_steps",
                "eval_every": "plan.options.eval_every",
                "global_batch_size": "plan.batch.global_batch_size",
                "precision": "plan.precision", "input_mode": "plan.input_mode"}


def _deprecated(name: str) -> property:
    """`context.<name>`, a Trainer knob once read through the context: the value of
    the field `REPLACEMENTS[name]`, with a warning naming it."""
    use = REPLACEMENTS[name]

    def read(self: "ActionContext") -> Any:
        warnings.warn(f"an action read `{name}` of the Trainer through its context: use "
                      f"context.{use}", DeprecationWarning, stacklevel=2)
        value: Any = self
        for part in use.split("."):
            value = getattr(value, part)
        return value
    return property(read, doc=f"Deprecated: `context.{use}`.")


class ActionContext:
    """The run as an action sees it; one per Trainer, shared by its actions.

    Attributes:
      strategy, model, optimizer, checkpointer, progress: the run's own objects.
      plan: the resolved `RunPlan` (batch, hosts, input mode, cadence); options:
        the user's `TrainerOptions` (`plan.options`).
      task, guard, inputs, train_metrics, eval_metrics, actions (the user's),
        model_dir, startup (`goodput.StartupClock`, whose module imports this one):
        what the built-in actions read.
      stop_training, stop_reason: set by `stop(reason)`; the Controller ends the
        run after the hook that set them.
      flops_per_step, report_mfu: the MFU action's count, and whether it reports.
      ema: the run's EMA weights (`tputrain.optim.ema.ExponentialAverage`), or None.
      view: the run's read-only `RunView` (for the jobs an action runs: export).
    """

    def __init__(self, *, step_variable: tf.Variable, agree: Callable[[int], int],
                 preempted: Callable[[], bool], strategy: tf.distribute.Strategy,
                 model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 checkpointer: Checkpointer | None, progress: Progress, plan: RunPlan,
                 task: Task, guard: NonFiniteGuard, inputs: Inputs, model_dir: str,
                 train_metrics: Sequence[keras.metrics.Metric],
                 eval_metrics: Sequence[keras.metrics.Metric], actions: Sequence[Any],
                 startup: Any, options: TrainerOptions, report_mfu: bool,
                 ema: ExponentialAverage | None, view: Callable[[], RunView]):
        self._step_variable, self._agree, self._preempted = step_variable, agree, preempted
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.checkpointer, self.progress, self.plan, self.options = (checkpointer, progress,
                                                                     plan, options)
        self.task, self.guard, self.inputs, self.model_dir = task, guard, inputs, model_dir
        self.train_metrics, self.eval_metrics = train_metrics, eval_metrics
        self.actions, self.startup, self.ema, self.view = actions, startup, ema, view
        self.report_mfu = report_mfu
        self.stop_training, self.stop_reason = False, None
        self.flops_per_step: float | None = None

    @property
    def step(self) -> int:
        """The global step (optimizer updates done)."""
        return int(self._step_variable.numpy())

    @property
    def step_variable(self) -> tf.Variable:
        return self._step_variable

    @property
    def is_chief(self) -> bool:
        return self.plan.is_chief

    @property
    def host_id(self) -> int:
        return self.plan.batch.host_id

    @property
    def num_hosts(self) -> int:
        return self.plan.batch.num_hosts

    def agree(self, value: int) -> int:
        """The largest `value` over all hosts (a collective: every host calls it)."""
        return self._agree(value)

    def preempted(self) -> bool:
        """Whether any host was asked to stop (a collective: every host calls it)."""
        return self._preempted()

    def stop(self, reason: str | None = None) -> None:
        """Ends the run after this hook (`reason` "preempted" saves and exits 42)."""
        self.stop_training, self.stop_reason = True, reason

    def reset_stop(self) -> None:
        self.stop_training, self.stop_reason = False, None

    # Deprecated: the Trainer's knobs, read through the context (REPLACEMENTS).
    current_step = _deprecated("current_step")
    steps_per_loop = _deprecated("steps_per_loop")
    train_steps = _deprecated("train_steps")
    eval_every = _deprecated("eval_every")
    global_batch_size = _deprecated("global_batch_size")
    precision = _deprecated("precision")
    input_mode = _deprecated("input_mode")


class ActionList:
    """The actions of a run in order; `call(hook, *args)` calls each one's hook with
    the context first, and `collect` merges what `loop_metrics` return."""

    def __init__(self, context: ActionContext, actions: Iterable[Any]):
        self.context = context
        self.actions = list(actions)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)

    def call(self, hook: str, *args: Any, only: Sequence[Any] | None = None) -> None:
        for action in self.actions if only is None else only:
            getattr(action, hook)(self.context, *args)

    def collect(self, *args: Any) -> dict[str, float]:
        logs: dict[str, float] = {}
        for action in self.actions:
            logs.update(action.loop_metrics(self.context, *args))
        return logs

    def where_not(self, question: str, *args: Any) -> list[Any]:
        """The actions whose `question` (eval_recorded, end_done) answers False."""
        return [a for a in self.actions if not getattr(a, question)(self.context, *args)]


def learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))
