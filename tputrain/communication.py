"""Communication: what crosses between replicas each step, what it costs, and the knobs.

Each step sums every gradient over all replicas (one batched all-reduce, see
`tputrain.allreduce`). `CommunicationOptions` holds the knobs that change its
cost, and `tputrain.actions.CommunicationAction` measures it on every run:

* `comm/gradient_bytes`: bytes all-reduced per step, in the all-reduce dtype
  (0 on one replica: nothing crosses);
* `comm/allreduce_fraction`: the share of a loop's wall time spent in the
  all-reduce. Measured by calibration at the start of `train()`: the strategy's
  all-reduce is timed on zeros of the real gradient structure (same shapes,
  dtype and packing, median of several repeats), and each loop divides
  `steps x that time` by its own wall time. It is an estimate: in the real step
  the all-reduce can overlap with compute (the fraction is then an upper bound)
  or contend with it for the network (a lower bound); the profiler's collective
  ops are the ground truth (`Trainer.profile_steps`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Sequence

import gin
import tensorflow as tf

ALLREDUCE_DTYPES = ("float32", "bfloat16", "float16")
IMPLEMENTATIONS = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How gradients cross replicas and hosts; each knob says what it trades.

    Attributes:
      allreduce_dtype: "float32" (exact), or "bfloat16"/"float16": gradients are cast
        down for the all-reduce and back to float32 for the update, halving the bytes
        on the wire at the cost of the sum's precision (bf16 keeps float32's range
        with 8 bits of mantissa; float16 keeps more mantissa but can overflow on
        large gradients). Micro-batch accumulation and the update stay float32.
      implementation: MultiWorkerMirroredStrategy's collective: "auto", "ring"
        (gRPC, any device) or "nccl" (GPUs only; fastest on GPUs).
      bytes_per_pack: MultiWorkerMirrored packs gradients into chunks of this many
        bytes for the all-reduce (0: one pack per dtype). Smaller packs start the
        all-reduce earlier and overlap it with the backward pass, at more
        per-message overhead.
      timeout_seconds: a collective that waits longer than this fails instead of
        hanging (None: no timeout): a dead peer then ends the job with an error.
    """

    allreduce_dtype: str = "float32"
    implementation: str = "auto"
    bytes_per_pack: int = 0
    timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.allreduce_dtype not in ALLREDUCE_DTYPES:
            raise ValueError(f"CommunicationOptions.allreduce_dtype must be one of "
                             f"{ALLREDUCE_DTYPES}, got {self.allreduce_dtype!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"CommunicationOptions.implementation must be one of "
                             f"{sorted(IMPLEMENTATIONS)}, got {self.implementation!r}")
        if isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, int) \
                or self.bytes_per_pack < 0:
            raise ValueError(f"CommunicationOptions.bytes_per_pack must be an int >= 0, "
                             f"got {self.bytes_per_pack!r}")

    def for_multi_worker(self) -> tf.distribute.experimental.CommunicationOptions:
        """The options MultiWorkerMirroredStrategy is built with."""
        implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                                 IMPLEMENTATIONS[self.implementation])
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.bytes_per_pack, timeout_seconds=self.timeout_seconds,
            implementation=implementation)


def gradient_bytes(variables: Sequence[tf.Variable], allreduce_dtype: str,
                   replicas: int) -> int:
    """Bytes all-reduced per step: every trainable variable's gradient, floating ones
    in the all-reduce dtype; 0 on one replica."""
    if replicas <= 1:
        return 0
    wire = tf.as_dtype(allreduce_dtype)
    total = 0
    for variable in variables:
        dtype = tf.as_dtype(variable.dtype)
        size = (wire if dtype.is_floating else dtype).size
        total += int(variable.shape.num_elements()) * size
    return total


def calibrate(strategy: tf.distribute.Strategy, variables: Sequence[tf.Variable],
              allreduce_dtype: str, repeats: int = 5) -> float:
    """Median seconds of one all-reduce of zeros shaped like the gradients (every
    host must call it: it is a collective)."""
    wire = tf.as_dtype(allreduce_dtype)
    specs = [(v.shape, wire if tf.as_dtype(v.dtype).is_floating else v.dtype) for v in variables]

    def replica_fn():
        context = tf.distribute.get_replica_context()
        zeros = [tf.zeros(shape, dtype) for shape, dtype in specs]
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, zeros)
        return tf.add_n([tf.cast(tf.reshape(r, [-1])[0], tf.float32) for r in reduced])

    run = tf.function(lambda: strategy.run(replica_fn))
    strategy.experimental_local_results(run())  # traced and warmed up, not timed
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for value in strategy.experimental_local_results(run()):
            value.numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
