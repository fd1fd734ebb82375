"""Labels checked at the first batch (tputrain.loop.labels): a non-finite or out-of-range
class id is one line naming the feature and the shard and record, before training."""

import os

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import cli_refusal
from tiny import TinyTask, strategy_for


class FloatLabelTask(TinyTask):
    """TinyTask (2 logits, sparse cross-entropy) read from TFRecords whose label column
    is float32, as a CSV converted without care has it."""

    def __init__(self, pattern: str, label_dtype: str = "float32", check: bool = True):
        super().__init__()
        self.pattern, self.label_dtype = pattern, label_dtype
        self.check_labels = check

    def build_inputs(self, split, input_context):
        return tputrain.data.TFRecordInput(
            self.pattern, {"x": ([8], "float32"), "target": ([], self.label_dtype)},
            label_key="target", shuffle=False, repeat=split == "train")(input_context)


def _write(tmp_path, labels, dtype):
    x = np.random.RandomState(0).randn(len(labels), 8).astype(np.float32)
    tputrain.data.write_tfrecords({"x": x, "target": np.asarray(labels, dtype)},
                                  str(tmp_path / "data" / "train"), num_shards=2)
    return str(tmp_path / "data" / "train-*")


def _message(error: BaseException) -> str:
    """The error's own text (gin adds the configurable it was raised in)."""
    return str(error).split("\n  In call to configurable")[0]


def _trainer(tmp_path, task):
    return tputrain.Trainer(task, str(tmp_path / "model"), strategy=strategy_for(2),
                            train_steps=2, steps_per_loop=1, global_batch_size=8, eval_steps=1)


def test_a_nan_in_a_float_label_column_is_one_line_naming_feature_shard_and_record(tmp_path):
    """It trained without a word: the NaN was cast to some class."""
    labels = [0, 1] * 16
    labels[1] = np.nan  # shard 0 (the first 16), record 1: in the first per-replica batch
    pattern = _write(tmp_path, labels, np.float32)
    with pytest.raises(ValueError) as caught:
        _trainer(tmp_path, FloatLabelTask(pattern))
    message = _message(caught.value)
    assert "\n" not in message and "'target'" in message and "nan" in message
    assert "train-00000-of-00002.tfrecord" in message and "record 1" in message
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("bad", [2, -1, 7])
def test_a_class_id_outside_the_models_classes_is_one_line(tmp_path, bad):
    labels = [0, 1] * 16
    labels[1] = bad
    with pytest.raises(ValueError, match=rf"'target'.* {bad} .*0 to 1") as caught:
        _trainer(tmp_path, FloatLabelTask(_write(tmp_path, labels, np.int64), "int64"))
    assert "\n" not in _message(caught.value) and "record 1" in str(caught.value)


def test_a_task_whose_loss_masks_such_labels_can_say_so(tmp_path):
    labels = [0, 1] * 16
    labels[3] = -1  # e.g. an ignored class its loss masks
    trainer = _trainer(tmp_path, FloatLabelTask(_write(tmp_path, labels, np.int64), "int64",
                                                check=False))
    assert trainer.inputs is not None


def test_the_cli_exits_2_in_one_line_on_a_nan_label(tmp_path):
    x = np.random.RandomState(0).randn(32, 8).astype(np.float32)
    labels = (x[:, 0] > 0).astype(np.int64)
    labels[0] = 9
    tputrain.data.write_tfrecords({"x": x, "label": labels}, str(tmp_path / "train"),
                                  num_shards=1)
    stderr = cli_refusal(tmp_path, f"Trainer.task = @RecordsTask()\nRecordsTask.pattern = "
                         f"'{tmp_path}/train-*'\nTrainer.train_steps = 2\n"
                         "Trainer.global_batch_size = 8\nTrainer.eval_steps = 1\n")
    assert "'label'" in stderr and "record 0" in stderr
