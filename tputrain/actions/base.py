"""The `Action` base class: user code the Trainer calls at fixed points of a run."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tputrain.runtime.context import ActionContext


class Action:
    """Base class: every hook is a no-op. `logs` are plain floats.

    Each hook gets the run's `ActionContext` first (tputrain/runtime/context.py): the step,
    strategy, model, optimizer, checkpointer, progress and plan, `agree` across
    hosts and `stop(reason)`. Reading other Trainer attributes through it still
    works, with a DeprecationWarning.

    `owns_learning_rate`: True when the action sets the optimizer's learning rate
    (e.g. Keras's ReduceLROnPlateau through `KerasCallbacks`): a resume then takes it
    from the checkpoint instead of putting the config's value back (logged where they
    differ, naming the action's `learning_rate_setters` if it has them, else its class).

    `stops_on_nonfinite`: True when the action ends the run itself on a NaN loss (Keras's
    `TerminateOnNaN` through `KerasCallbacks`): the guard's "raise" then stops the run
    at that loop's end, the last finite weights checkpointed, instead of raising.
    """

    owns_learning_rate = False
    stops_on_nonfinite = False

    def preflight(self, context: ActionContext) -> None:
        """On the chief, once the model is built and before anything is written to
        model_dir: raise ValueError/OSError naming the fix for a configuration that
        cannot work, so it fails in one line instead of after the lock and logs."""

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        """Once per `train()`, after the restore, before the first loop."""

    def loop_metrics(self, context: ActionContext, step: int, steps: int,
                     seconds: float) -> Mapping[str, float]:
        """Before the progress line of each loop (`steps` steps in `seconds`): scalars
        to add to the loop's logs, its progress line and TensorBoard (e.g. comm/*)."""
        return {}

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        """After each compiled loop of training steps; `logs` are the loop's means,
        learning rate and throughput (steps_per_second, examples_per_second, ...)."""

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        """After each evaluation, with its metrics."""

    def on_save(self, context: ActionContext, step: int, path: str | None) -> None:
        """After a checkpoint save was requested (`path` None when nothing was written)."""

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        """Once, when `train()` returns normally, with the final evaluation's metrics."""

    def on_train_error(self, context: ActionContext, step: int, error: BaseException) -> None:
        """Once, when `train()` ends by an exception instead (`Preempted` after SIGTERM's
        checkpoint, a failure, an interrupt), before it leaves `train()`: a command exits
        right after, so what the action holds in memory is lost unless written now. It
        must not raise (the original error goes on)."""

    def eval_recorded(self, context: ActionContext, step: int) -> bool:
        """Whether this action's record on disk holds the evaluation at `step`. A resume
        at a step whose evaluation some action did not record (killed in between)
        evaluates it again and calls only those actions' `on_eval_end`."""
        return True

    def checkpoint_state(self) -> Any:
        """A trackable saved inside every checkpoint and restored with it, or None (the
        default: nothing). E.g. `KerasCallbacks`' callbacks' state: committed with the
        checkpoint, so a kill between them cannot mismatch. A checkpoint without it
        (older, or written by a run without this action) restores the rest and leaves
        it as it is; one holding another run's actions' state is read as well."""
        return None

    def end_done(self, context: ActionContext, step: int) -> bool:
        """Whether this action's end-of-run output for a run that ended at `step` is on
        disk. A rerun of a finished run calls `on_train_end` only where it is not."""
        return True


def check_actions(actions: Sequence[Action]) -> list[Action]:
    """The actions as a list; anything that is not an `Action` is named."""
    actions = list(actions)
    if not all(isinstance(a, Action) for a in actions):
        raise TypeError("Trainer.actions must be tputrain.Action instances, got "
                        f"{[type(a).__name__ for a in actions]}")
    return actions


def checkpointed_states(actions: Sequence[Action]) -> dict[str, Any]:
    """Each action's `checkpoint_state()`, by class name (a second of a class: `_1`...)."""
    states: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for action in actions:
        state = action.checkpoint_state()
        if state is None:
            continue
        name = type(action).__name__
        count = seen[name] = seen.get(name, -1) + 1
        states[f"{name}_{count}" if count else name] = state
    return states
