"""Communication: gradient bytes and all-reduce share measured each loop; the knobs."""

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.communication import CommunicationOptions, gradient_bytes
from tiny import TinyTask, strategy_for


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
