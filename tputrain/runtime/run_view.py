"""What a job reads of a run: `RunView`, a read-only view the Trainer builds.

Predict, side-car evaluation, export, diagnose, the batch finder, aggregation,
advice and an init checkpoint's pre-flight take this view, not the Trainer: the
objects and the plan they read are written out here, so a reader (or an IDE) sees
what each job can touch, and none of them imports the Trainer (no import cycle).
The public functions that took a Trainer still take one (`view_of`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

import keras
import tensorflow as tf

if TYPE_CHECKING:  # annotations only
    from tputrain.checkpointing.manager import Checkpointer
    from tputrain.distribution.communication import CommunicationOptions
    from tputrain.optim.ema import ExponentialAverage
    from tputrain.loop.inputs import Inputs
    from tputrain.options import TrainerOptions
    from tputrain.runtime.plan import RunPlan
    from tputrain.observe.progress import Progress
    from tputrain.task import Task


@dataclasses.dataclass(frozen=True)
class RunView:
    """A run's objects and plan, as one job reads them (built by `Trainer.view()`).

    Attributes:
      task, model, optimizer, strategy, inputs, checkpointer, progress, ema: the
        run's own objects (`checkpointer` is None once the Trainer is closed).
      plan: the resolved `RunPlan`; `options` are the user's (`plan.options`).
      model_dir, actions (the user's), communication: as the Trainer was given.
      step: the global step variable.
      agree: the largest of a number over all hosts (a collective).
      evaluate_weights: evaluates the weights in memory (`Trainer.evaluate_weights`).
      run_loop, set_train_iterator: the compiled train loop, for the jobs that time
        it (diagnose, the batch finder); train_iterator: the iterator it read when
        the view was built (a view is a snapshot: build another after a change).
    """

    task: Task
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    strategy: tf.distribute.Strategy
    inputs: Inputs
    plan: RunPlan
    model_dir: str
    checkpointer: Checkpointer | None
    progress: Progress
    ema: ExponentialAverage | None
    actions: Sequence[Any]
    communication: CommunicationOptions
    step: tf.Variable
    agree: Callable[[int], int]
    evaluate_weights: Callable[[], dict[str, float]]
    run_loop: Callable[[int], tuple[dict[str, float], int, float]]
    set_train_iterator: Callable[[Any], None]
    train_iterator: Any

    @property
    def options(self) -> TrainerOptions:
        return self.plan.options

    @property
    def num_hosts(self) -> int:
        return self.plan.batch.num_hosts

    @property
    def host_id(self) -> int:
        return self.plan.batch.host_id

    @property
    def local_replicas(self) -> int:
        return self.plan.batch.local_replicas


def view_of(run: Any) -> RunView:
    """`run` as a view: a `RunView` itself, or the view of a Trainer or an action's
    context (their `view()`), so public functions that took a Trainer still do."""
    if isinstance(run, RunView):
        return run
    view = getattr(run, "view", None)
    if view is None:
        raise TypeError(f"expected a tputrain.Trainer or RunView, got {type(run).__name__}")
    return view()
