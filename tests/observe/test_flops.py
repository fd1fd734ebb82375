"""FLOPs of traced steps (checked against TF's own statistics and by hand) and peaks."""

import json
import os

import keras
import pytest
import tensorflow as tf

from tputrain.core.cpu_info import cpu_name
from tputrain.observe import flops


def tf_profiler_flops(graph, op_types):
    """TensorFlow's registered `flops` statistics, summed over the given op types."""
    builder = tf.compat.v1.profiler.ProfileOptionBuilder
    options = (builder(builder.float_operation()).with_empty_output()
               .with_accounted_types([f"^{t}$" for t in op_types]).build())
    return tf.compat.v1.profiler.profile(graph, options=options).total_float_ops


def test_matmul_and_conv_counts_agree_with_tensorflow_statistics():
    conv = keras.layers.Conv2D(8, 3, padding="same")
    dense = keras.layers.Dense(5)

    def step(images, a, b):
        with tf.GradientTape() as tape:
            h = conv(images)
            y = dense(tf.reshape(h, [4, -1]))
            loss = tf.reduce_sum(y) + tf.reduce_sum(tf.matmul(a, b))
        return loss, tape.gradient(loss, conv.trainable_variables + dense.trainable_variables)

    specs = (tf.TensorSpec([4, 6, 6, 3]), tf.TensorSpec([2, 3, 7]), tf.TensorSpec([2, 7, 9]))
    graph = tf.function(step).get_concrete_function(*specs).graph
    types = ["MatMul", "BatchMatMulV2", "Conv2D", "Conv2DBackpropFilter"]
    ours = sum(flops.op_flops(op) for op in graph.get_operations() if op.type in types)
    assert {op.type for op in graph.get_operations()} >= set(types)
    assert ours == tf_profiler_flops(graph, types) > 0
    # And by hand: conv 2*(4*6*6*8)*(3*3*3) forward + the same for its kernel gradient
    # (its input gradient is traced but never run: nothing needs it), dense 2*4*288*5
    # forward, kernel gradient and input gradient, batched matmul 2*2*3*9*7.
    by_hand = 2 * (2 * 4 * 6 * 6 * 8 * 27) + 3 * (2 * 4 * 288 * 5) + 2 * 2 * 3 * 9 * 7
    assert flops.count_flops(step, *specs) == by_hand


def test_adjoint_batch_matmul_contracts_the_right_axis():
    # TensorFlow's own BatchMatMulV2 statistic reads a `transpose_a` attribute the op
    # does not have (it is `adj_x`), so it would count 2*2*3*9*3 here.
    adjoint = lambda a, b: tf.matmul(a, b, adjoint_a=True)  # noqa: E731
    spec_a, spec_b = tf.TensorSpec([2, 7, 3]), tf.TensorSpec([2, 7, 9])
    assert flops.count_flops(adjoint, spec_a, spec_b) == 2 * 2 * 3 * 9 * 7


def test_einsum_is_counted():
    layer = keras.layers.EinsumDense("btd,dhk->bthk", output_shape=(None, 4, 8), name="proj")

    def forward(x):
        return layer(x)

    # 2 multiply-add FLOPs for each of b*t*h*k outputs over d=16 inputs.
    assert flops.count_flops(forward, tf.TensorSpec([2, 5, 16])) == 2 * 2 * 5 * 4 * 8 * 16
    scores = lambda q, k: tf.einsum("bqhd,bkhd->bhqk", q, k)  # noqa: E731
    spec = tf.TensorSpec([2, 6, 3, 4])
    assert flops.count_flops(scores, spec, spec) == 2 * (2 * 3 * 6 * 6) * 4


def test_dynamic_shapes_name_the_fix():
    dense = keras.layers.Dense(3)
    with pytest.raises(ValueError, match="drop_remainder=True.*flops_per_example"):
        flops.count_flops(lambda x: dense(x), tf.TensorSpec([None, 4]))


def test_device_table():
    assert flops.lookup_device("NVIDIA A100-SXM4-40GB") == flops.PEAK_FLOPS["a100"]
    assert flops.lookup_device("NVIDIA A10G") == flops.PEAK_FLOPS["a10"]
    assert flops.lookup_device("NVIDIA L4") == flops.PEAK_FLOPS["l4"]
    assert flops.lookup_device("Tesla T4") == flops.PEAK_FLOPS["t4"]
    assert flops.lookup_device("v5litepod-16") == flops.PEAK_FLOPS["tpu v5e"]
    assert flops.lookup_device("v4-8") == flops.PEAK_FLOPS["tpu v4"]
    assert flops.lookup_device("TPU v6e") == flops.PEAK_FLOPS["tpu v6e"]
    assert flops.lookup_device("Mystery 9000") is None
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    peak = flops.peak_flops("mixed_bfloat16", strategy, device_kind="TPU v4")
    assert peak.flops_per_second == 275e12
    assert flops.peak_flops("float32", strategy, device_kind="A100").flops_per_second == 156e12
    with pytest.raises(ValueError, match="peak_flops_per_device"):
        flops.peak_flops("float32", strategy, device_kind="Mystery 9000")
    assert flops.model_flops_utilization(2e9, 10.0, 40e9) == pytest.approx(0.5)


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path))
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    peak = flops.peak_flops("float32", strategy)
    assert peak.source == "measured CPU float32 matmul peak"
    assert 1e9 < peak.flops_per_second < 1e14  # a real CPU, whatever its load
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cached.values()) == [peak.flops_per_second]
    # Second call: read from the cache, not re-measured (the probe never repeats exactly).
    assert flops.peak_flops("float32", strategy).flops_per_second == peak.flops_per_second
    # The default (no) strategy is the same host CPU.
    assert flops.peak_flops("float32").flops_per_second == peak.flops_per_second


def test_a_cpu_peak_probed_on_a_busy_machine_is_raised_by_later_runs(tmp_path, monkeypatch):
    """One probe during other work read bf16 at 248 of 409 GFLOP/s here, and MFU then
    showed 86% for ever. The first few processes each probe once; the best is kept."""
    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path))
    probes = iter([100e9, 300e9, 200e9])
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda dtype: next(probes))

    def new_process():
        flops._probed_here.clear()  # what a new process starts with
        return flops.cpu_peak_flops("float32")

    assert new_process() == 100e9
    assert flops.cpu_peak_flops("float32") == 100e9  # the same process: no second probe
    assert new_process() == 300e9  # a later run measured more: the peak was too low
    assert new_process() == 300e9  # a lower reading never lowers it
    assert [new_process() for _ in range(3)] == [300e9] * 3  # probed enough: no more probes
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cached.values()) == [300e9]


def test_a_peak_cached_by_an_older_tputrain_is_probed_again(tmp_path, monkeypatch):
    """A cache written before probes were counted holds one probe: later runs add theirs."""
    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path))
    key = f"{cpu_name()}|{os.cpu_count()} cpus|tf {tf.__version__}|float32"
    (tmp_path / "peak_flops.json").write_text(json.dumps({key: 50e9}))
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda dtype: 80e9)
    flops._probed_here.clear()
    assert flops.cpu_peak_flops("float32") == 80e9


def test_a_peak_probed_meanwhile_by_another_process_is_not_lowered(tmp_path, monkeypatch):
    """Two runs started together: the one that measured less finishes last and must
    not overwrite the other's higher peak (the cache is read again before writing)."""
    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path))
    key = f"{cpu_name()}|{os.cpu_count()} cpus|tf {tf.__version__}|float32"

    def slow_low_probe(dtype):  # meanwhile another process stores a higher peak
        (tmp_path / "peak_flops.json").write_text(json.dumps({key: 400e9}))
        return 250e9

    monkeypatch.setattr(flops, "measure_matmul_peak", slow_low_probe)
    flops._probed_here.clear()
    assert flops.cpu_peak_flops("float32") == 400e9
    assert json.loads((tmp_path / "peak_flops.json").read_text()) == {key: 400e9}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_raised_cpu_peak_is_cached_and_never_lowered(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda dtype: 100e9)
    flops._probed_here.clear()
    assert flops.cpu_peak_flops("float32") == 100e9
    flops.raise_cpu_peak("float32", 150e9)
    flops.raise_cpu_peak("float32", 120e9)  # lower: kept at 150
    assert list(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [150e9]
    assert flops.cpu_peak_flops("float32") == 150e9
