"""Communication: what crosses between replicas each step, what it costs, and the knobs.

Each step sums every gradient over all replicas (one batched all-reduce, see
`tputrain.distribution.allreduce`). `CommunicationOptions` holds the knobs that change its
cost, and `tputrain.actions.CommunicationAction` measures it on every run:

* `comm/gradient_bytes`: bytes all-reduced per step, in the all-reduce dtype
  (0 on one replica: nothing crosses);
* `comm/allreduce_fraction`: the share of a loop's wall time spent in the
  all-reduce. Measured once at the start of `train()` (`measure_allreduce`,
  under half a second, only on several replicas): compiled loops of 1 and of n
  all-reduces of the real gradient structure (same shapes, wire dtype and
  packing as the step, the variables' values as data) alternate, and the
  difference of their medians is one all-reduce without a call's overhead; each
  loop divides `steps x that time` by its own wall time. `tputrain diagnose`
  uses the same measurement. It is an estimate: in the real step
  the all-reduce can overlap with compute (the fraction is then an upper bound)
  or contend with it for the network (a lower bound); the profiler's collective
  ops are the ground truth (`Trainer.profile_steps`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import tensorflow as tf

from tputrain.distribution.allreduce import all_reduce_sum

ALLREDUCE_DTYPES = ("float32", "bfloat16", "float16")
IMPLEMENTATIONS = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}
MIRRORED_CROSS_DEVICE_OPS = {
    "auto": lambda: None, "nccl": tf.distribute.NcclAllReduce,
    "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
    "reduce_to_one_device": tf.distribute.ReductionToOneDevice}


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
      mirrored_cross_device_ops: MirroredStrategy's all-reduce over one host's GPUs:
        "auto" (TensorFlow's choice: NCCL when it can), "nccl" (fastest on NVLink,
        GPUs only), "hierarchical_copy" (copies through GPU pairs: good on 8 GPUs
        without NVSwitch), "reduce_to_one_device" (sums on one device: slowest,
        works everywhere). A split CPU always reduces to one device.
      mirrored_num_packs: "nccl"/"hierarchical_copy" pack the gradients into this
        many chunks: fewer launches for many small gradients, less overlap.
    """

    allreduce_dtype: str = "float32"
    implementation: str = "auto"
    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    mirrored_cross_device_ops: str = "auto"
    mirrored_num_packs: int = 1

    def __post_init__(self) -> None:
        if self.allreduce_dtype not in ALLREDUCE_DTYPES:
            raise ValueError(f"CommunicationOptions.allreduce_dtype must be one of "
                             f"{ALLREDUCE_DTYPES}, got {self.allreduce_dtype!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"CommunicationOptions.implementation must be one of "
                             f"{sorted(IMPLEMENTATIONS)}, got {self.implementation!r}")
        for name, least in (("bytes_per_pack", 0), ("mirrored_num_packs", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"CommunicationOptions.{name} must be an int >= {least}, "
                                 f"got {value!r}")
        if self.mirrored_cross_device_ops not in MIRRORED_CROSS_DEVICE_OPS:
            raise ValueError(f"CommunicationOptions.mirrored_cross_device_ops must be one "
                             f"of {sorted(MIRRORED_CROSS_DEVICE_OPS)}, got "
                             f"{self.mirrored_cross_device_ops!r}")

    def for_mirrored(self) -> tf.distribute.CrossDeviceOps | None:
        """The cross-device ops MirroredStrategy over GPUs is built with (None: TF's)."""
        kind = self.mirrored_cross_device_ops
        if kind in ("nccl", "hierarchical_copy"):
            return MIRRORED_CROSS_DEVICE_OPS[kind](num_packs=self.mirrored_num_packs)
        return MIRRORED_CROSS_DEVICE_OPS[kind]()

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


def allreduce_loop(strategy: tf.distribute.Strategy, variables: Sequence[tf.Variable],
                   dtype: str) -> Callable[[tf.Tensor], tf.Tensor]:
    """A compiled loop of `n` all-reduces shaped like the gradients, as the train step
    runs them (`all_reduce_sum`: cast to the wire dtype, one batched all-reduce, cast
    back). It reduces the variables' values: real tensors, so nothing is constant-folded
    away (zeros can be), and one call runs many, so the per-call overhead that a
    training loop pays once per loop is left out."""

    def replica_fn() -> tf.Tensor:
        context = tf.distribute.get_replica_context()
        reduced = all_reduce_sum(context, [tf.identity(v) for v in variables], dtype)
        return tf.add_n([tf.cast(tf.reshape(r, [-1])[0], tf.float32) for r in reduced])

    @tf.function
    def loop(n: tf.Tensor) -> tf.Tensor:
        total = tf.constant(0.0)
        for _ in tf.range(n):
            total += tf.add_n(strategy.experimental_local_results(strategy.run(replica_fn)))
        return total

    return loop


def _seconds(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def measure_allreduce(strategy: tf.distribute.Strategy, variables: Sequence[tf.Variable],
                      dtype: str, seconds: float = 1.0,
                      agree: Callable[[int], int] = int, repeats: int = 5,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one all-reduce of `variables`' gradients inside a compiled loop (a
    collective: every host calls it; `agree` makes their loop lengths equal, e.g.
    `tputrain.loop.hosts.MaxOverHosts`). Takes about `1.5 * seconds`.

    Loops of 1 and of n all-reduces alternate (n: what fits about `seconds / 4`);
    the difference of their medians over n - 1 is one all-reduce without the
    call's overhead, which a training loop pays once per loop, not per step. When
    the difference drowns in noise (not above 0), n grows 8x, at most twice.
    `clock`: the time source (`tputrain.jobs.diagnose.diagnose`'s).
    """
    loop, one = allreduce_loop(strategy, variables, dtype), tf.constant(1)
    float(loop(one))  # traced, not timed
    once = _seconds(lambda: float(loop(one)), clock)
    n = agree(max(4, min(100, int(seconds / 4 / max(once, 1e-6)))))
    for attempt in range(3):
        short, long = [], []
        for _ in range(repeats):
            short.append(_seconds(lambda: float(loop(one)), clock))
            long.append(_seconds(lambda: float(loop(tf.constant(n))), clock))
        per_step = (statistics.median(long) - statistics.median(short)) / (n - 1)
        if attempt == 2 or not agree(int(per_step <= 0)):  # every host retries, or none
            break
        n *= 8
    return min(max(per_step, 0.0), statistics.median(long) / n)


# Event names of cross-replica collectives in a profiler trace: TF's collective
# kernels on CPU/GPU hosts, NCCL kernels on GPUs, XLA's all-reduce on TPUs.
_COLLECTIVE_MARKERS = ("collective", "allreduce", "all-reduce", "nccl")


def _merged_length(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by `intervals` (overlaps counted once)."""
    total, end = 0, None
    for begin, finish in sorted(intervals):
        if end is None or begin > end:
            total, end = total + finish - begin, finish
        elif finish > end:
            total, end = total + finish - end, finish
    return total


def collective_share(profile_dir: str) -> float | None:
    """Share of a profiler trace's span during which a collective op was in flight on
    some thread or device: the profiler's view of `comm/allreduce_fraction`. None
    when `profile_dir` (a `plugins/profile` folder) holds no trace or no collective.

    It is an upper bound of the all-reduce's cost: a collective kernel starts when
    its replica is ready and ends when the slowest one has contributed, so it also
    counts waiting for the other replicas, and overlapping with compute.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # ships with TensorFlow

    runs = sorted(tf.io.gfile.glob(f"{profile_dir.rstrip('/')}/*"))
    if not runs:
        return None
    collective, span = [], [None, None]
    for path in tf.io.gfile.glob(f"{runs[-1]}/*.xplane.pb"):
        space = xplane_pb2.XSpace.FromString(tf.io.gfile.GFile(path, "rb").read())
        for plane in space.planes:
            names = {key: meta.name.lower() for key, meta in plane.event_metadata.items()}
            for line in plane.lines:
                for event in line.events:
                    begin = line.timestamp_ns * 1000 + event.offset_ps
                    end = begin + event.duration_ps
                    span = [min(x for x in (span[0], begin) if x is not None),
                            max(x for x in (span[1], end) if x is not None)]
                    if any(m in names.get(event.metadata_id, "") for m in _COLLECTIVE_MARKERS):
                        collective.append((begin, end))
    if not collective or span[1] <= span[0]:
        return None
    return _merged_length(collective) / (span[1] - span[0])
