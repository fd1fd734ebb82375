"""Tests for tputrain.loop.evaluation: what the eval loop feeds the model."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from mixture_task import MixtureEvalTask, mixture_manifests
from tputrain.data import InputContext


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
