"""`PreemptionAction`: stop after a loop in which any host got SIGTERM."""

from __future__ import annotations

from typing import Mapping

from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext


class PreemptionAction(Action):
    """After a loop in which any host got SIGTERM: stop there. The Controller then saves
    (every action's `on_save` sees it) and raises `Preempted` (exit code 42)."""

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if context.preempted():
            context.stop("preempted")
