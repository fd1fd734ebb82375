"""`NonFinitePolicyAction`: the guard's policy (raise, skip, rollback) between loops."""

from __future__ import annotations

from typing import Mapping

from absl import logging

from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext
from tputrain.fault_tolerance.guard import NonFiniteError


class NonFinitePolicyAction(Action):
    """Applies `NonFiniteGuard.policy` after a loop in which the guard tripped:
    raise (or stop, when an action stops on a NaN itself), or roll the weights back
    to the last checkpoint."""

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        guard = context.guard
        tripped = guard.take_trip()
        if not tripped:
            return
        if guard.policy == "raise":
            stopper = next((a for a in context.actions if getattr(a, "stops_on_nonfinite", False)),
                           None)
            if stopper is None:
                raise NonFiniteError(guard.message(tripped))
            logging.warning("tputrain: non-finite loss or gradients at step %d; the update was "
                            "not applied. %s asked for a stop (TerminateOnNaN): the run ends "
                            "here with the weights from before that step", tripped,
                            type(stopper).__name__)
            context.stop("non-finite")
            return
        guard.rollbacks += 1
        if guard.rollbacks > guard.max_rollbacks:
            raise NonFiniteError(guard.message(tripped, gave_up=True))
        path = context.checkpointer.restore_weights(
            exclude=("iterator", "step", "nonfinite_steps"))
        if path is None:
            raise NonFiniteError(guard.message(tripped, no_checkpoint=True))
        logging.warning("tputrain: non-finite step %d: rolled the weights back to %s "
                        "(rollback %d of %d); the data continues from step %d", tripped,
                        path, guard.rollbacks, guard.max_rollbacks, step)
