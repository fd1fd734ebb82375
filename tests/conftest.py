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

# The support modules (tiny, faults, processes, ...) live in tests/support/ and are
# imported by bare name (`import tiny`, `--gin_import=faults`): here, and in every
# child process a test starts (the CLI, `tputrain launch` workers), through PYTHONPATH.
_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)
if _SUPPORT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [_SUPPORT, os.environ.get("PYTHONPATH")]))

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

# tputrain's own cache (the digits TFRecords, the CPU's measured peak FLOP/s) in one
# folder for the run, not the user's ~/.cache: a peak probed while three workers
# share two cores reads low, and the user's runs would have kept it.
_OWN_CACHE = None
if "TPUTRAIN_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["TPUTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tputrain-test-cache-")

import pytest  # noqa: E402

import tputrain  # noqa: E402,F401  (first: its import of TF drops TF's start-up noise)
import tensorflow as tf  # noqa: E402

NUM_CPU_DEVICES = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_DEVICES)


# ------------------------------------------------------------ scheduling under -n N
#
# `pytest -n 3` (CI, on 2 cores: a third worker fills the time the others wait on
# child processes) balances tests over 3 workers. Two markers decide its wall time:
# - `@pytest.mark.same_worker("group")` (on a test, or a module's `pytestmark`):
#   tests that share a module- or session-scoped fixture run on one worker, or each
#   worker computes the fixture (minutes for the replica-equivalence ones). A group
#   is one unit of work for xdist.
# - `@pytest.mark.start_early(order)`: the longest units start first (lowest order
#   first), or a worker can be left running one at the end while the others idle;
#   then the other `slow` tests, then the rest.
# xdist's scheduler runs in the controlling process, which collects no tests, so it
# reads the `same_worker` marks from the test files' source (`same_worker_groups`).
# (Not pytest.mark.xdist_group: `--dist loadgroup` of pytest-xdist 3.8 renames node
# ids through `item._nodeid`, which pytest 9 no longer has, so it groups nothing.)

_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked `slow` (the whole suite: about 45 minutes "
                          "on 2 cores); without it, and without -m, they are deselected")


def pytest_configure(config):
    config.addinivalue_line("markers", "same_worker(group): run on the worker of its group")
    config.addinivalue_line("markers", "start_early(order): start before the rest, lowest first")


def _marks_in(node) -> list:
    """The `pytest.mark.same_worker(...)` calls in a decorator or a `pytestmark` value."""
    import ast

    values = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    return [value for value in values if isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute) and value.func.attr == "same_worker"]


def suite_files(directory: str = _TESTS) -> list[str]:
    """Every `test_*.py` under `directory` (tests/ and its folders, as tests/loop/), sorted
    by path. Their base names are unique (pytest's default import mode needs it), so a
    node id's file name alone names its module."""
    found = []
    for folder, subfolders, names in os.walk(directory):
        subfolders[:] = sorted(name for name in subfolders
                               if name not in ("support", "__pycache__") and not name.startswith("."))
        found += [os.path.join(folder, name) for name in names
                  if name.startswith("test_") and name.endswith(".py")]
    return sorted(found)


def same_worker_groups(directory: str = _TESTS) -> dict[str, str]:
    """node id prefix (`file.py::` or `file.py::test`, the file's base name) -> group,
    from the source of every test file under `directory`."""
    import ast

    groups = {}
    for path in suite_files(directory):
        name = os.path.basename(path)
        with open(path) as source:
            tree = ast.parse(source.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    getattr(target, "id", None) == "pytestmark" for target in node.targets):
                for mark in _marks_in(node.value):
                    groups[f"{name}::"] = mark.args[0].value
            elif isinstance(node, ast.FunctionDef):
                for decorator in node.decorator_list:
                    for mark in _marks_in(decorator):
                        groups[f"{name}::{node.name}"] = mark.args[0].value
    return groups


def _group_of(nodeid: str, groups: dict[str, str]) -> str:
    name = _name(nodeid)
    module, _, test = name.partition("::")
    test = test.split("[", 1)[0]
    return groups.get(f"{module}::{test}") or groups.get(f"{module}::") or nodeid


def _name(nodeid: str) -> str:
    return nodeid.rsplit("/", 1)[-1]


def _start_rank(item) -> tuple[int, int]:
    early = item.get_closest_marker("start_early")
    if early is not None:
        return 0, early.args[0]
    return (1 if item.get_closest_marker("slow") else 2), 0


def pytest_unconfigure(config):
    for own in (_OWN_XLA_CACHE, _OWN_CACHE):  # the process that made it, after every worker
        if own:
            shutil.rmtree(own, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The default run leaves out the `slow` tier (`--slow`, or any `-m`, keeps it), then
    orders the rest (`_start_rank`)."""
    if not config.getoption("--slow") and not config.getoption("markexpr"):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    items.sort(key=_start_rank)  # stable: collection order within a rank


def pytest_xdist_make_scheduler(config, log):
    """Under `-n N` (xdist's default `--dist load`): each `same_worker` group is one unit,
    every other test its own, queued in collection order. An explicit --dist wins."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups = same_worker_groups()

    class SameWorkerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid, groups)

    config.option.loadscopereorder = False  # keep start_early's order, not group sizes
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
    `same_worker` group, so one worker computes it once)."""
    from equivalence import train_one_replica

    return train_one_replica(tmp_path_factory.mktemp("one_replica"))


@pytest.fixture(scope="session")
def readme_digits(tmp_path_factory):
    """README command 1, `tputrain --gin_file=digits.gin --model_dir=...` (1200 steps of
    digits), run once for test_run.py and test_export.py (one `same_worker` group): (the
    directory holding model/ and the data cache cache/, the finished process)."""
    root = tmp_path_factory.mktemp("readme_digits")
    env = dict(os.environ, TPUTRAIN_CACHE_DIR=str(root / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    for name in ("TF_CONFIG", "AIP_MODEL_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
                             f"--model_dir={root / 'model'}"],
                            env=env, capture_output=True, text=True, timeout=300, cwd=root)
    return root, result


@pytest.fixture(autouse=True)
def _close_trainers(monkeypatch):
    """Every Trainer a test builds is closed when the test ends (`Trainer.close`), so its
    tf.data iterators end at a known point: freed later by the garbage collector, inside
    another test, an old iterator's end waited up to a minute on tf.data's autotuning
    thread (measured in this suite), with the worker's core idle.

    A Trainer is recorded when its construction completes (`Trainer._launch`, its last
    step): one that refused its arguments has nothing to close. (Not `__init__`: gin
    validates bindings against its signature.)"""
    import weakref

    from tputrain.trainer import Trainer

    built = weakref.WeakSet()
    launch = Trainer._launch

    def recording_launch(self, *args, **kwargs):
        launch(self, *args, **kwargs)
        built.add(self)

    monkeypatch.setattr(Trainer, "_launch", recording_launch)
    yield
    for trainer in list(built):
        trainer.close()
