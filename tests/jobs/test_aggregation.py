"""Host-side eval metrics (`Task.aggregate_eval`): every eval example's outputs and
labels gathered once, in order, padding removed, on 2 replicas and on 2 worker
processes; the metric it returns is logged like the others (F1 checked against
scikit-learn on the restored model's own predictions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from sklearn.metrics import f1_score

import tputrain
from events import last_scalars
from faults import F1RecordsTask
from processes import launched
from tiny import TinyTask, strategy_for
from tputrain.data.batching import pad_to_batch

EVAL_EXAMPLES = 50  # not a multiple of the global batch (16): the last batch is padded
PER_REPLICA = 8


class F1Task(TinyTask):
    """TinyTask with a padded eval split of 50 examples and a host-side F1."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        rng = np.random.RandomState(1)
        self.x_eval = rng.randn(EVAL_EXAMPLES, 8).astype(np.float32)
        self.y_eval = (self.x_eval[:, 0] + 0.5 * self.x_eval[:, 1] > 0).astype(np.int64)
        self.received: list[dict[str, np.ndarray]] = []

    def build_inputs(self, split, input_context):
        if split == "train":
            return super().build_inputs(split, input_context)
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x_eval}, self.y_eval))
        return dataset.batch(batch).map(lambda *b: pad_to_batch(b, batch))

    def aggregate_eval(self, outputs):
        self.received.append(outputs)
        predicted = outputs["outputs"][:, 1] > outputs["outputs"][:, 0]
        return {"f1": float(f1_score(outputs["labels"], predicted,
                                     sample_weight=outputs["weights"]))}


def make(model_dir: Path, task: tputrain.Task, **kwargs) -> tputrain.Trainer:
    return tputrain.Trainer(task, str(model_dir), strategy=strategy_for(2), train_steps=4,
                            steps_per_loop=2, global_batch_size=16, report_mfu=False, **kwargs)


def reference_f1(model, x: np.ndarray, y: np.ndarray) -> float:
    logits = model.predict({"x": x}, batch_size=7, verbose=0)
    return float(f1_score(y, logits[:, 1] > logits[:, 0]))


def test_two_replicas_f1_over_every_eval_example_once_equals_scikit_learn(tmp_path):
    task = F1Task()
    trainer = make(tmp_path / "run", task)
    trainer.train()
    task.received.clear()
    logs = trainer.evaluate()
    (received,) = task.received
    assert sorted(received) == ["labels", "outputs", "weights"]
    assert received["outputs"].shape == (EVAL_EXAMPLES, 2)
    np.testing.assert_array_equal(received["labels"], task.y_eval)  # each once, in order
    assert received["labels"].dtype == np.int64
    np.testing.assert_array_equal(received["weights"], np.ones(EVAL_EXAMPLES))
    expected_outputs = trainer.model.predict({"x": task.x_eval}, batch_size=7, verbose=0)
    np.testing.assert_allclose(received["outputs"], expected_outputs, atol=1e-5)
    assert 0 < logs["f1"] < 1
    assert logs["f1"] == pytest.approx(reference_f1(trainer.model, task.x_eval, task.y_eval),
                                       abs=1e-6)
    assert "loss" in logs and "accuracy" in logs  # the Keras metrics are still there


def test_aggregated_metric_reaches_tensorboard_and_best_checkpoint(tmp_path):
    task = F1Task()
    best = tputrain.BestCheckpoint(metric="f1", mode="max")
    seen: dict[int, dict[str, float]] = {}

    class Record(tputrain.Action):
        def on_eval_end(self, context, step, logs):
            seen[step] = dict(logs)

    make(tmp_path / "run", task, eval_every=2, actions=[Record(), best]).train()
    assert sorted(seen) == [2, 4] and all("f1" in logs for logs in seen.values())
    record = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert record["metric"] == "f1"
    assert record["value"] == max(logs["f1"] for logs in seen.values())
    assert last_scalars(tmp_path / "run" / "eval")["f1"] == pytest.approx(seen[4]["f1"])


def test_with_eval_steps_the_hook_gets_the_batches_the_keras_metrics_read(tmp_path):
    task = F1Task()
    trainer = make(tmp_path / "run", task, eval_steps=2)  # 2 steps of 16: the first 32
    logs = trainer.evaluate()
    (received,) = task.received
    np.testing.assert_array_equal(received["labels"], task.y_eval[:32])
    assert logs["f1"] == pytest.approx(
        reference_f1(trainer.model, task.x_eval[:32], task.y_eval[:32]), abs=1e-6)


def test_a_task_without_the_hook_gathers_nothing(tmp_path):
    task = TinyTask()
    gathered = []
    task.eval_outputs = lambda batch, model: gathered.append(1) or {}
    trainer = make(tmp_path / "run", task)
    logs = trainer.evaluate()
    assert not gathered and sorted(logs) == ["accuracy", "loss"]


def test_aggregate_eval_must_return_named_numbers(tmp_path):
    task = F1Task()
    task.aggregate_eval = lambda outputs: {"loss": 1.0}
    trainer = make(tmp_path / "run", task)
    with pytest.raises(ValueError, match="aggregate_eval.*'loss'.*already"):
        trainer.evaluate()


def _write(directory: Path, name: str, counts: list[int], seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.RandomState(seed)
    xs, ys = [], []
    for index, count in enumerate(counts):
        x = rng.randn(count, 8).astype(np.float32)
        y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
        tputrain.data.write_tfrecords({"x": x, "label": y}, str(directory / f"{name}{index}"),
                                      num_shards=1)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


@pytest.mark.slow
@pytest.mark.start_early(4)
def test_two_hosts_f1_equals_scikit_learn_on_the_same_outputs(tmp_path):
    """Issue 37's acceptance: a host-side F1 over 2 hosts equals scikit-learn's. Uneven
    eval shards (host 0: 5 + 1 batches, host 1: 2 batches and 3 rows), padded."""
    data, dump = tmp_path / "data", tmp_path / "dump"
    _write(data, "train", [64, 64], seed=0)
    x, y = _write(data, "eval", [5 * PER_REPLICA, 2 * PER_REPLICA + 3, PER_REPLICA], seed=1)
    config = tmp_path / "mw.gin"
    config.write_text(f"""
Trainer.task = @F1RecordsTask()
F1RecordsTask.pattern = '{data}/train*'
F1RecordsTask.eval_pattern = '{data}/eval*'
F1RecordsTask.pad_eval = True
F1RecordsTask.dump_dir = '{dump}'
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.checkpoint_every = 4
Trainer.global_batch_size = {2 * PER_REPLICA}
Trainer.report_mfu = False
""")
    model_dir = tmp_path / "model"
    text = launched(config, model_dir)
    logged = {int(w): float(f) for w, f in
              re.findall(r"\[worker (\d)\] .*eval at step 4 .*f1 ([0-9.]+)", text)}
    assert sorted(logged) == [0, 1] and logged[0] == logged[1], text[-4000:]
    task = F1RecordsTask("unused")
    model = task.build_model()
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    tf.train.Checkpoint(model=model).read(path).expect_partial().assert_existing_objects_matched()
    expected = reference_f1(model, x, y)
    reported = last_scalars(model_dir / "eval")
    assert reported["rows"] == len(y)
    assert reported["f1"] == pytest.approx(expected, abs=1e-6)
    dumps = [np.load(p) for p in sorted(dump.glob("aggregated-*.npz"))]
    assert len(dumps) == 2  # each host got every row: the same arrays
    for got in dumps:
        np.testing.assert_array_equal(got["x"], dumps[0]["x"])
        # every example once: the gathered rows are the files' rows, reordered
        order = np.lexsort(got["x"].T[::-1])
        np.testing.assert_array_equal(got["x"][order], x[np.lexsort(x.T[::-1])])
        np.testing.assert_array_equal(got["labels"][order], y[np.lexsort(x.T[::-1])])
        np.testing.assert_allclose(got["outputs"],
                                   model.predict({"x": got["x"]}, verbose=0), atol=1e-5)


class TwoSetF1Task(F1Task):
    """F1Task with named eval sets: "validation" is the first 30 eval examples, "test"
    all 50 with their labels flipped (so the two sets' F1 differ)."""

    def build_inputs(self, split, input_context):
        if split == "train":
            return super().build_inputs(split, input_context)
        x, y = (self.x_eval[:30], self.y_eval[:30]) if split == "validation" else (
            self.x_eval, 1 - self.y_eval)
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y))
        return dataset.batch(batch).map(lambda *b: pad_to_batch(b, batch))


def test_each_named_eval_set_gets_its_own_host_side_metric(tmp_path):
    task = TwoSetF1Task()
    trainer = make(tmp_path / "run", task, eval_splits=("validation", "test"))
    trainer.train()
    task.received.clear()
    logs = trainer.evaluate()
    assert [len(r["labels"]) for r in task.received] == [30, EVAL_EXAMPLES]
    assert logs["validation/f1"] == pytest.approx(
        reference_f1(trainer.model, task.x_eval[:30], task.y_eval[:30]), abs=1e-6)
    assert logs["test/f1"] == pytest.approx(
        reference_f1(trainer.model, task.x_eval, 1 - task.y_eval), abs=1e-6)
