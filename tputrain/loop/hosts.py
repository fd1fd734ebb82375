"""What several hosts (worker processes) must agree on."""

from __future__ import annotations

from typing import Callable

import tensorflow as tf


def host_topology(strategy: tf.distribute.Strategy) -> tuple[int, int]:
    """Returns (number of input pipelines/hosts, this host's index)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver:
        spec = resolver.cluster_spec().as_dict()
        hosts = [("chief", i) for i in range(len(spec.get("chief", [])))]
        hosts += [("worker", i) for i in range(len(spec.get("worker", [])))]
        if (resolver.task_type, resolver.task_id) in hosts:
            return len(hosts), hosts.index((resolver.task_type, resolver.task_id))
    return 1, 0


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Only the chief writes the real checkpoints and summaries."""
    return bool(getattr(strategy.extended, "should_checkpoint", True))


class MaxOverHosts:
    """`max_over_hosts(value)`: the largest value any host passes (a collective:
    every host must call it, in the same order)."""

    def __init__(self, strategy: tf.distribute.Strategy, num_hosts: int):
        self.strategy = strategy
        self.num_hosts = num_hosts
        self._fn: Callable | None = None

    def __call__(self, value: int) -> int:
        if self.num_hosts == 1:
            return value
        if self._fn is None:
            strategy = self.strategy
            # ReduceOp has no MAX: gather every replica's value, then take the largest.
            self._fn = tf.function(lambda v: tf.reduce_max(strategy.gather(
                strategy.run(lambda x: tf.reshape(x, [1]), args=(v,)), axis=0)))
        return int(self._fn(tf.constant(value, tf.int64)))
