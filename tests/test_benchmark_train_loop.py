"""benchmarks/train_loop.py: every contender trains on the same global batch.

The peers (Keras `fit`, the hand loop, Orbit) split a dataset of global batches over
the replicas themselves; tputrain's Task builds per-replica batches. A peer fed the
Task's per-replica batches trained on half the examples a step on 2 replicas, and
the benchmark compared tputrain with peers doing half its work.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import tensorflow as tf

ROOT = Path(__file__).resolve().parent.parent


def _train_loop():
    name = "train_loop"
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling result_file
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _per_replica_rows(dataset, strategy):
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    return [int(tf.shape(x)[0]) for x in strategy.experimental_local_results(batch[1])]


def test_peers_on_two_replicas_take_half_the_global_batch_each():
    bench = _train_loop()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    task = bench.MLPTask(8, (4,), batches=2)
    contender = bench.HandLoopContender(lambda: task, strategy, 16, "float32", 2)
    assert _per_replica_rows(bench.peer_inputs(contender, task), strategy) == [8, 8]


def test_peers_on_one_replica_take_the_global_batch():
    bench = _train_loop()
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    task = bench.MLPTask(8, (4,), batches=2)
    contender = bench.KerasFitContender(lambda: task, strategy, 16, "float32", 2)
    assert _per_replica_rows(bench.peer_inputs(contender, task), strategy) == [16]


@pytest.mark.slow  # building the three models: ~20 s on a busy machine
def test_the_keras_applications_workloads_build_logits_from_images():
    """MobileNet, EfficientNetB0 and ResNet50V2 (weights=None: nothing downloads) take
    the conv net's image input and give one float32 logit a class."""
    bench = _train_loop()
    for name in bench.APPLICATIONS:
        spec = bench.workload(name, quick=True)
        task = spec.task_factory()
        model = task.build_model()
        images = tf.zeros((2, task.size, task.size, 3))
        logits = model({"image": images}, training=False)
        assert logits.shape == (2, task.classes) and logits.dtype == tf.float32, name
        assert spec.model.startswith(f"keras.applications.{bench.APPLICATIONS[name][0]} ")


def test_a_run_under_instruction_set_caps_names_them_as_an_emulation(monkeypatch):
    bench = _train_loop()
    for name in bench.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert bench.isa_limits() == {}
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    assert bench.isa_limits() == {
        "emulation": "TF_ENABLE_ONEDNN_OPTS=0 XLA_FLAGS=--xla_cpu_max_isa=AVX2"}
