"""`CommunicationAction`: gradient bytes and the all-reduce's share of a step (comm/*)."""

from __future__ import annotations

from typing import Mapping

from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext
from tputrain.distribution.communication import (CommunicationOptions, gradient_bytes,
                                                 measure_allreduce)


class CommunicationAction(Action):
    """Times one all-reduce of the gradients at the first train() (several replicas
    only); adds comm/* to each loop (tputrain/distribution/communication.py says how and
    how well)."""

    def __init__(self, options: CommunicationOptions, seconds: float = 0.25):
        self.options = options
        self.seconds = seconds  # measurement budget: about 1.5x this at start-up
        self.bytes = 0
        self.seconds_per_allreduce = 0.0
        self.measured = False

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        replicas = context.strategy.num_replicas_in_sync
        variables = context.model.trainable_variables
        self.bytes = gradient_bytes(variables, self.options.allreduce_dtype, replicas)
        # Once per Trainer (a notebook's later train() calls reuse it); a collective:
        # every host measures, with agreed loop lengths.
        if replicas > 1 and not self.measured:  # the same on every host
            self.measured = True
            self.seconds_per_allreduce = measure_allreduce(
                context.strategy, variables, self.options.allreduce_dtype, self.seconds,
                agree=context.agree)

    def loop_metrics(self, context: ActionContext, step: int, steps: int,
                     seconds: float) -> Mapping[str, float]:
        fraction = min(1.0, steps * self.seconds_per_allreduce / max(seconds, 1e-9))
        return {"comm/gradient_bytes": float(self.bytes), "comm/allreduce_fraction": fraction}
