"""Test setup: split the CPU into 4 logical devices before TensorFlow starts.

Multi-replica behaviour is tested for real: MirroredStrategy over 2 or 4 of
these logical CPUs runs the same collectives as over GPUs.
"""

import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# One persistent XLA compilation cache for the whole run: the process that starts
# pytest makes it, its xdist workers and every child process (launch workers, the
# CLI) inherit it through TF_XLA_FLAGS, so a program compiled once (the same tiny
# models' steps and per-device updates, hundreds of times) is read back after.
# TensorFlow writes each entry to a temporary file and renames it into place.
_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
_OWN_XLA_CACHE = None
if _CACHE_FLAG not in os.environ.get("TF_XLA_FLAGS", ""):
    _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="tputrain-test-xla-cache-")
    os.environ["TF_XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("TF_XLA_FLAGS"), f"{_CACHE_FLAG}={_OWN_XLA_CACHE}",
        "--tf_xla_persistent_cache_device_types=CPU"]))

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_CPU_DEVICES = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_DEVICES)


# ------------------------------------------------------------ scheduling under -n N
#
# `pytest -n 3` (CI, on 2 cores: a third worker fills the time the others wait on
# child processes, 16 min against 18.6 with -n 2) balances tests over 3 workers.
# Two things decide its wall time:
# - Tests that share a module- or session-scoped fixture must run on one worker, or
#   each worker computes the fixture (minutes for the replica-equivalence ones).
#   SAME_WORKER lists them: a group is one unit of work for xdist.
# - The longest units must start first, or a worker can be left running one at the
#   end while the other idles. START_FIRST orders the collection (and so xdist's
#   queue), longest first; then the other `slow` tests, then the rest.
# (Not pytest.mark.xdist_group: `--dist loadgroup` of pytest-xdist 3.8 renames node
# ids through `item._nodeid`, which pytest 9 no longer has, so it groups nothing.)

SAME_WORKER = {  # node id prefix (after tests/) -> group
    "test_replica_equivalence.py::": "replica_equivalence",  # conftest's one_replica,
    "test_replica_equivalence_multiworker.py::": "replica_equivalence",  # two_workers
    "test_run.py::test_digits_trains_reruns_and_continues": "readme_digits",
    "test_export.py::test_readme_command_exports_a_model": "readme_digits",
    "test_trainer.py::test_replicas_match_single_device": "single_device",
    "test_gcs.py::": "test_gcs.py",  # module-scoped fixtures
    "test_init_checkpoint.py::": "test_init_checkpoint.py",
    "test_tfds.py::": "test_tfds.py",
}

START_FIRST = (  # minutes each on a loaded 2-core machine; longest first
    "test_replica_equivalence_multiworker.py::",  # with test_replica_equivalence.py
    "test_trainer_multiworker.py::test_kill_9_of_a_worker",
    "test_trainer.py::test_padded_eval_counts_every_example_once",
    "test_trainer_multiworker.py::test_uneven_eval_shards",
    "test_trainer.py::test_resume_continues_and_matches_uninterrupted",
    "test_run.py::test_digits_trains_reruns_and_continues",  # with test_export.py's
    "test_vertex.py::test_spec_parses_as_the_vertex_ai_api_message",
    "test_run.py::test_sigkill_midway_resumes",
    "test_docs.py::test_every_runnable_snippet_runs",
    "test_launch.py::test_two_workers_train_chief_checkpoints",
    "test_tfds.py::",
    "test_export.py::test_mixed_bfloat16_run_serves_float32",
)


def _name(nodeid: str) -> str:
    return nodeid.rsplit("/", 1)[-1]


def _start_rank(item) -> int:
    name = _name(item.nodeid)
    for rank, prefix in enumerate(START_FIRST):
        if name.startswith(prefix):
            return rank
    return len(START_FIRST) + (0 if item.get_closest_marker("slow") else 1)


def pytest_unconfigure(config):
    if _OWN_XLA_CACHE:  # the process that made it, after every worker is done
        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # stable: collection order within a rank


def pytest_xdist_make_scheduler(config, log):
    """Under `-n N` (xdist's default `--dist load`): each SAME_WORKER group is one unit,
    every other test its own, queued in collection order. An explicit --dist wins."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SameWorkerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = _name(nodeid)
            for prefix, group in SAME_WORKER.items():
                if name.startswith(prefix):
                    return group
            return nodeid

    config.option.loadscopereorder = False  # keep START_FIRST's order, not group sizes
    return SameWorkerScheduling(config, log)


@pytest.fixture(autouse=True)
def _float32_policy():
    """Each test starts (and leaves) the global Keras precision policy at float32."""
    import keras

    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True)
def _clear_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="session")
def one_replica(tmp_path_factory):
    """Every optimizer option trained on 1 replica: the reference of both
    test_replica_equivalence.py and test_replica_equivalence_multiworker.py (one
    SAME_WORKER group, so one worker computes it once)."""
    from equivalence import train_one_replica

    return train_one_replica(tmp_path_factory.mktemp("one_replica"))


@pytest.fixture(scope="session")
def readme_digits(tmp_path_factory):
    """README command 1, `tputrain --gin_file=digits.gin --model_dir=...` (1200 steps of
    digits), run once for test_run.py and test_export.py (one SAME_WORKER group): (the
    directory holding model/ and the data cache cache/, the finished process)."""
    root = tmp_path_factory.mktemp("readme_digits")
    env = dict(os.environ, TPUTRAIN_CACHE_DIR=str(root / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    for name in ("TF_CONFIG", "AIP_MODEL_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
                             f"--model_dir={root / 'model'}"],
                            env=env, capture_output=True, text=True, timeout=300, cwd=root)
    return root, result
