"""Communication: gradient bytes and all-reduce share measured each loop; the knobs."""

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.distribution.communication import CommunicationOptions, gradient_bytes
from events import train_scalars
from tiny import TinyTask, model_bytes, strategy_for


class Recorder(tputrain.Action):
    def __init__(self):
        self.loops = []

    def on_loop_end(self, trainer, step, logs):
        self.loops.append(dict(logs))


def train(tmp_path, name, replicas, **communication):
    recorder = Recorder()
    trainer = tputrain.Trainer(
        TinyTask(), str(tmp_path / name), strategy=strategy_for(replicas), train_steps=4,
        steps_per_loop=2, global_batch_size=16, eval_steps=1, report_mfu=False,
        actions=[recorder], communication=CommunicationOptions(**communication))
    trainer.train()
    return trainer, recorder.loops


def variable_bytes(trainer):
    return sum(int(np.prod(v.shape)) * 4 for v in trainer.model.trainable_variables)


def test_two_replicas_all_reduce_the_gradient_bytes_in_the_chosen_dtype(tmp_path):
    fp32, loops = train(tmp_path, "fp32", 2)
    assert [loop["comm/gradient_bytes"] for loop in loops] == [variable_bytes(fp32)] * 2
    assert all(0 < loop["comm/allreduce_fraction"] <= 1 for loop in loops)
    bf16, loops = train(tmp_path, "bf16", 2, allreduce_dtype="bfloat16")
    assert [loop["comm/gradient_bytes"] for loop in loops] == [variable_bytes(bf16) / 2] * 2


def test_one_replica_reports_no_communication(tmp_path):
    _, loops = train(tmp_path, "one", 1)
    assert all(loop["comm/gradient_bytes"] == 0 for loop in loops)
    assert all(loop["comm/allreduce_fraction"] == 0 for loop in loops)


# slow tier: the wire dtype itself stays in the default tier
@pytest.mark.slow
def test_bf16_all_reduce_trains_close_to_fp32_and_updates_in_float32(tmp_path):
    """Half the bytes, the same model to bf16 precision; weights stay float32."""
    fp32, _ = train(tmp_path, "a", 2)
    bf16, _ = train(tmp_path, "b", 2, allreduce_dtype="bfloat16")
    for a, b in zip(fp32.model.get_weights(), bf16.model.get_weights()):
        assert b.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=2e-2)
    assert max(np.abs(a - b).max() for a, b in
               zip(fp32.model.get_weights(), bf16.model.get_weights())) > 0  # it did cast


def test_options_are_checked_and_name_the_choices():
    with pytest.raises(ValueError, match="allreduce_dtype must be one of"):
        CommunicationOptions(allreduce_dtype="int8")
    with pytest.raises(ValueError, match="implementation must be one of"):
        CommunicationOptions(implementation="mpi")
    with pytest.raises(ValueError, match="bytes_per_pack"):
        CommunicationOptions(bytes_per_pack=-1)
    options = CommunicationOptions(implementation="ring", bytes_per_pack=1 << 20,
                                   timeout_seconds=30.0).for_multi_worker()
    assert options.bytes_per_pack == 1 << 20 and options.timeout_seconds == 30.0


def test_gradient_bytes_counts_floating_variables_in_the_wire_dtype():
    variables = [tf.Variable(tf.zeros([3, 4])), tf.Variable(tf.zeros([5], tf.int32))]
    assert gradient_bytes(variables, "float32", 2) == 12 * 4 + 5 * 4
    assert gradient_bytes(variables, "bfloat16", 2) == 12 * 2 + 5 * 4
    assert gradient_bytes(variables, "float32", 1) == 0


@pytest.mark.slow
def test_two_worker_launch_logs_half_the_model_bytes_with_bf16_all_reduce(tmp_path):
    """`tputrain launch --workers 2` on digits with a bf16 all-reduce: comm/gradient_bytes
    is half the model's float32 trainable-variable bytes, the all-reduce share over
    gRPC is measured above 0, and the model still learns: eval accuracy >= 0.95 over
    the whole eval split (issue 14's acceptance; the float32 figure on 2 workers is
    checked by tests/distribution/test_launch.py's first test, one replica's 0 above)."""
    import subprocess
    import sys

    from faults import child_env
    from processes import in_netns
    from tputrain.tasks.digits import DigitsTask

    model_dir = tmp_path / "bf16"
    command = in_netns([
        sys.executable, "-m", "tputrain.run", "launch", "--workers", "2",
        "--gin_file=digits.gin", f"--model_dir={model_dir}",
        "--gin_param=Trainer.train_steps=400", "--gin_param=Trainer.steps_per_loop=200",
        "--gin_param=Trainer.eval_every=None", "--gin_param=Trainer.eval_steps=None",
        "--gin_param=Trainer.actions=[]",
        "--gin_param=CommunicationOptions.allreduce_dtype='bfloat16'"])
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env=child_env())
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    scalars = train_scalars(model_dir)
    assert scalars["comm/gradient_bytes"] == [model_bytes(DigitsTask(), 2)] * 2
    assert train_scalars(model_dir, "eval")["accuracy"][-1] >= 0.95
    assert all(0 < fraction <= 1 for fraction in scalars["comm/allreduce_fraction"])


def test_mirrored_cross_device_ops_are_chosen_by_name_and_checked():
    assert CommunicationOptions().for_mirrored() is None  # TensorFlow's choice
    nccl = CommunicationOptions(mirrored_cross_device_ops="nccl",
                                mirrored_num_packs=4).for_mirrored()
    assert isinstance(nccl, tf.distribute.NcclAllReduce) and nccl._num_packs == 4
    assert isinstance(CommunicationOptions(mirrored_cross_device_ops="hierarchical_copy")
                      .for_mirrored(), tf.distribute.HierarchicalCopyAllReduce)
    assert isinstance(CommunicationOptions(mirrored_cross_device_ops="reduce_to_one_device")
                      .for_mirrored(), tf.distribute.ReductionToOneDevice)
    with pytest.raises(ValueError, match="mirrored_cross_device_ops must be one of"):
        CommunicationOptions(mirrored_cross_device_ops="ring")
    with pytest.raises(ValueError, match="mirrored_num_packs must be an int >= 1"):
        CommunicationOptions(mirrored_num_packs=0)


def _trace(directory, events):
    """A profiler run folder with one host plane: (line, name, start_ns, duration_ns)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    lines = {}
    for index, (line_name, name, start, duration) in enumerate(events):
        plane.event_metadata[index + 1].name = name
        line = lines.get(line_name) or lines.setdefault(line_name, plane.lines.add(name=line_name))
        line.events.add(metadata_id=index + 1, offset_ps=start * 1000, duration_ps=duration * 1000)
    run = directory / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(space.SerializeToString())


def test_collective_share_is_the_union_of_collective_events_over_the_trace(tmp_path):
    from tputrain.distribution.communication import collective_share

    _trace(tmp_path / "a", [
        ("python", "_loop", 0, 100),                          # the span: 0-100
        ("tf_Compute/1", "CollectiveOpV2Kernel::Run", 10, 20),  # 10-30
        ("tf_Compute/2", "CollectiveOpV2Kernel::Run", 20, 20),  # 20-40: overlaps, once
        ("gpu", "ncclDevKernel_AllReduce_Sum_f32", 60, 10),     # 60-70
        ("tf_Compute/1", "MatMul", 30, 30)])                  # not a collective
    assert collective_share(str(tmp_path / "a")) == pytest.approx(0.4)
    _trace(tmp_path / "b", [("python", "_loop", 0, 100), ("tf_Compute/1", "MatMul", 0, 50)])
    assert collective_share(str(tmp_path / "b")) is None  # nothing crossed replicas
    assert collective_share(str(tmp_path / "empty")) is None


PROFILED = """
import sys
import tputrain
tputrain.split_cpu(2)
import tensorflow as tf
from tiny import TinyTask
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # collective all-reduce
trainer = tputrain.Trainer(TinyTask(), sys.argv[1], strategy=strategy, train_steps=8,
                           steps_per_loop=2, global_batch_size=16, eval_steps=1,
                           report_mfu=False, profile_steps=(2, 6))
trainer.train()
"""


@pytest.mark.slow
def test_a_profile_on_two_replicas_logs_the_collective_share_beside_the_estimate(tmp_path):
    """Trainer.profile_steps on 2 replicas with collective all-reduce: the trace's
    collective ops are read back and logged next to comm/allreduce_fraction."""
    import re
    import subprocess
    import sys

    from faults import child_env

    result = subprocess.run([sys.executable, "-c", PROFILED, str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"profile: collective ops in flight ([0-9.]+)% of the traced time "
                      r"\(comm/allreduce_fraction estimates ([0-9.]+)%", result.stderr)
    assert found, result.stderr[-3000:]
    assert 0 < float(found.group(1)) <= 100 and 0 < float(found.group(2)) <= 100


def test_a_second_train_call_reuses_the_measured_all_reduce(tmp_path, monkeypatch):
    # A notebook's train() calls on one Trainer: the gradients' all-reduce is timed once
    # (it takes about 1.5x CommunicationAction.seconds of every core), not per call.
    from tputrain.actions import communication as action_module
    monkeypatch.setattr(action_module, "_MEASURED", {})  # not timed by an earlier test
    calls = []
    measure = action_module.measure_allreduce
    monkeypatch.setattr(action_module, "measure_allreduce",
                        lambda *a, **k: calls.append(1) or measure(*a, **k))
    recorder = Recorder()
    trainer = tputrain.Trainer(
        TinyTask(), str(tmp_path / "run"), strategy=strategy_for(2), train_steps=2,
        steps_per_loop=2, global_batch_size=16, eval_steps=1, report_mfu=False,
        actions=[recorder])
    trainer.train()
    trainer.train(2)
    assert len(calls) == 1
    first, second = recorder.loops
    assert second["comm/gradient_bytes"] == first["comm/gradient_bytes"] > 0
    assert 0 < second["comm/allreduce_fraction"] <= 1


class WideTask(TinyTask):
    """TinyTask with other gradient shapes: an all-reduce of other bytes."""

    def build_model(self):
        import keras
        inputs = keras.Input((8,), name="x")
        logits = keras.layers.Dense(2, dtype="float32")(keras.layers.Dense(32)(inputs))
        return keras.Model({"x": inputs}, logits)


def test_trainers_of_one_process_time_an_all_reduce_of_the_same_gradients_once(
        tmp_path, monkeypatch):
    # A sweep or notebook builds Trainer after Trainer on the same devices: the same
    # gradients' all-reduce is timed once a process (about 1.5x CommunicationAction.seconds
    # of every core each time), a new shape, dtype or device set again.
    from tputrain.actions import communication as action_module
    monkeypatch.setattr(action_module, "_MEASURED", {})
    calls = []
    measure = action_module.measure_allreduce
    monkeypatch.setattr(action_module, "measure_allreduce",
                        lambda *a, **k: calls.append(1) or measure(*a, **k))

    def fraction(name, task, **communication):
        recorder = Recorder()
        tputrain.Trainer(task, str(tmp_path / name), strategy=strategy_for(2), train_steps=2,
                         steps_per_loop=2, global_batch_size=16, eval_steps=1,
                         report_mfu=False, actions=[recorder],
                         communication=CommunicationOptions(**communication)).train()
        return recorder.loops[0]["comm/allreduce_fraction"]

    assert 0 < fraction("a", TinyTask()) <= 1
    assert 0 < fraction("b", TinyTask()) <= 1
    assert len(calls) == 1
    fraction("c", WideTask())
    fraction("d", TinyTask(), allreduce_dtype="bfloat16")
    assert len(calls) == 3
