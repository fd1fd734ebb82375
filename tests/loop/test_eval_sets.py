"""Named eval sets (`Trainer.eval_splits`): each set evaluated as the single split is
(padded last batch, uneven shards agreed across hosts), reported under its name, and
selectable by `BestCheckpoint`/`EarlyStopping` as "<set>/<metric>"."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from events import last_scalars, scalar_points
from faults import RecordsTask
from processes import launched
from tiny import strategy_for
from tputrain.jobs.sidecar import ReadOnlyTrainer, evaluate_checkpoints

PER_REPLICA = 8
SETS = ("validation", "test")


def _write(path: Path, count: int, seed: int, flip: bool = False) -> str:
    """`count` examples of the tiny rule (labels flipped with `flip`) in one file."""
    rng = np.random.RandomState(seed)
    x = rng.randn(count, 8).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
    return tputrain.data.write_tfrecords({"x": x, "label": 1 - y if flip else y}, str(path),
                                         num_shards=1)[0]


def _examples(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
    x, y = [], []
    for record in tf.data.TFRecordDataset(files):
        example = tf.train.Example.FromString(record.numpy())
        x.append(example.features.feature["x"].float_list.value)
        y.append(example.features.feature["label"].int64_list.value[0])
    return np.array(x, np.float32), np.array(y)


def _direct(model: keras.Model, files: list[str]) -> dict[str, float]:
    """Mean cross-entropy (+ L2) and accuracy over every example, computed in one piece."""
    x, y = _examples(files)
    logits = model({"x": x}, training=False)
    loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)))
    return {"loss": loss + float(sum(model.losses)),
            "accuracy": float(np.mean(np.argmax(logits, axis=-1) == y)), "examples": len(y)}


def _checkpoint_model(model_dir: Path) -> keras.Model:
    model = RecordsTask("unused").build_model()
    path = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    tf.train.Checkpoint(model=model).read(path).expect_partial().assert_existing_objects_matched()
    return model


def _data(tmp_path: Path, flip_test: bool = False) -> dict[str, list[str]]:
    """Train 64 examples; validation 44 and test 29 (neither a multiple of a batch),
    or with `flip_test` the validation examples with flipped labels."""
    data = tmp_path / "data"
    files = {"train": [_write(data / "train", 64, 0)],
             "validation": [_write(data / "validation", 44, 1)]}
    files["test"] = [_write(data / "test", 44, 1, flip=True) if flip_test
                     else _write(data / "test", 29, 2)]
    return files


def _task(files: dict[str, list[str]]) -> RecordsTask:
    return RecordsTask(files["train"][0], pad_eval=True,
                       eval_patterns={name: files[name][0] for name in SETS})


def _trainer(tmp_path: Path, files, replicas: int = 2, **kwargs) -> tputrain.Trainer:
    options = dict(train_steps=4, steps_per_loop=2, global_batch_size=PER_REPLICA * replicas,
                   report_mfu=False, eval_splits=SETS)
    return tputrain.Trainer(_task(files), str(tmp_path / "model"), strategy=strategy_for(replicas),
                            **{**options, **kwargs})


def test_two_sets_on_two_replicas_equal_a_direct_computation(tmp_path, caplog):
    files = _data(tmp_path)
    with caplog.at_level(logging.INFO):
        trainer = _trainer(tmp_path, files)
        logs = trainer.train()
    assert sorted(logs) == sorted(f"{s}/{m}" for s in SETS for m in ("loss", "accuracy"))
    for name in SETS:
        direct = _direct(trainer.model, files[name])
        assert logs[f"{name}/accuracy"] == pytest.approx(direct["accuracy"], abs=1e-6)
        assert logs[f"{name}/loss"] == pytest.approx(direct["loss"], abs=1e-6)
        # TensorBoard: a run per set under eval/<set>, tagged as the single split's.
        written = last_scalars(tmp_path / "model" / "eval" / name)
        assert sorted(written) == ["accuracy", "loss"]
        assert written["accuracy"] == pytest.approx(logs[f"{name}/accuracy"], abs=1e-6)
    assert not list((tmp_path / "model" / "eval").glob("events.*"))  # no unnamed eval run
    lines = [r.getMessage() for r in caplog.records if "eval at step 4" in r.getMessage()]
    # 44 examples: 6 per-replica batches, 3 steps; 29: 4 batches, 2 steps.
    assert re.search(r"eval at step 4 \| validation: loss \S+ \| accuracy \S+ \(3 eval steps\) "
                     r"\| test: loss \S+ \| accuracy \S+ \(2 eval steps\)", lines[-1]), lines
    assert trainer.evaluate() == pytest.approx(logs, abs=1e-6)
    x, _ = _examples(files["test"])  # predict reads a named set, padding dropped
    np.testing.assert_allclose(trainer.predict("test"), trainer.model({"x": x}), atol=1e-5)
    trainer.close()

    reader = ReadOnlyTrainer(_task(files), str(tmp_path / "model"), strategy=strategy_for(2),
                             global_batch_size=16, report_mfu=False, eval_splits=SETS)
    assert evaluate_checkpoints(reader)[4] == pytest.approx(logs, abs=1e-6)  # the side-car
    reader.close()


def test_the_single_default_split_is_unchanged(tmp_path):
    files = _data(tmp_path)
    task = RecordsTask(files["train"][0], eval_pattern=files["validation"][0], pad_eval=True)
    with tputrain.Trainer(task, str(tmp_path / "model"), strategy=strategy_for(2), train_steps=2,
                          steps_per_loop=2, global_batch_size=16, report_mfu=False) as trainer:
        assert trainer.eval_splits == ("eval",)
        logs = trainer.train()
        direct = _direct(trainer.model, files["validation"])
    assert sorted(logs) == ["accuracy", "loss"]
    assert logs["accuracy"] == pytest.approx(direct["accuracy"], abs=1e-6)
    assert sorted(last_scalars(tmp_path / "model" / "eval")) == ["accuracy", "loss"]
    assert not [p for p in (tmp_path / "model" / "eval").iterdir() if p.is_dir()]


def test_best_checkpoint_picks_by_the_named_set(tmp_path):
    files = _data(tmp_path, flip_test=True)  # test accuracy = 1 - validation accuracy
    best = tputrain.BestCheckpoint(metric="test/accuracy")
    with _trainer(tmp_path, files, replicas=1, train_steps=8, steps_per_loop=1, eval_every=1,
                  actions=[best]) as trainer:
        trainer.train()
    points = {name: scalar_points(tmp_path / "model" / "eval" / name)["accuracy"]
              for name in SETS}
    steps = [step for step, _ in points["test"]]
    test, validation = (np.array([v for _, v in points[n]]) for n in ("test", "validation"))
    np.testing.assert_allclose(test, 1 - validation, atol=1e-6)
    assert np.argmax(test) != np.argmax(validation)  # the sets disagree on the best step
    record = json.loads((tmp_path / "model" / "best" / "best.json").read_text())
    assert record["step"] == steps[int(np.argmax(test))]
    assert record["value"] == pytest.approx(test.max(), abs=1e-6)


@pytest.mark.parametrize("action", [tputrain.BestCheckpoint, tputrain.EarlyStopping])
@pytest.mark.parametrize("metric", ["dev/accuracy", "accuracy"])
def test_a_metric_of_no_set_fails_before_training(tmp_path, action, metric):
    with pytest.raises(ValueError, match=r"validation/accuracy.*test/loss"):
        _trainer(tmp_path, _data(tmp_path), replicas=1, actions=[action(metric=metric)])


@pytest.mark.parametrize("splits", [(), ("train",), ("test", "test"), ("",), "test"])
def test_bad_eval_splits_are_refused(splits):
    with pytest.raises((ValueError, TypeError), match="eval_splits"):
        tputrain.TrainerOptions(eval_splits=splits)


@pytest.mark.slow
@pytest.mark.parametrize("input_mode", ["host", "distributed"])
def test_two_sets_on_two_workers_agree_and_equal_a_direct_computation(tmp_path, input_mode):
    data = tmp_path / "data"
    for index in range(2):
        _write(data / f"train{index}", 64, index)
    # Uneven shards: host 0 reads file 0, host 1 file 1 (none a multiple of a batch).
    sets = {"validation": [_write(data / "validation0", 37, 5), _write(data / "validation1", 11, 6)],
            "test": [_write(data / "test0", 5, 7), _write(data / "test1", 21, 8)]}
    config = tmp_path / "mw.gin"
    config.write_text(f"""
Trainer.task = @RecordsTask()
RecordsTask.pattern = '{data}/train*'
RecordsTask.pad_eval = True
RecordsTask.eval_patterns = {{'validation': '{data}/validation*', 'test': '{data}/test*'}}
Trainer.eval_splits = ("validation", "test")
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.global_batch_size = {2 * PER_REPLICA}
Trainer.report_mfu = False
Trainer.input_mode = '{input_mode}'
""")
    model_dir = tmp_path / "model"
    text = launched(config, model_dir)
    pattern = r"\[worker (\d)\] .*eval at step 4 \| validation: .*\((\d+) eval steps\) " \
              r"\| test: .*\((\d+) eval steps\)"
    counts = {int(w): (int(v), int(t)) for w, v, t in re.findall(pattern, text)}
    assert counts == {0: (5, 3), 1: (5, 3)}, text[-4000:]  # the most any host needs
    model = _checkpoint_model(model_dir)
    for name, files in sets.items():
        direct, written = _direct(model, files), last_scalars(model_dir / "eval" / name)
        assert direct["examples"] == {"validation": 48, "test": 26}[name]
        assert written["accuracy"] == pytest.approx(direct["accuracy"], abs=1e-6)
        assert written["loss"] == pytest.approx(direct["loss"], abs=1e-6)
