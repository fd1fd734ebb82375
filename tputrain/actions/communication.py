"""`CommunicationAction`: gradient bytes and the all-reduce's share of a step (comm/*)."""

from __future__ import annotations

from typing import Any, Mapping

from tputrain.actions.base import Action
from tputrain.runtime.context import ActionContext
from tputrain.distribution.communication import (CommunicationOptions, gradient_bytes,
                                                 measure_allreduce)


# Seconds of one all-reduce, by what decides it (`_measure_key`): Trainer after Trainer
# of one process (a sweep, a notebook) on the same devices and gradients time it once.
_MEASURED: dict[tuple, float] = {}


def _measure_key(context: ActionContext, dtype: str) -> tuple[Any, ...]:
    """The devices, the reduction, the wire dtype and the gradients' shapes and dtypes."""
    extended = context.strategy.extended
    return (tuple(extended.worker_devices), type(context.strategy).__name__,
            type(getattr(extended, "_cross_device_ops", None)).__name__, dtype,
            tuple((tuple(v.shape), str(v.dtype)) for v in context.model.trainable_variables))


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
        # every host measures, with agreed loop lengths. On one host, once a process.
        if replicas > 1 and not self.measured:  # the same on every host
            self.measured = True
            self.seconds_per_allreduce = self._measure(context)

    def _measure(self, context: ActionContext) -> float:
        dtype = self.options.allreduce_dtype
        # Several hosts measure every time: a host that skipped the collective would
        # leave the others waiting.
        key = _measure_key(context, dtype) if context.num_hosts == 1 else None
        if key in _MEASURED:
            return _MEASURED[key]
        seconds = measure_allreduce(context.strategy, context.model.trainable_variables,
                                    dtype, self.seconds, agree=context.agree)
        if key is not None:
            _MEASURED[key] = seconds
        return seconds

    def loop_metrics(self, context: ActionContext, step: int, steps: int,
                     seconds: float) -> Mapping[str, float]:
        fraction = min(1.0, steps * self.seconds_per_allreduce / max(seconds, 1e-9))
        return {"comm/gradient_bytes": float(self.bytes), "comm/allreduce_fraction": fraction}
