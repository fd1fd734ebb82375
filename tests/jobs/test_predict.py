"""Batch inference: every example's outputs once, in input order, float32, on N replicas;
the CLI writes them atomically and refuses bad input with one line."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from mixture_task import MixtureEvalTask, mixture_manifests
from tiny import TinyTask, strategy_for
from tputrain.jobs import predict as predict_module
from tputrain.cli import predict as predict_cli
from tputrain.data.batching import pad_to_batch

EVAL_EXAMPLES = 50  # not a multiple of the global batch (16): the last batch is padded


class PaddedEvalTask(TinyTask):
    """TinyTask with an eval split of 50 examples, its last batch padded (weight 0)."""

    def __init__(self, two_outputs: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.x_eval = np.random.RandomState(1).randn(EVAL_EXAMPLES, 8).astype(np.float32)
        self.two_outputs = two_outputs

    def build_model(self) -> keras.Model:
        if not self.two_outputs:
            return super().build_model()
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="relu")(inputs)
        logits = keras.layers.Dense(2, name="logits")(h)  # the policy's dtype: bf16 if mixed
        embedding = keras.layers.Dense(3, name="embedding")(h)
        return keras.Model({"x": inputs}, {"logits": logits, "embedding": embedding})

    def compute_loss(self, labels, outputs):
        if not self.two_outputs:
            return super().compute_loss(labels, outputs)
        return (keras.losses.sparse_categorical_crossentropy(labels, outputs["logits"],
                                                             from_logits=True)
                + 1e-3 * tf.reduce_sum(tf.square(outputs["embedding"]), -1))

    def build_metrics(self):
        return []

    def build_inputs(self, split, input_context):
        if split == "train":
            return super().build_inputs(split, input_context)
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        labels = np.zeros(EVAL_EXAMPLES, np.int64)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": self.x_eval}, labels))
        return dataset.batch(batch).map(lambda *b: pad_to_batch(b, batch))


def trained(model_dir, replicas=2, **kwargs) -> tputrain.Trainer:
    trainer = tputrain.Trainer(
        PaddedEvalTask(**kwargs.pop("task", {})), str(model_dir),
        strategy=strategy_for(replicas), train_steps=4, steps_per_loop=2, global_batch_size=16,
        report_mfu=False, **kwargs)
    trainer.train()
    return trainer


def test_two_replicas_predict_each_example_once_in_order_as_keras_does(tmp_path):
    trainer = trained(tmp_path / "run")
    outputs = trainer.predict("eval")
    expected = trainer.model.predict({"x": trainer.task.x_eval}, batch_size=7, verbose=0)
    assert isinstance(outputs, np.ndarray) and outputs.dtype == np.float32
    assert outputs.shape == (EVAL_EXAMPLES, 2)
    np.testing.assert_allclose(outputs, expected, atol=1e-5)
    assert not np.allclose(outputs[:-1], outputs[1:])  # distinct rows: the order is checked

    # A Task's predict_step says what the outputs are: here probabilities
    trainer.task.predict_step = lambda features, model: tf.nn.softmax(model(features))
    probabilities = trainer.predict("eval")
    np.testing.assert_allclose(probabilities, tf.nn.softmax(expected).numpy(), atol=1e-5)


def test_two_outputs_give_a_dict_and_mixed_bfloat16_gives_float32(tmp_path):
    trainer = trained(tmp_path / "run", task={"two_outputs": True}, precision="mixed_bfloat16")
    try:
        outputs = trainer.predict()
        assert sorted(outputs) == ["embedding", "logits"]
        assert {name: (a.dtype, a.shape) for name, a in outputs.items()} == {
            "embedding": (np.float32, (EVAL_EXAMPLES, 3)),
            "logits": (np.float32, (EVAL_EXAMPLES, 2))}
        expected = trainer.model.predict({"x": trainer.task.x_eval}, verbose=0)
        for name in outputs:  # bf16 compute: within its precision of Keras's own
            np.testing.assert_allclose(outputs[name], np.asarray(expected[name], np.float32),
                                       atol=5e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_the_hosts_slices_are_put_back_in_host_order():
    """Each step's gathered [hosts * local replicas, batch] rows: host h's replicas are
    h * local .. h * local + local - 1; its examples come before host h + 1's."""
    hosts, local, batch, steps = 2, 2, 3, 2
    # host h's example k, as the order arithmetic must return them: host 0's 0..9, then
    # host 1's 0..6 (fewer: its last step is part padding, a step all padding)
    real = {0: 10, 1: 7}
    rows = np.full((steps, hosts, local, batch), -1.0)
    mask = np.zeros(rows.shape, bool)
    for host, count in real.items():
        flat_rows = rows[:, host].reshape(-1)  # this host's steps, in its own order
        flat_rows[:count] = 100 * host + np.arange(count)
        rows[:, host] = flat_rows.reshape(steps, local, batch)
        mask[:, host] = (np.arange(steps * local * batch) < count).reshape(steps, local, batch)
    gathered = [rows[s].reshape(hosts * local, batch) for s in range(steps)]
    masks = [mask[s].reshape(hosts * local, batch) for s in range(steps)]
    ordered = predict_module.in_input_order(gathered, masks, hosts)
    assert ordered.tolist() == [*range(10), *(100 + np.arange(7))]


def test_writing_fails_atomically(tmp_path, monkeypatch):
    path = tmp_path / "out.npz"
    arrays = {"logits": np.ones((3, 2), np.float32)}

    def half_then_fail(file, **_):
        file.write(b"PK partial")
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        predict_cli.write_outputs(str(path), arrays)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    predict_cli.write_outputs(str(path), arrays)
    assert os.listdir(tmp_path) == ["out.npz"]
    with np.load(path) as written:
        np.testing.assert_array_equal(written["logits"], arrays["logits"])


def test_output_formats_by_extension(tmp_path):
    single = np.arange(6, dtype=np.float32).reshape(3, 2)
    predict_cli.write_outputs(str(tmp_path / "a.npy"), single)
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), single)
    predict_cli.write_outputs(str(tmp_path / "a.npz"), single)
    assert np.load(tmp_path / "a.npz")["outputs"].shape == (3, 2)
    with pytest.raises(ValueError, match=".npz"):
        predict_cli.check_output(str(tmp_path / "a.txt"))
    with pytest.raises(ValueError, match="does not exist"):
        predict_cli.check_output(str(tmp_path / "missing" / "a.npz"))
    with pytest.raises(ValueError, match="one output"):
        predict_cli.write_outputs(str(tmp_path / "b.npy"), {"a": single, "b": single})


CLI_GIN = """
Trainer.task = @RecordsTask()
RecordsTask.pattern = "{data}/train*"
RecordsTask.pad_eval = True
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.report_mfu = False
split_cpu.num_devices = 2
"""


def run_cli(*args):
    from faults import child_env
    return subprocess.run([sys.executable, "-m", "tputrain.cli", *args], env=child_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # three processes starting TensorFlow
def test_cli_writes_the_file_and_refuses_bad_input(tmp_path):
    data, model_dir = tmp_path / "data", tmp_path / "model"
    rng = np.random.RandomState(3)
    x = rng.randn(40, 8).astype(np.float32)
    tputrain.data.write_tfrecords({"x": x, "label": (x[:, 0] > 0).astype(np.int64)},
                                  str(data / "train"), num_shards=2)
    bad = tmp_path / "bad"
    bad.mkdir()
    tputrain.data.write_tfrecords({"x": x[:20], "label": np.zeros(20, np.int64)},
                                  str(bad / "p"), num_shards=1)
    (bad / "p-zz-corrupt.tfrecord").write_bytes(b"\x00" * 64)  # read after p-00000: mid-way
    config = tmp_path / "tiny.gin"
    config.write_text(CLI_GIN.format(data=data))
    common = ["--gin_import=faults", f"--model_dir={model_dir}"]

    none = run_cli("predict", *common, f"--gin_file={config}", f"--output={tmp_path}/o.npz")
    assert none.returncode == 2 and "no checkpoint in" in none.stderr, none.stderr[-2000:]
    assert none.stderr.count("tputrain: error:") == 1 and "Traceback" not in none.stderr

    train = subprocess.run([sys.executable, "-m", "tputrain.run", *common,
                            f"--gin_file={config}"], capture_output=True, text=True,
                           timeout=300, env=__import__("faults").child_env())
    assert train.returncode == 0, train.stderr[-3000:]
    out = tmp_path / "out"
    out.mkdir()
    done = run_cli("predict", *common, f"--input={data}/train*", f"--output={out}/p.npz",
                   "--log_every=1", "--step=4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "examples/s" in done.stderr
    assert os.listdir(out) == ["p.npz"]
    with np.load(out / "p.npz") as written:
        assert written["outputs"].shape == (40, 2) and written["outputs"].dtype == np.float32

    for flags, message in (
            ([f"--input={tmp_path}/nothing*", f"--output={out}/q.npz"], "no file matches"),
            ([f"--output={tmp_path}/missing/q.npz"], "does not exist"),
            (["--step=3", f"--output={out}/q.npz"], "no checkpoint of step 3"),
            ([f"--input={bad}/p*", f"--output={out}/q.npz"], "predict: 1 batches")):
        failed = run_cli("predict", *common, *flags, "--log_every=1")
        assert failed.returncode == 2, failed.stderr[-2000:]
        # (the corrupt shard fails after a batch was predicted: mid-prediction)
        assert message in failed.stderr and failed.stderr.count("tputrain: error:") == 1
        assert "Traceback" not in failed.stderr
        assert os.listdir(out) == ["p.npz"]  # no partial file, no temp file


def test_tfrecord_shards_are_read_in_order_and_dealt_to_hosts(tmp_path):
    x = np.arange(30 * 8, dtype=np.float32).reshape(30, 8)
    tputrain.data.write_tfrecords({"x": x, "label": np.zeros(30, np.int64)},
                                  str(tmp_path / "d"), num_shards=3)
    spec = ({"x": tf.TensorSpec([None, 8], tf.float32)}, tf.TensorSpec([None], tf.int64))

    def read(hosts, host):
        dataset = predict_module.tfrecord_examples(str(tmp_path / "d*"), spec, hosts, host)
        return np.stack([example["x"] for example in dataset.as_numpy_iterator()])
    np.testing.assert_array_equal(read(1, 0), x)  # shard after shard, no label needed
    np.testing.assert_array_equal(read(2, 1), x[10:20])  # host 1 of 2: shard 1
    np.testing.assert_array_equal(read(2, 0), np.concatenate([x[:10], x[20:]]))


@pytest.mark.parametrize("compression,manifest", [("GZIP", True), ("ZLIB", True),
                                                  ("GZIP", False)])
def test_compressed_shards_are_read_by_their_manifest_or_gzip_header(tmp_path, compression,
                                                                      manifest):
    """What `tputrain write-tfrecords --compression=...` writes: the manifest beside the
    shards names the compression; without one, a GZIP file shows by its first bytes."""
    x = np.arange(20 * 8, dtype=np.float32).reshape(20, 8)
    tputrain.data.write_tfrecords({"x": x}, str(tmp_path / "d"), num_shards=2,
                                  compression_type=compression, manifest=manifest)
    spec = ({"x": tf.TensorSpec([None, 8], tf.float32)}, tf.TensorSpec([None], tf.int64))
    dataset = predict_module.tfrecord_examples(str(tmp_path / "d-*"), spec, 1, 0)
    np.testing.assert_array_equal(np.stack([e["x"] for e in dataset.as_numpy_iterator()]), x)


def test_arrays_and_a_dataset_in_memory_predict_like_the_split(tmp_path):
    # What a Keras user passes to model.predict: NumPy arrays (a dict by input name), or
    # a tf.data.Dataset of batches, here of (features, labels) with a ragged last batch.
    trainer = trained(tmp_path / "run")
    expected = trainer.predict("eval")
    x = trainer.task.x_eval
    np.testing.assert_array_equal(trainer.predict({"x": x}), expected)
    labelled = tf.data.Dataset.from_tensor_slices(({"x": x}, np.zeros(len(x)))).batch(7)
    np.testing.assert_array_equal(trainer.predict(labelled), expected)
    with pytest.raises(ValueError, match="holds no examples"):
        trainer.predict({"x": x[:0]})


def test_an_input_that_is_neither_a_split_nor_a_file_names_the_tasks_splits(tmp_path):
    """`--input=validation` said only "no file matches 'validation'", not that the
    task's splits ('train', 'eval') are what --input also takes."""
    trainer = tputrain.Trainer(PaddedEvalTask(), str(tmp_path / "run"), strategy=strategy_for(1),
                               train_steps=2, steps_per_loop=2, global_batch_size=16,
                               report_mfu=False)
    with pytest.raises(FileNotFoundError,
                       match=r"no file matches 'validation'.*a split of the task: 'train', 'eval'"):
        trainer.predict("validation")


def test_a_mixture_split_is_predicted_from_its_features_without_the_source_id(tmp_path):
    """A `MixtureInput` split (and its dataset passed in) carries `source_id` beside
    the model's feature `x`: predict gives `model(x)`, as the eval loop does."""
    task = MixtureEvalTask(mixture_manifests(tmp_path))
    trainer = tputrain.Trainer(task, str(tmp_path / "run"), strategy=strategy_for(1),
                               train_steps=2, steps_per_loop=2, global_batch_size=8,
                               eval_steps=1, report_mfu=False, progress_bar="off")
    trainer.train()
    batches = task.build_inputs("eval", tputrain.data.InputContext(global_batch_size=8))
    x = np.concatenate([features["x"].numpy() for features, _ in batches])
    expected = trainer.model({"x": tf.constant(x)}, training=False).numpy()
    np.testing.assert_allclose(trainer.predict("eval"), expected, atol=1e-6)
    np.testing.assert_allclose(trainer.predict(batches), expected, atol=1e-6)


def test_in_memory_examples_are_dealt_to_hosts_in_contiguous_blocks():
    rows = np.arange(10, dtype=np.float32)[:, None]
    blocks = [np.concatenate(list(predict_module.memory_examples({"x": rows}, 3, host)
                                  .batch(10).map(lambda f: f["x"]).as_numpy_iterator()))
              for host in range(3)]
    np.testing.assert_array_equal(np.concatenate(blocks), rows)  # host order is input order
    assert [len(b) for b in blocks] == [4, 3, 3]
    with pytest.raises(ValueError, match="NumPy arrays or a TFRecord glob"):
        predict_module.memory_examples(tf.data.Dataset.range(4).batch(2), 2, 0)


class DroppingEvalTask(TinyTask):
    """TinyTask whose eval split of `num_examples` is read back from TFRecords (`cache`:
    as TFRecordInput takes it), or from memory, batched with drop_remainder=True."""

    def __init__(self, num_examples: int, data=None, cache=False):
        super().__init__(num_examples=num_examples)
        self.data, self.cache = data, cache

    def build_inputs(self, split, input_context):
        if split == "train" or self.data is None:
            return super().build_inputs(split, input_context)
        return tputrain.data.TFRecordInput(
            f"{self.data}/eval*", {"x": ([8], "float32"), "label": ([], "int64")},
            label_key="label", shuffle=False, repeat=False, cache=self.cache)(input_context)


@pytest.mark.parametrize("source", ["memory", "stream", "cached"])
def test_predict_says_how_many_examples_a_drop_remainder_split_left_out(tmp_path, caplog,
                                                                        source):
    data = None
    if source != "memory":
        data = tmp_path / "data"
        task = TinyTask(num_examples=250)
        tputrain.data.write_tfrecords({"x": task.x, "label": task.y}, str(data / "eval"),
                                      num_shards=2)
    task = DroppingEvalTask(250, data, cache=source == "cached")
    trainer = tputrain.Trainer(task, str(tmp_path / "run"), strategy=strategy_for(2),
                               train_steps=2, steps_per_loop=1, global_batch_size=16,
                               eval_steps=1, report_mfu=False)
    with caplog.at_level("WARNING"):
        outputs = trainer.predict("eval")
    assert outputs.shape == (248, 2)  # 31 per-replica batches of 8; 2 examples never read
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "2 of the 250 examples" in warnings[0] and "pad_remainder=True" in warnings[0]


def test_a_split_that_repeats_with_an_unknown_length_is_refused_not_read_forever():
    """`tputrain predict --input=train` on the digits: its train split is filtered after
    it repeats, so tf.data reports its length as unknown, not infinite, and predict
    read it (keeping every output in memory) until it was killed."""
    examples = tf.data.Dataset.from_tensor_slices(np.arange(8.0, dtype=np.float32))
    endless = examples.repeat().filter(lambda x: x >= 0).batch(4)
    assert int(endless.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    epochs = tf.data.Dataset.range(2**62).flat_map(lambda epoch: examples.take(epoch + 8))
    for forever in (endless, epochs.batch(4)):  # tputrain.data's epochs: a range of 2**62
        assert int(forever.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
        with pytest.raises(ValueError, match="the train split repeats forever"):
            predict_module.split_examples(forever, "train")
    for finite in (examples.filter(lambda x: x >= 0).batch(4),
                   examples.repeat().take(12).filter(lambda x: x >= 0).batch(4),
                   examples.repeat(2).filter(lambda x: x >= 0).batch(4),
                   tf.data.Dataset.range(3).flat_map(lambda epoch: examples).batch(4)):
        assert int(finite.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
        assert predict_module.split_examples(finite, "eval") is not None


def test_a_corrupt_record_names_its_file_for_a_split_and_a_glob(tmp_path):
    """A corrupt record met mid-prediction was TF's `corrupted record at N` (no file):
    now the CorruptRecordError naming the file, for a split and for a TFRecord glob."""
    from faults import RecordsTask

    x = np.random.RandomState(1).randn(64, 8).astype(np.float32)
    [path] = tputrain.data.write_tfrecords({"x": x, "label": np.zeros(64, np.int64)},
                                           str(tmp_path / "d" / "e"), num_shards=1)
    data = bytearray(open(path, "rb").read())
    data[len(data) * 3 // 4:len(data) * 3 // 4 + 64] = b"\xff" * 64  # past the first batch
    open(path, "wb").write(bytes(data))
    pattern = str(tmp_path / "d" / "e-*")
    trainer = tputrain.Trainer(RecordsTask(pattern), str(tmp_path / "m"),
                               strategy=strategy_for(1), train_steps=1, steps_per_loop=1,
                               global_batch_size=16, eval_steps=1)
    for source in ("eval", pattern):
        with pytest.raises(tputrain.data.CorruptRecordError, match="skip_corrupt=True") as caught:
            predict_module.predict_weights(trainer, source)
        assert path in str(caught.value)
