"""What an action sees of a run: `ActionContext`, and `ActionList`, which calls
every action's hook in order.

Actions (built-in and the user's) get a context, not the Trainer: the step, the
strategy, model, optimizer, checkpointer and progress, the resolved plan, a way to
agree on a number across hosts and a way to stop the run with a reason. The
Trainer's other public attributes stay readable through it for a deprecation
period (a DeprecationWarning names the field to use instead).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import keras
import tensorflow as tf

# Trainer attributes a context read falls back to, and the context field to use.
REPLACEMENTS = {"current_step": "step", "steps_per_loop": "plan.steps_per_loop",
                "train_steps": "plan.train_steps", "eval_every": "plan.eval_every",
                "global_batch_size": "plan.batch.global_batch_size",
                "precision": "plan.precision", "input_mode": "plan.input_mode"}


class ActionContext:
    """The run as an action sees it; one per Trainer, shared by its actions.

    Attributes:
      strategy, model, optimizer, checkpointer, progress: the run's own objects.
      plan: the resolved `RunPlan` (batch, hosts, input mode, cadence).
      task, guard, inputs, train_metrics, eval_metrics, actions (the user's),
        model_dir, startup: what the built-in actions read.
      stop_training, stop_reason: set by `stop(reason)`; the Controller ends the
        run after the hook that set them.
      flops_per_step, report_mfu: the MFU action's count, and whether it reports.
      ema: the run's EMA weights (`tputrain.ema.ExponentialAverage`), or None.
    """

    def __init__(self, *, step_variable: tf.Variable, agree: Callable[[int], int],
                 preempted: Callable[[], bool], owner: Any = None, **fields: Any):
        object.__setattr__(self, "_owner", owner)
        self._step_variable, self._agree, self._preempted = step_variable, agree, preempted
        self.stop_training, self.stop_reason = False, None
        self.flops_per_step: float | None = None
        for name, value in fields.items():
            setattr(self, name, value)

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

    def __getattr__(self, name: str) -> Any:
        owner = self.__dict__.get("_owner")
        if name.startswith("_") or owner is None or not hasattr(owner, name):
            raise AttributeError(f"ActionContext has no attribute {name!r}")
        use = REPLACEMENTS.get(name)
        warnings.warn(f"an action read `{name}` of the Trainer through its context: "
                      + (f"use context.{use}" if use else "pass what the action needs to it"),
                      DeprecationWarning, stacklevel=2)
        return getattr(owner, name)


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
