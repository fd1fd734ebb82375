"""Tests for tputrain/distribution/strategy.py: fallback order, forced choices, never hanging."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import gin
import pytest
import tensorflow as tf

from tputrain.distribution import strategy as strategy_lib

# At import (collection) time, before any test initialises TensorFlow: a no-op when
# conftest.py already split the CPU into 4, and what makes this file pass standalone.
strategy_lib.split_cpu(4)

NUM_CPUS = 4
requires_no_gpu = pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")), reason="expects a CPU-only machine"
)


@pytest.fixture(autouse=True)
def no_cluster_env(monkeypatch):
    """Each test starts with no TPU, no TF_CONFIG and no local TPU devices."""
    for var in ("TPU_NAME", "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(strategy_lib, "_local_tpu_devices", lambda: [])


@pytest.fixture
def log_lines(caplog):
    """The tputrain lines absl logged during the test."""
    caplog.set_level(logging.INFO, logger="absl")
    return lambda: [r.getMessage() for r in caplog.records if "tputrain: using" in r.getMessage()]


@pytest.fixture
def unsplit_cpu(monkeypatch):
    """Resolution as in a process whose CPU is not split (pytest's own is split in 4)."""
    monkeypatch.setattr(strategy_lib, "_logical_cpu_count", lambda: 1)


def _timed(fn, *args, **kwargs):
    # Start TensorFlow's runtime first: the bound is on the resolver's own work
    # (probes, TPU attempt, fallback), not on a cold runtime start in a busy worker.
    tf.constant(0.0) + 1.0
    start = time.monotonic()
    result = fn(*args, **kwargs)
    return result, time.monotonic() - start


@requires_no_gpu
def test_default_is_one_cpu_replica_fast_and_says_why(log_lines, unsplit_cpu):
    strategy, seconds = _timed(strategy_lib.resolve_strategy)

    assert seconds < 3
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert strategy.num_replicas_in_sync == 1
    (line,) = log_lines()
    assert line.startswith("tputrain: using OneDeviceStrategy(/cpu:0), 1 replica.")
    for why in ("TPU_NAME unset", "no local TPU devices", "TF_CONFIG unset", "(0 GPUs)"):
        assert why in line


def test_forced_mirrored_uses_every_logical_cpu(log_lines):
    strategy = strategy_lib.resolve_strategy(strategy="mirrored")

    assert strategy.num_replicas_in_sync == NUM_CPUS
    # The replicas are real: each one runs and the ids sum to 0 + 1 + 2 + 3.
    ids = strategy.run(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group)
    assert int(strategy.reduce("SUM", ids, axis=None)) == sum(range(NUM_CPUS))
    assert "MirroredStrategy(4 CPU devices), 4 replicas. Forced" in log_lines()[0]


@requires_no_gpu
@pytest.mark.parametrize("name", ["one_device", "cpu"])
def test_forced_one_device_without_gpu_uses_cpu(name):
    strategy = strategy_lib.resolve_strategy(strategy=name)

    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert strategy.extended.worker_devices[0].endswith("CPU:0")


def test_forced_tpu_without_tpu_raises_quickly():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"strategy='tpu' but no TPU is reachable.*TPU_NAME"):
        strategy_lib.resolve_strategy(strategy="tpu")
    assert time.monotonic() - start < 3


@requires_no_gpu
def test_unreachable_tpu_address_falls_back_quickly(monkeypatch, log_lines, unsplit_cpu):
    monkeypatch.setenv("TPU_NAME", "grpc://10.255.255.1:8470")

    strategy, seconds = _timed(strategy_lib.resolve_strategy)

    assert seconds < 3
    assert strategy.num_replicas_in_sync == 1
    (line,) = log_lines()
    assert "Skipped: tpu (TPU_NAME='grpc://10.255.255.1:8470': no TensorFlow server" in line


@pytest.fixture
def silent_server():
    """A port that accepts TCP connections but never answers, like a dead TPU worker."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # The kernel completes handshakes; nothing ever reads.
    yield f"grpc://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_silent_tpu_worker_is_skipped_within_the_probe_deadline(silent_server):
    decision, seconds = _timed(strategy_lib._decide, silent_server, None)

    assert seconds < 3
    assert decision.name != "tpu"
    assert silent_server in decision.skipped[0]


def test_tpu_name_without_metadata_server_is_skipped_quickly():
    if strategy_lib._on_gce():
        pytest.skip("on Google Cloud the name would be looked up for real")
    decision, seconds = _timed(strategy_lib._decide, "my-tpu", None)

    assert seconds < 3
    assert decision.skipped[0].startswith("tpu (tpu='my-tpu' is a TPU name")
    assert "metadata server" in decision.skipped[0]


@requires_no_gpu
def test_local_tpu_devices_that_fail_to_initialise_fall_back(monkeypatch, log_lines, unsplit_cpu):
    monkeypatch.setattr(strategy_lib, "_local_tpu_devices", lambda: ["/dev/accel0"])

    strategy, seconds = _timed(strategy_lib.resolve_strategy)

    assert seconds < 3
    assert strategy.num_replicas_in_sync == 1
    # This plain `tensorflow` build has no TPU kernels: said before trying to initialise.
    assert "Skipped: tpu (tpu='local': this TensorFlow build has no TPU kernels" in log_lines()[0]
    assert "install tensorflow-tpu" in log_lines()[0]


_FAILING_LOCAL_TPU = """
from tputrain.distribution import strategy as strategy_lib
strategy_lib._local_tpu_devices = lambda: ["/dev/accel0"]
strategy_lib._tpu_kernels_registered = lambda: True
strategy_lib._logical_cpu_count = lambda: 1  # as unsplit_cpu
print("replicas", strategy_lib.resolve_strategy().num_replicas_in_sync)
"""


@requires_no_gpu
def test_local_tpu_initialisation_failure_falls_back():
    # A TPU-capable build whose chips fail to initialise: TF's own error is reported.
    # In a fresh process: TF's initialize_tpu_system clears every eager cache and
    # garbage-collects before it fails, which in a worker that has run many tests took
    # minutes (and emptied the caches of the tests after it).
    from faults import child_env

    result = subprocess.run([sys.executable, "-c", _FAILING_LOCAL_TPU], env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["replicas", "1"]
    lines = [line for line in result.stderr.splitlines() if "tputrain: using" in line]
    assert "Skipped: tpu (tpu='local': NotFoundError" in lines[0], result.stderr[-3000:]


def test_forced_local_tpu_that_fails_raises():
    with pytest.raises(RuntimeError, match="strategy='tpu' but the TPU could not be used"):
        strategy_lib.resolve_strategy(tpu="local", strategy="tpu")


def test_forced_multi_worker_without_tf_config_raises():
    with pytest.raises(RuntimeError, match="needs TF_CONFIG"):
        strategy_lib.resolve_strategy(strategy="multi_worker")


def _set_tf_config(monkeypatch, cluster, task=None):
    config = {"cluster": cluster}
    if task is not None:
        config["task"] = task
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))


@requires_no_gpu
def test_tf_config_with_one_task_is_not_multi_worker(monkeypatch, unsplit_cpu):
    _set_tf_config(monkeypatch, {"worker": ["localhost:12345"]}, {"type": "worker", "index": 0})

    decision = strategy_lib._decide(None, None)

    assert decision.name == "cpu"
    assert "multi_worker (TF_CONFIG has 1 task; needs 2+ workers/chief)" in decision.skipped
    assert strategy_lib.resolve_strategy().num_replicas_in_sync == 1


def test_tf_config_with_chief_and_worker_decides_multi_worker(monkeypatch):
    # Only the decision: building it would block until the peer task starts.
    _set_tf_config(
        monkeypatch,
        {"chief": ["localhost:12345"], "worker": ["localhost:12346"]},
        {"type": "chief", "index": 0},
    )

    decision = strategy_lib._decide(None, None)

    assert decision.name == "multi_worker"
    assert decision.skipped == ("tpu (no tpu argument, TPU_NAME unset, no local TPU devices)",)
    assert strategy_lib._tf_config_task_count() == 2


def test_tf_config_errors_name_the_fix(monkeypatch):
    _set_tf_config(monkeypatch, {"worker": ["a:1", "b:2"]})
    with pytest.raises(ValueError, match='add "task"'):
        strategy_lib._decide(None, None)
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        strategy_lib._decide(None, None)


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match="Unknown strategy 'gpu'") as info:
        strategy_lib.resolve_strategy(strategy="gpu")
    for name in strategy_lib.VALID_STRATEGIES:
        assert name in str(info.value)


def test_split_cpu_is_a_noop_for_the_same_count_and_explains_a_different_one():
    strategy_lib.split_cpu(NUM_CPUS)
    assert len(tf.config.list_logical_devices("CPU")) == NUM_CPUS
    with pytest.raises(RuntimeError, match="already initialised with 4 logical CPU"):
        strategy_lib.split_cpu(2)
    with pytest.raises(ValueError, match="num_devices >= 1"):
        strategy_lib.split_cpu(0)


def test_strategy_is_gin_configurable():
    import tputrain.config.registry  # noqa: F401  gin's configurables (docs/configuration.md)
    gin.clear_config()
    try:
        gin.parse_config("resolve_strategy.strategy = 'mirrored'")
        assert strategy_lib.resolve_strategy().num_replicas_in_sync == NUM_CPUS
    finally:
        gin.clear_config()


# ---------------------------------------------------------------- a split CPU


@requires_no_gpu
def test_auto_mirrors_over_a_split_cpu_and_says_why(log_lines):
    strategy = strategy_lib.resolve_strategy()

    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == NUM_CPUS
    # The same one-device reduction as forced mirrored on CPUs (see _build).
    assert isinstance(strategy.extended._cross_device_ops, tf.distribute.ReductionToOneDevice)
    (line,) = log_lines()
    assert line.startswith("tputrain: using MirroredStrategy(4 CPU devices), 4 replicas: 0 GPUs "
                           "and the CPU is split into 4 logical devices (split_cpu")
    assert "Skipped: tpu (" in line and "multi_worker (TF_CONFIG unset)" in line


def test_configure_devices_applies_a_bound_split_cpu_and_ignores_an_unbound_one():
    import tputrain.config.registry  # noqa: F401  gin's configurables (docs/configuration.md)
    assert strategy_lib.configure_devices() is None  # nothing bound: nothing to do
    gin.parse_config(f"split_cpu.num_devices = {NUM_CPUS}")
    strategy_lib.configure_devices()  # already split in 4: a no-op
    gin.clear_config()
    gin.parse_config("split_cpu.num_devices = 2")
    with pytest.raises(RuntimeError, match=r"split_cpu.num_devices = 2 .* already initialised "
                                           r"with 4 logical CPU.*before any TensorFlow op"):
        strategy_lib.configure_devices()


_SPLIT_SCRIPT = """
from absl import logging
import tputrain
logging.set_verbosity(logging.INFO)  # What absl's app.run gives a script.
tputrain.split_cpu(2)
strategy = tputrain.resolve_strategy()
print("replicas", strategy.num_replicas_in_sync)
"""


def _quiet_env():
    """A child on a CPU-only, single-machine view of this host, with quiet TF."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    for var in ("TF_CONFIG", "TPU_NAME"):
        env.pop(var, None)
    return env


@pytest.mark.slow
def test_a_split_cpu_script_trains_on_every_logical_cpu():
    """A newcomer's `split_cpu(2)` then `resolve_strategy()` got 1 replica, silently."""
    result = subprocess.run([sys.executable, "-c", _SPLIT_SCRIPT], env=_quiet_env(),
                            capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas 2" in result.stdout
    assert ("using MirroredStrategy(2 CPU devices), 2 replicas: 0 GPUs and the CPU is split "
            "into 2 logical devices (split_cpu") in result.stderr


def _run_cli(tmp_path, *args, env=None):
    command = [sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
               f"--model_dir={tmp_path / 'model'}", *args]
    env = dict(env or _quiet_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)


@pytest.mark.slow
def test_cli_gin_split_cpu_trains_on_two_replicas(tmp_path):
    result = _run_cli(tmp_path, "--gin_param=split_cpu.num_devices=2",
                      "--gin_param=Trainer.train_steps=20", "--gin_param=Trainer.steps_per_loop=10")

    assert result.returncode == 0, result.stderr[-3000:]
    assert "tputrain: MirroredStrategy, 2 replica(s) on 1 host(s)" in result.stderr
    assert "done at step 20" in result.stderr
    assert "split_cpu.num_devices = 2" in (tmp_path / "model" / "operative_config.gin").read_text()


@pytest.mark.slow
def test_cli_gin_split_cpu_after_tensorflow_started_fails_naming_the_fix(tmp_path):
    # A --gin_import module that runs a TF op at import starts the runtime too early.
    (tmp_path / "eager_at_import.py").write_text("import tensorflow as tf\ntf.constant(1.0) + 1\n")
    env = dict(_quiet_env(), PYTHONPATH=str(tmp_path))

    result = _run_cli(tmp_path, "--gin_import=eager_at_import", "--gin_param=split_cpu.num_devices=2",
                      "--gin_param=Trainer.train_steps=20", env=env)

    assert result.returncode == 2
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("tputrain: error")]
    assert "split_cpu.num_devices = 2" in error and "already initialised" in error
    assert "--gin_import" in error
    assert "step 10" not in result.stderr


def test_a_named_tpu_without_the_cloud_api_client_names_the_extra(monkeypatch):
    """Finding a TPU by name needs google-api-python-client (`tputrain[tpu]`)."""
    from tputrain.distribution import strategy as strategy_module

    real_find_spec = strategy_module.importlib.util.find_spec
    monkeypatch.setattr(strategy_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "googleapiclient" else real_find_spec(name, *a))
    with pytest.raises(strategy_module._TpuUnavailable, match=r"pip install 'tputrain\[tpu\]'"):
        strategy_module._build_tpu("my-tpu")
    assert not strategy_module._needs_cloud_api("grpc://10.0.0.2:8470")
    assert not strategy_module._needs_cloud_api("local")


def test_a_strategy_over_a_device_that_does_not_exist_is_refused_naming_the_fix(tmp_path):
    # TensorFlow builds MirroredStrategy(["/cpu:0", "/cpu:7"]) on a 4-device CPU, and the
    # first all-reduce then waits forever for the missing replica.
    from tiny import TinyTask
    import tputrain
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:7"])
    with pytest.raises(ValueError, match=r"(?s)CPU:7.*split_cpu"):
        tputrain.Trainer(TinyTask(num_examples=32), str(tmp_path), strategy=strategy,
                         global_batch_size=8, train_steps=2, report_mfu=False)
    strategy_lib.check_devices_exist(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:3"]))
