"""Tests for tputrain.loop.evaluation: what the eval loop feeds the model."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from mixture_task import MixtureEvalTask, mixture_manifests
from tputrain.data import InputContext, TFRecordInput, write_tfrecords


def metrics_on_features(task, model) -> dict[str, float]:
    """The eval split's loss and accuracy from the model called on `x` alone."""
    losses, hits = [], []
    for features, labels in task.build_inputs("eval", InputContext(global_batch_size=8)):
        outputs = model({"x": features["x"]}, training=False)
        losses.append(task.compute_loss(labels, outputs).numpy())
        hits.append(np.argmax(outputs.numpy(), -1) == labels.numpy())
    return {"loss": float(np.mean(np.concatenate(losses))),
            "accuracy": float(np.mean(np.concatenate(hits)))}


@pytest.mark.parametrize("input_mode", ["host", "distributed"])
def test_a_mixture_eval_split_reaches_the_model_without_its_source_id(tmp_path, input_mode):
    task = MixtureEvalTask(mixture_manifests(tmp_path))
    trainer = tputrain.Trainer(task, str(tmp_path / "run"),
                               strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
                               train_steps=4, steps_per_loop=2, global_batch_size=8,
                               eval_steps=None, input_mode=input_mode, report_mfu=False,
                               progress_bar="off")
    trainer.train()
    logs = trainer.evaluate_weights()
    expected = metrics_on_features(task, trainer.model)
    assert logs["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert logs["accuracy"] == pytest.approx(expected["accuracy"])


class DroppingEvalTask(MixtureEvalTask):
    """A 20-example eval split of TFRecords batched with drop_remainder=True (the
    builder's default): a global batch of 8 leaves 4 examples out."""

    def __init__(self, data: str, **kwargs):
        super().__init__([])
        self.data, self.kwargs = data, kwargs

    def build_inputs(self, split, input_context):
        train = split == "train"
        return TFRecordInput(f"{self.data}-*", {"x": ([1], "float32"), "y": ([], "int64")},
                             label_key="y", repeat=train, shuffle=train,
                             **({} if train else self.kwargs))(input_context)


@pytest.mark.parametrize("pad_remainder", [False, True])
def test_an_eval_that_leaves_examples_out_says_how_many_and_how_to_keep_them(
        tmp_path, caplog, pad_remainder):
    x = np.arange(20, dtype=np.float32)[:, None]
    write_tfrecords({"x": x, "y": np.zeros(20, np.int64)}, str(tmp_path / "d"), num_shards=1)
    trainer = tputrain.Trainer(DroppingEvalTask(str(tmp_path / "d"), pad_remainder=pad_remainder),
                               str(tmp_path / "run"),
                               strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
                               train_steps=2, steps_per_loop=2, global_batch_size=8,
                               eval_steps=None, report_mfu=False, progress_bar="off")
    trainer.train()
    with caplog.at_level("WARNING"):
        trainer.evaluate_weights()
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    if pad_remainder:  # every example evaluated: nothing to say
        assert warnings == []
        return
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "4 of the 20 examples" in warnings[0] and "pad_remainder=True" in warnings[0]


def test_a_hosts_dropped_remainder_is_said_on_several_hosts_too(caplog):
    """Several hosts pad the eval split with zero-weight batches (`with_weights`), so the
    left-out count was not asked for: a host whose split dropped its partial batch
    (pad_remainder=False) left examples out in silence (96 of 100 on 3 workers)."""
    from types import SimpleNamespace
    from tputrain.loop.evaluation import local_steps

    dataset = tf.data.Dataset.range(10).batch(4, drop_remainder=True).map(
        lambda batch: (batch, batch, tf.ones_like(batch, tf.float32)))  # with_weights'
    batch = SimpleNamespace(num_hosts=2, local_replicas=1, per_replica=4)
    inputs = SimpleNamespace(plan=SimpleNamespace(batch=batch), dataset=lambda split: dataset)
    with caplog.at_level("WARNING"):
        assert local_steps(inputs, "eval", None) == 2
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warnings) == 1 and "2 of the 10 examples" in warnings[0], warnings
