"""Strategy resolver: pick the best `tf.distribute.Strategy` this process can reach, and say why.

`resolve_strategy()` tries, in order: TPU, multi-worker (TF_CONFIG), mirrored (2+ GPUs,
or a CPU split into logical devices by `split_cpu`), one GPU, CPU. It logs one line
naming the strategy, the replica count and why each earlier option was skipped, so a
run on the wrong hardware is obvious from the log.

Resolution is split into `_decide` (cheap: environment, device lists and short
network probes; builds nothing) and `_build` (constructs the strategy). Two TF calls
can hang for minutes, so `_decide` probes before making them:
  * `TPUClusterResolver` with a TPU *name* reads the GCE metadata server with no
    timeout: we first check the metadata server answers within a second.
  * `experimental_connect_to_cluster` to an address with no TF server behind it
    blocks for minutes: we first ask that address for its TF worker status over gRPC
    with a short deadline. (A plain TCP connect is not enough: proxies and load
    balancers accept connections for hosts that are not there.)
Call `resolve_strategy()` (and `split_cpu()`) at program start, before other TF ops:
multi-worker collectives and logical CPU devices can only be set up then.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import http.client
import os
import socket
from typing import Iterator, NamedTuple

import tensorflow as tf
from absl import logging

from tputrain.core.builders import configured
from tputrain.distribution.cluster import read_tf_config
from tputrain.distribution.communication import CommunicationOptions
from tputrain.observe.console import default_progress

VALID_STRATEGIES = ("tpu", "multi_worker", "mirrored", "one_device", "cpu")

# Short enough that a run without a TPU starts at once; a reachable TPU worker or
# metadata server answers in milliseconds.
_GRPC_PROBE_TIMEOUT_S = 1.5
_METADATA_PROBE_TIMEOUT_S = 1.0
# Bounds the Cloud TPU API calls that TPUClusterResolver makes for a named TPU (it
# passes no timeout of its own); legitimate calls take a second or two.
_CLOUD_API_TIMEOUT_S = 15.0
_METADATA_IP = "169.254.169.254"


class _Decision(NamedTuple):
    """What `_decide` chose: the strategy name, why earlier options were skipped."""

    name: str
    skipped: tuple[str, ...]  # e.g. "tpu (TPU_NAME unset)", in fallback order.
    forced: bool = False
    tpu_target: str | None = None  # What to pass to TPUClusterResolver(tpu=...).
    reason: str = ""  # Why this choice, when it is not plain from the order.


class _TpuUnavailable(Exception):
    """A TPU candidate that could not be connected to or initialised."""


def worker_devices(strategy: tf.distribute.Strategy) -> tuple[str, ...]:
    """The strategy's devices on this worker; for the default strategy (a script that
    made none) the local logical devices, which it has no list of."""
    try:
        return tuple(strategy.extended.worker_devices or ())
    except (AttributeError, RuntimeError):
        return tuple(d.name for d in tf.config.list_logical_devices())


def check_devices_exist(strategy: tf.distribute.Strategy) -> None:
    """Refuses a strategy over a CPU or GPU this process does not have: TensorFlow
    builds `MirroredStrategy(["/cpu:0", "/cpu:1"])` on one CPU device, and its first
    all-reduce then waits forever for the missing replica."""
    present = {(spec.device_type, spec.device_index) for spec in
               (tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices())}
    for name in worker_devices(strategy):
        spec = tf.DeviceSpec.from_string(name)
        if spec.device_type not in ("CPU", "GPU") or spec.device_index is None:
            continue
        if (spec.device_type, spec.device_index) not in present:
            raise ValueError(
                f"The strategy's device {name} does not exist in this process (it has "
                f"{sorted(d.name for d in tf.config.list_logical_devices())}). For several "
                "CPU replicas, call tputrain.split_cpu(N) before TensorFlow starts; for "
                "GPUs, check CUDA_VISIBLE_DEVICES.")


def without_gpus(strategy: tf.distribute.Strategy) -> bool:
    """Whether no device of this worker is a GPU: the XLA and program plans' CPU case
    (a TPUStrategy is planned before this is asked)."""
    return not any("GPU" in device.upper() for device in worker_devices(strategy))


def split_cpu(num_devices: int) -> None:
    """Splits the first physical CPU into `num_devices` logical devices.

    Lets `MirroredStrategy` run real multi-replica code (and tests) on a CPU-only
    machine: `resolve_strategy()` then mirrors over the logical CPUs. TF fixes its
    devices when it first runs an op, so call this first; calling it again with the
    same count is a no-op. From gin (`split_cpu.num_devices = N`), the `tputrain`
    CLI applies it through `configure_devices()` right after parsing the config;
    a script that parses gin itself calls `configure_devices()` the same way.
    """
    if num_devices < 1:
        raise ValueError(f"split_cpu needs num_devices >= 1, got {num_devices}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == num_devices:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
        )
    except RuntimeError as e:
        # TF is already initialised; that is fine only if the count already matches.
        have = len(tf.config.list_logical_devices("CPU"))
        if have == num_devices:
            return
        raise RuntimeError(
            f"split_cpu({num_devices}): TensorFlow is already initialised with {have} "
            f"logical CPU device(s); call split_cpu before any TensorFlow op runs "
            f"(at the top of main, or in conftest.py for tests)."
        ) from e


def configure_devices() -> None:
    """Applies a parsed gin config's `split_cpu.num_devices`; moved with the rest of
    gin to `tputrain.config.registry.configure_devices` (this name keeps working)."""
    # The gin registry installs the configured one when it loads; before, nothing is bound.
    configured("configure_devices", lambda: None)()


def resolve_strategy(
    tpu: str | None = None, strategy: str | None = None,
    communication: CommunicationOptions | None = None,
) -> tf.distribute.Strategy:
    """Returns the best strategy available, or the one forced by `strategy`.

    Args:
      tpu: TPU to use: a TPU name, a `grpc://host:port` worker address, or "local"
        (TPU VM). Defaults to $TPU_NAME, then to local TPU devices if present.
      strategy: None to fall back automatically (TPU, multi_worker, mirrored over
        2+ GPUs or a split CPU, one_device, cpu); or one of `VALID_STRATEGIES` to
        force that choice, which raises (naming the fix) if it is impossible here.
      communication: MultiWorkerMirroredStrategy's collective options (implementation,
        bytes_per_pack, timeout) and MirroredStrategy's cross-device ops on GPUs;
        None: `CommunicationOptions()` (gin's bindings, when configured).

    Call it once at program start, before other TF ops. Never hangs on an
    unreachable TPU: see the module docstring.
    """
    decision = _decide(tpu, strategy)
    communication = communication or CommunicationOptions()
    try:
        built = _build(decision, communication)
    except _TpuUnavailable as e:
        if decision.forced:
            raise RuntimeError(
                f"strategy='tpu' but the TPU could not be used: {e}. Check the TPU is "
                f"up and reachable, or pass strategy=None to fall back automatically."
            ) from e
        decision = _decide(tpu, strategy, tpu_failure=str(e))
        built = _build(decision, communication)
    default_progress()  # often called before any Trainer: its line must show, too
    logging.info("%s", _describe(decision, built))
    return built


def _decide(
    tpu: str | None, strategy: str | None, tpu_failure: str | None = None
) -> _Decision:
    """Chooses a strategy name without building it (so it is cheap and testable).

    `tpu_failure` is set when building the TPU strategy already failed: the TPU is
    then skipped with that reason.
    """
    if strategy is not None:
        return _decide_forced(tpu, strategy)

    if tpu_failure is None:
        target, why_not = _tpu_candidate(tpu)
        if target is not None:
            return _Decision("tpu", (), tpu_target=target)
    else:
        why_not = tpu_failure  # Do not probe again: it already failed.
    skipped = [f"tpu ({why_not})"]

    spec = read_tf_config()
    tasks = None if spec is None else spec.num_tasks
    if spec is not None and spec.num_tasks > 1:
        spec.require_task()
        return _Decision("multi_worker", tuple(skipped))
    skipped.append(
        "multi_worker (TF_CONFIG unset)"
        if tasks is None
        else f"multi_worker (TF_CONFIG has {tasks} task{'' if tasks == 1 else 's'}; "
        f"needs 2+ workers/chief)"
    )

    gpus = _gpu_count()
    if gpus >= 2:
        return _Decision("mirrored", tuple(skipped))
    cpus = _logical_cpu_count() if gpus == 0 else 1
    if cpus > 1:  # The user split the CPU to get replicas: give them replicas.
        return _Decision("mirrored", tuple(skipped), reason=(
            f"0 GPUs and the CPU is split into {cpus} logical devices "
            f"(split_cpu or tf.config.set_logical_device_configuration)"))
    skipped.append(f"mirrored ({gpus} GPUs)")
    if gpus == 1:
        return _Decision("one_device", tuple(skipped))
    skipped.append("one_device (0 GPUs)")
    return _Decision("cpu", tuple(skipped))


def _decide_forced(tpu: str | None, strategy: str) -> _Decision:
    """Validates a forced choice; raises with the fix if it cannot work here."""
    if strategy not in VALID_STRATEGIES:
        raise ValueError(
            f"Unknown strategy {strategy!r}: use one of {', '.join(VALID_STRATEGIES)}, "
            f"or None to choose automatically."
        )
    if strategy == "tpu":
        target, why_not = _tpu_candidate(tpu)
        if target is None:
            raise RuntimeError(
                f"strategy='tpu' but no TPU is reachable: {why_not}. Run on a TPU VM, "
                f"pass tpu=/set TPU_NAME to a reachable TPU, or use strategy=None to "
                f"fall back automatically."
            )
        return _Decision("tpu", (), forced=True, tpu_target=target)
    if strategy == "multi_worker":
        spec = read_tf_config()
        if spec is None:
            raise RuntimeError(
                "strategy='multi_worker' needs TF_CONFIG describing the cluster and this "
                "task: set TF_CONFIG on every worker, or use strategy='mirrored' for "
                "one machine."
            )
        spec.require_task()
    return _Decision(strategy, (), forced=True)


def _tpu_candidate(tpu: str | None) -> tuple[str | None, str]:
    """Returns (target for TPUClusterResolver, "") or (None, why there is no TPU)."""
    if tpu:
        target, source = tpu, f"tpu={tpu!r}"
    elif os.environ.get("TPU_NAME"):
        target, source = os.environ["TPU_NAME"], f"TPU_NAME={os.environ['TPU_NAME']!r}"
    elif _local_tpu_devices():
        target, source = "local", "local TPU devices"
    else:
        return None, "no tpu argument, TPU_NAME unset, no local TPU devices"

    if target == "local":
        return target, ""  # Attached chips: nothing on the network to wait for.
    if target.startswith("grpc://"):
        problem = _tf_server_problem(target)
        if problem:
            return None, f"{source}: {problem}"
        return target, ""
    # A bare TPU name is looked up through the GCE metadata server and Cloud TPU API.
    if not _on_gce():
        return None, (
            f"{source} is a TPU name, which needs the GCE metadata server, and none "
            f"answered within {_METADATA_PROBE_TIMEOUT_S:g} s (not on Google Cloud?)"
        )
    return target, ""


def _local_tpu_devices() -> list[str]:
    """Device files of TPU chips attached to this host (TPU VMs expose these)."""
    accel = glob.glob("/dev/accel*")
    vfio = [p for p in glob.glob("/dev/vfio/*") if os.path.basename(p) != "vfio"]
    return sorted(accel + vfio)


def _tf_server_problem(address: str) -> str:
    """Returns "" if a TF gRPC server answers at `address`, else what went wrong.

    Asks for the worker status with a short deadline, because a bare TCP connect
    succeeds through proxies even when no TPU worker is behind them.
    """
    host_port = address[len("grpc://"):] if address.startswith("grpc://") else address
    try:
        import grpc  # A TensorFlow dependency; imported late, only TPU users need it.
    except ImportError:
        return _tcp_problem(host_port)
    with grpc.insecure_channel(host_port) as channel:
        get_status = channel.unary_unary("/tensorflow.WorkerService/GetStatus")
        try:
            get_status(b"", timeout=_GRPC_PROBE_TIMEOUT_S)
        except grpc.RpcError as e:
            return (
                f"no TensorFlow server at {address} ({e.code().name}: {e.details()}; "
                f"probed with a {_GRPC_PROBE_TIMEOUT_S:g} s deadline)"
            )
    return ""


def _tcp_problem(host_port: str) -> str:
    """Fallback probe when grpc is missing: can we open a TCP connection at all?"""
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=_GRPC_PROBE_TIMEOUT_S):
            return ""
    except (OSError, ValueError) as e:
        return f"cannot connect to {host_port} ({e})"


def _on_gce() -> bool:
    """True if the GCE metadata server answers (probed by IP: DNS may hang)."""
    try:
        conn = http.client.HTTPConnection(
            os.environ.get("GCE_METADATA_IP", _METADATA_IP),
            timeout=_METADATA_PROBE_TIMEOUT_S,
        )
        try:
            conn.request("GET", "/", headers={"Metadata-Flavor": "Google"})
            # Only Google's server echoes this header; other clouds' metadata
            # servers and proxies at this address do not.
            return conn.getresponse().getheader("Metadata-Flavor") == "Google"
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return False


def _tf_config_task_count() -> int | None:
    """Number of worker + chief tasks in $TF_CONFIG, or None if it is unset."""
    spec = read_tf_config()
    return None if spec is None else spec.num_tasks


def _gpu_count() -> int:
    return len(tf.config.list_physical_devices("GPU"))


def _logical_cpu_count() -> int:
    """Logical CPU devices configured (split_cpu), without starting TF's runtime."""
    configs = [tf.config.get_logical_device_configuration(cpu)
               for cpu in tf.config.list_physical_devices("CPU")]
    return sum(len(config) if config else 1 for config in configs)


def _build(decision: _Decision, communication: CommunicationOptions) -> tf.distribute.Strategy:
    """Constructs the strategy `_decide` chose."""
    name = decision.name
    if name == "tpu":
        return _build_tpu(decision.tpu_target or "local")
    if name == "multi_worker":
        # Blocks until every task in TF_CONFIG is up; say so, since it logs nothing.
        logging.info(
            "tputrain: starting MultiWorkerMirroredStrategy; waiting for all %d tasks "
            "in TF_CONFIG to start.",
            _tf_config_task_count() or 1,
        )
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=communication.for_multi_worker())
    if name == "mirrored":
        if _gpu_count() > 0:
            return tf.distribute.MirroredStrategy(cross_device_ops=communication.for_mirrored())
        # No GPUs: mirror over the logical CPUs (see split_cpu) for real replicas,
        # whether forced or chosen because the CPU is split.
        # Reduce on one device: on CPUs the default collective all-reduce restarts its
        # group keys per strategy, so a second strategy of another size in the same
        # process (a notebook, a test suite) aborts. The maths is the same.
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        return tf.distribute.MirroredStrategy(
            devices=cpus, cross_device_ops=tf.distribute.ReductionToOneDevice())
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if _gpu_count() else "/cpu:0")
    if name == "cpu":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    raise AssertionError(f"unhandled strategy {name!r}")


def _needs_cloud_api(target: str) -> bool:
    """A TPU *name* (not "local", not a grpc:// address) is looked up in the Cloud API."""
    return target != "local" and not target.startswith("grpc://")


def _build_tpu(target: str) -> tf.distribute.TPUStrategy:
    """Connects to and initialises the TPU; raises _TpuUnavailable on failure."""
    if target == "local" and not _tpu_kernels_registered():
        # Checked first because initialize_tpu_system clears every eager cache and
        # garbage-collects before failing: seconds to tens of seconds in a busy process.
        raise _TpuUnavailable(
            "tpu='local': this TensorFlow build has no TPU kernels (ConfigureDistributedTPU "
            "is not registered); on a TPU VM install tensorflow-tpu (see the README)"
        )
    if _needs_cloud_api(target) and importlib.util.find_spec("googleapiclient") is None:
        # TPUClusterResolver finds a TPU by name through the Cloud TPU API client
        # (cloud_tpu_client, else TF's own copy), which needs google-api-python-client.
        raise _TpuUnavailable(
            f"TPU {target!r} is found by name through the Cloud TPU API, which needs "
            "google-api-python-client: pip install 'tputrain[tpu]'")
    try:
        with _socket_timeout(_CLOUD_API_TIMEOUT_S):
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=target)
            master = resolver.master()  # Named TPUs: resolved through the Cloud API.
        if master and master != target:
            problem = _tf_server_problem(master)
            if problem:
                raise _TpuUnavailable(f"TPU {target!r} resolved to {master}, but {problem}")
        tf.config.experimental_connect_to_cluster(resolver)  # No-op for "local".
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    except _TpuUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means "no TPU": report it.
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise _TpuUnavailable(
            f"tpu={target!r}: {type(e).__name__}: {first_line}"
        ) from e


def _tpu_kernels_registered() -> bool:
    """True if this TensorFlow build can initialise attached TPU chips.

    Plain `tensorflow` wheels lack the TPU system kernels; `tensorflow-tpu` has them.
    A remote (grpc://) TPU runs them on its own worker, so this is for "local" only.
    """
    try:
        from tensorflow.python.framework import kernels  # Not in the public API.
    except ImportError:
        return True  # Cannot tell: let initialize_tpu_system decide.
    return bool(kernels.get_registered_kernels_for_op("ConfigureDistributedTPU").kernel)


@contextlib.contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    """Bounds socket calls (urlopen, httplib2) made by libraries that set no timeout."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def _describe(decision: _Decision, built: tf.distribute.Strategy) -> str:
    """The one log line: strategy, replicas, and why earlier options were skipped."""
    replicas = built.num_replicas_in_sync
    line = (
        f"tputrain: using {_strategy_label(decision, built)}, {replicas} "
        f"replica{'' if replicas == 1 else 's'}"
    )
    line += f": {decision.reason}." if decision.reason else "."
    if decision.forced:
        return f"{line} Forced by strategy={decision.name!r}."
    if decision.skipped:
        return f"{line} Skipped: {'; '.join(decision.skipped)}"
    return line


_CLASS_NAMES = {
    "tpu": "TPUStrategy",
    "multi_worker": "MultiWorkerMirroredStrategy",
    "mirrored": "MirroredStrategy",
    "one_device": "OneDeviceStrategy",
    "cpu": "OneDeviceStrategy",
}


def _strategy_label(decision: _Decision, built: tf.distribute.Strategy) -> str:
    """E.g. "OneDeviceStrategy(/cpu:0)", "MirroredStrategy(4 CPU devices)"."""
    cls = _CLASS_NAMES[decision.name]
    if decision.name == "tpu":
        return f"{cls}({decision.tpu_target})"
    if decision.name == "multi_worker":
        return f"{cls}({_tf_config_task_count() or 1} tasks)"
    devices = [d.rsplit("device:", 1)[-1] for d in built.extended.worker_devices]
    if len(devices) == 1:
        return f"{cls}(/{devices[0].lower()})"
    return f"{cls}({len(devices)} {devices[0].split(':')[0]} devices)"
