"""FLOPs per step and the device's peak: what model FLOPs utilization (MFU) needs.

MFU = (FLOPs per step x steps/s) / peak FLOP/s. It says how close training gets
to the hardware, which examples/s alone cannot: a faster step may only mean a
smaller model.

* FLOPs per step are counted on the graph TensorFlow traces for the step's
  forward and backward pass (`count_graph_flops`): every matrix multiply,
  einsum and convolution, with the formulas of TensorFlow's registered `flops`
  statistics (2 x multiply-adds) extended to `Einsum`, which has none.
  Elementwise ops are left out, as in the usual MFU definition: they do not run
  on the matrix units the peak refers to. A task can instead supply an analytic
  count with `Task.flops_per_example()`.
* Peaks (`peak_flops`) come from a table of dense matrix-unit peaks per device
  for TPU v2-v6 and common GPUs, or, on CPU, from a short matmul probe cached in
  `~/.cache/tputrain/peak_flops.json` (`TPUTRAIN_CACHE_DIR` moves it): the first
  `PEAK_PROBES` processes on a machine probe once each and the best is kept, so
  one probe taken while other work ran does not inflate MFU for good.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import write_atomically
from tputrain.core.cache_dir import cache_root
from tputrain.core.cpu_info import cpu_name
from tputrain.distribution.strategy import worker_devices

# Dense peak FLOP/s per TensorFlow device: (16-bit, float32). On TPUs float32
# matmuls run as bf16 passes by default, and on Ampere+ GPUs as TF32 (TensorFlow
# enables TF32 by default), so those are the float32 peaks. TPU v2/v3 expose
# each of a chip's two cores as a device: half the chip's peak each.
PEAK_FLOPS = {
    "tpu v2": (22.5e12, 22.5e12),
    "tpu v3": (61.5e12, 61.5e12),
    "tpu v4": (275e12, 275e12),
    "tpu v5e": (197e12, 197e12),
    "tpu v5p": (459e12, 459e12),
    "tpu v6e": (918e12, 918e12),
    "h100": (989e12, 494e12),
    "a100": (312e12, 156e12),
    "l4": (121e12, 60e12),
    "a10": (125e12, 62.5e12),
    "v100": (125e12, 15.7e12),
    "t4": (65e12, 8.1e12),
}
_TPU_ALIASES = (("v5litepod", "tpu v5e"), ("v5lite", "tpu v5e"), ("v5e", "tpu v5e"),
                ("v5p", "tpu v5p"), ("v6e", "tpu v6e"), ("v6", "tpu v6e"), ("v4", "tpu v4"),
                ("v3", "tpu v3"), ("v2", "tpu v2"))
_MATMUL_TYPES = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
_CONV_TYPES = ("Conv2D", "Conv3D", "DepthwiseConv2dNative")
_CONV_BACKPROP_INPUT = ("Conv2DBackpropInput", "Conv3DBackpropInputV2",
                        "DepthwiseConv2dNativeBackpropInput")
_CONV_BACKPROP_FILTER = ("Conv2DBackpropFilter", "Conv3DBackpropFilterV2",
                         "DepthwiseConv2dNativeBackpropFilter")
_CALL_TYPES = ("PartitionedCall", "StatefulPartitionedCall")


# ------------------------------------------------------------------ counting


def _dims(shape: tf.TensorShape) -> list[int] | None:
    return None if shape.rank is None or not shape.is_fully_defined() else shape.as_list()


def _einsum_flops(op: tf.Operation) -> int | None:
    if len(op.inputs) != 2:
        return 0  # a transpose, trace or reduction: no multiply-adds worth counting
    equation = op.get_attr("equation").decode().replace(" ", "")
    inputs, output = equation.split("->")
    sizes: dict[str, int] = {}
    for labels, tensor in zip(inputs.split(","), op.inputs):
        dims = _dims(tensor.shape)
        if dims is None:
            return None
        labels = labels.replace("...", "")
        for label, size in zip(labels, dims[len(dims) - len(labels):]):
            sizes[label] = size
    out = _dims(op.outputs[0].shape)
    if out is None:
        return None
    contracted = set(inputs.replace(",", "").replace(".", "")) - set(output)
    return 2 * int(np.prod(out, dtype=np.int64)) * int(np.prod([sizes[c] for c in contracted],
                                                               dtype=np.int64))


def op_flops(op: tf.Operation) -> int | None:
    """FLOPs of one matmul/einsum/conv op (2 per multiply-add); 0 for other ops.

    None when a shape the count needs is not static.
    """
    kind = op.type
    if kind in _MATMUL_TYPES:
        if kind == "Einsum":
            return _einsum_flops(op)
        a, out = _dims(op.inputs[0].shape), _dims(op.outputs[0].shape)
        if a is None or out is None:
            return None
        if kind == "MatMul":
            depth = a[0] if op.get_attr("transpose_a") else a[1]
        else:
            depth = a[-2] if op.get_attr("adj_x") else a[-1]
        return 2 * int(np.prod(out, dtype=np.int64)) * depth
    if kind in _CONV_TYPES or kind in _CONV_BACKPROP_INPUT or kind in _CONV_BACKPROP_FILTER:
        if kind in _CONV_TYPES:
            out, kernel = op.outputs[0].shape, op.inputs[1].shape
        elif kind in _CONV_BACKPROP_INPUT:
            out, kernel = op.inputs[2].shape, op.inputs[1].shape
        else:
            out, kernel = op.inputs[2].shape, op.outputs[0].shape
        out, kernel = _dims(out), _dims(kernel)
        if out is None or kernel is None:
            return None
        # Each output element of a convolution is a dot product over the kernel's
        # window and input channels (one channel per output for depthwise).
        window = kernel[:-2] if kind.startswith("Depthwise") else kernel[:-1]
        return 2 * int(np.prod(out, dtype=np.int64)) * int(np.prod(window, dtype=np.int64))
    return 0


def _nested_graphs(op: tf.Operation) -> list[Any]:
    if op.type not in _CALL_TYPES:
        return []
    name = op.get_attr("f").name
    function = op.graph._get_function(name)  # pylint: disable=protected-access
    graph = getattr(function, "graph", None)
    return [graph] if graph is not None else []


def _live_ops(graph: tf.Graph) -> list[tf.Operation]:
    """Ops the function runtime executes: those its outputs or side effects need.

    Gradients trace some ops nobody uses (e.g. a first convolution's input
    gradient); TensorFlow prunes them before running, so they must not count.
    """
    roots = [t.op for t in getattr(graph, "outputs", [])]
    roots += list(getattr(graph, "control_outputs", []))
    if not roots:
        return graph.get_operations()
    live, pending = set(), roots
    while pending:
        op = pending.pop()
        if op in live:
            continue
        live.add(op)
        pending.extend(t.op for t in op.inputs)
        pending.extend(op.control_inputs)
    return [op for op in graph.get_operations() if op in live]


def live_graph_ops(graph: tf.Graph) -> Iterator[tf.Operation]:
    """The live ops of a traced graph and of the functions it calls, each graph once."""
    seen, pending = set(), [graph]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for op in _live_ops(current):
            yield op
            pending.extend(_nested_graphs(op))


def count_graph_flops(graph: tf.Graph) -> int:
    """Sums `op_flops` over the live ops of a traced graph and the functions it calls.

    Loop bodies (`tf.while_loop`) are not counted: their trip count is unknown.
    Raises ValueError if a matmul-like op has a dynamic shape.
    """
    total = 0
    for op in live_graph_ops(graph):
        flops = op_flops(op)
        if flops is None:
            raise ValueError(
                f"cannot count the FLOPs of {op.type} op {op.name!r}: its shapes are not "
                "static. Batch with drop_remainder=True, or return an analytic count from "
                "Task.flops_per_example()")
        total += flops
        if op.type in ("While", "StatelessWhile"):
            logging.warning("tputrain: FLOPs inside the tf.while_loop %s are not counted; "
                            "return an analytic count from Task.flops_per_example()", op.name)
    return total


def count_flops(fn: Callable, *input_signature: Any) -> int:
    """Traces `fn` (no execution) on the given `tf.TensorSpec` nests; counts its FLOPs."""
    concrete = tf.function(fn).get_concrete_function(*input_signature)
    return count_graph_flops(concrete.graph)


# --------------------------------------------------------------------- peaks


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of all the devices a strategy trains on, and where it came from."""

    flops_per_second: float
    source: str


MEASURED_CPU = "measured CPU"  # how a `Peak.source` from a CPU probe starts


def peak_kind(precision: str) -> str:
    """The peak a precision policy computes at: "bfloat16", "float16" or "float32"."""
    if precision in ("mixed_bfloat16", "bfloat16"):
        return "bfloat16"
    if precision in ("mixed_float16", "float16"):
        return "float16"
    if precision == "float32":
        return "float32"
    raise ValueError(f"unknown precision {precision!r}: use float32, mixed_bfloat16 or "
                     "mixed_float16")


def lookup_device(kind: str) -> tuple[float, float] | None:
    """Table row for a device name ("TPU v4", "v5litepod-8", "NVIDIA A100-SXM4-40GB")."""
    text = kind.lower()
    if "tpu" in text or re.match(r"v\d", text):
        for alias, key in _TPU_ALIASES:
            if alias in text:
                return PEAK_FLOPS[key]
        return None
    for key in ("h100", "a100", "v100", "t4", "a10", "l4"):
        if re.search(rf"(?<![a-z0-9]){key}(?![0-9])", text):
            return PEAK_FLOPS[key]
    return None


def _accelerator_kind(strategy: tf.distribute.Strategy) -> tuple[str, str] | None:
    """("tpu"|"gpu", device name) for the strategy's devices, None on CPU."""
    names = " ".join(worker_devices(strategy)).upper()
    if "TPU" in names or isinstance(strategy, tf.distribute.TPUStrategy):
        # TPU VMs set it (e.g. "v4-8", "v5litepod-16"); elsewhere bind device_kind.
        return "tpu", os.environ.get("TPU_ACCELERATOR_TYPE", "TPU (unknown version)")
    if "GPU" in names:
        gpus = tf.config.list_physical_devices("GPU")
        details = tf.config.experimental.get_device_details(gpus[0]) if gpus else {}
        return "gpu", str(details.get("device_name", "gpu"))
    return None


def _cache_path() -> str:
    return os.path.join(cache_root(), "peak_flops.json")


def measure_matmul_peak(dtype: str = "float32", size: int = 2048, repeats: int = 8) -> float:
    """FLOP/s of the best of `repeats` [size x size] matmuls on the default device.

    A short probe (about a second): the best repeat stands for the peak, so other
    work on the machine lowers it less than a mean would.
    """
    a = tf.random.stateless_normal([size, size], seed=[1, 2], dtype=tf.float32)
    b = tf.random.stateless_normal([size, size], seed=[3, 4], dtype=tf.float32)
    a, b = tf.cast(a, dtype), tf.cast(b, dtype)
    matmul = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[:1, :1], tf.float32)))
    matmul(a, b).numpy()  # trace and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).numpy()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


PEAK_PROBES = 3  # processes on a machine that probe before its cached peak stands
_probed_here: set[str] = set()  # keys this process has probed


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, value: dict[str, Any]) -> None:
    """Atomically, through a temporary file of this writer's own (a cache: not fsynced)."""
    write_atomically(path, json.dumps(value, indent=1, sort_keys=True), durable=False)


def _probes_path(path: str) -> str:
    return os.path.splitext(path)[0] + "_probes.json"


def _probe_count(cache: dict[str, Any], counts: dict[str, Any], key: str) -> int:
    """Probes behind the cached peak: a cache written before counts were kept is one."""
    return int(counts.get(key, 1 if key in cache else 0))


def _peak_key(dtype: str) -> str:
    """This CPU's entry in the peak cache: its name, core count, TensorFlow, dtype."""
    return f"{cpu_name()}|{os.cpu_count()} cpus|tf {tf.__version__}|{dtype}"


def cpu_peak_flops(dtype: str = "float32", refresh: bool = False) -> float:
    """The measured matmul peak of this CPU for `dtype`, cached: the best probe of the
    first `PEAK_PROBES` processes (one probe each; `refresh` starts over).

    A probe taken while other work runs reads low (the matmul shares the cores), and
    MFU computed against it would read high for good: the best of several probes stands."""
    key = _peak_key(dtype)
    path = _cache_path()
    cache = _read_json(path)
    probes = _probe_count(cache, _read_json(_probes_path(path)), key)
    if key in cache and not refresh and (key in _probed_here or probes >= PEAK_PROBES):
        return float(cache[key])
    with tf.device("/cpu:0"):
        measured = measure_matmul_peak(dtype)
    _probed_here.add(key)
    # Read again: processes that started together probed meanwhile, and the best of
    # all stands (the count may miss one of them; a peak is never lowered).
    cache, counts = _read_json(path), _read_json(_probes_path(path))
    probes = _probe_count(cache, counts, key)
    peak = measured if refresh or key not in cache else max(measured, float(cache[key]))
    cache[key], counts[key] = peak, 1 if refresh else probes + 1
    _write_json(path, cache)
    _write_json(_probes_path(path), counts)
    logging.info("tputrain: measured %s matmul peak %.1f GFLOP/s; %.1f GFLOP/s kept, "
                 "probe %d of %d (cached in %s)", dtype, measured / 1e9, peak / 1e9,
                 counts[key], PEAK_PROBES, path)
    return peak


def raise_cpu_peak(dtype: str, flops_per_second: float) -> None:
    """Raises this CPU's cached `dtype` peak to `flops_per_second`, a rate a training
    loop reached (a peak is never lowered): probes taken while other work ran (a
    test suite, another job) can all read low, and MFU would then top 100% for good."""
    key = _peak_key(dtype)
    path = _cache_path()
    cache = _read_json(path)
    if float(flops_per_second) > float(cache.get(key, 0.0)):
        cache[key] = float(flops_per_second)
        _write_json(path, cache)


def peak_flops(precision: str, strategy: tf.distribute.Strategy | None = None,
               device_kind: str | None = None,
               peak_flops_per_device: float | None = None) -> Peak:
    """Peak FLOP/s of the strategy's devices at `precision`.

    Args:
      precision: the Trainer's policy; bf16/fp16 policies use the 16-bit peak.
      strategy: None means the current strategy.
      device_kind: overrides detection, e.g. "TPU v5e" or "A100" (the TPU kind is
        read from $TPU_ACCELERATOR_TYPE when set).
      peak_flops_per_device: overrides the table for unlisted hardware.

    Accelerators: table peak x number of replicas. CPU: the measured peak of the
    whole host (logical CPU devices share its cores), whatever the replica count.
    """
    strategy = strategy or tf.distribute.get_strategy()
    kind = peak_kind(precision)
    replicas = strategy.num_replicas_in_sync
    if peak_flops_per_device is not None:
        return Peak(float(peak_flops_per_device) * replicas, "ProfilingOptions.peak_flops_per_device")
    accelerator = ("device", device_kind) if device_kind else _accelerator_kind(strategy)
    if accelerator is None:
        return Peak(cpu_peak_flops(kind), f"{MEASURED_CPU} {kind} matmul peak")
    row = lookup_device(accelerator[1])
    if row is None:
        raise ValueError(
            f"no peak FLOP/s known for {accelerator[1]!r}: set "
            "ProfilingOptions.peak_flops_per_device (dense 16-bit or float32 FLOP/s per "
            "device) or ProfilingOptions.device_kind (one of: " + ", ".join(PEAK_FLOPS) + ")")
    per_device = row[0] if kind != "float32" else row[1]
    return Peak(per_device * replicas, f"{accelerator[1]} table x {replicas}")


def model_flops_utilization(flops_per_step: float, steps_per_second: float,
                            peak: float) -> float:
    """MFU: achieved model FLOP/s over the peak. The one formula: `Progress` logs it."""
    return flops_per_step * steps_per_second / peak


def specs_of(structure: Any) -> Any:
    """`tf.TensorSpec`s of a nest of element specs (drops names and dataset wrappers)."""
    return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape, s.dtype), structure)

