"""Tests for tputrain.data: TFRecord writing, reading, sharding and the input context."""

import logging
import os
import re

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import cli_refusal
from tputrain.data import (CorruptRecordError, InputContext, InputOptions, TFRecordInput,
                           explain_data_loss, feature_spec_for, parse_feature_spec,
                           write_tfrecords)
from tputrain.data.options import without_autotune

FEATURES = {"x": ([3], "float32"), "id": ([], "int64")}


def _write(directory, num_examples, num_shards, **kwargs):
    """Writes examples whose `id` is their index and `x` is id * [1, 2, 3]; returns a glob."""
    ids = np.arange(num_examples)
    examples = {"x": ids[:, None] * np.array([1.0, 2.0, 3.0], np.float32), "id": ids}
    write_tfrecords(examples, str(directory / "data"), num_shards, **kwargs)
    return str(directory / "data-*")


def _ids(dataset, label_key=None):
    batches = [batch[1] if label_key else batch["id"] for batch in dataset]
    return np.concatenate([b.numpy() for b in batches]).tolist() if batches else []


def _read_all(pattern, context, **kwargs):
    kwargs = {"shuffle": False, "repeat": False, **kwargs}
    return _ids(TFRecordInput(pattern, FEATURES, **kwargs)(context))


# Writing and reading back.


def test_round_trip_dict_of_arrays(tmp_path):
    examples = {
        "image": np.random.default_rng(0).normal(size=(12, 2, 3)).astype(np.float32),
        "id": np.arange(12, dtype=np.int32),
        "flag": np.arange(12) % 2 == 0,
        "raw": np.array([b"r%d" % i for i in range(12)]),
        "text": np.array(["t%d" % i for i in range(12)]),
        "blob": np.array([b"b" * i for i in range(12)], dtype=object),  # Variable-length bytes.
    }
    paths = write_tfrecords(examples, str(tmp_path / "sub" / "rt"), num_shards=3)
    assert paths == [str(tmp_path / "sub" / f"rt-{i:05d}-of-00003.tfrecord") for i in range(3)]
    spec = feature_spec_for(examples)
    assert spec["image"] == tf.io.FixedLenFeature([2, 3], tf.float32)
    assert spec["id"].dtype == tf.int64 and spec["flag"].dtype == tf.int64
    assert spec["raw"].dtype == spec["text"].dtype == spec["blob"].dtype == tf.string

    # cycle_length=1 reads the shards one after another: the original order.
    dataset = TFRecordInput(str(tmp_path / "sub" / "rt-*"), spec, global_batch_size=4,
                            shuffle=False, repeat=False, cycle_length=1)()
    batches = list(dataset.as_numpy_iterator())
    assert len(batches) == 3
    got = {key: np.concatenate([b[key] for b in batches]) for key in spec}
    np.testing.assert_array_equal(got["image"], examples["image"])
    np.testing.assert_array_equal(got["id"], examples["id"])
    np.testing.assert_array_equal(got["flag"], examples["flag"].astype(np.int64))
    assert got["raw"].tolist() == examples["raw"].tolist()
    assert [t.decode() for t in got["text"]] == examples["text"].tolist()
    assert got["blob"].tolist() == examples["blob"].tolist()


def test_round_trip_iterable_is_round_robin_and_gzip(tmp_path):
    examples = ({"id": i, "x": [i, 2.0 * i, 3.0 * i]} for i in range(10))
    write_tfrecords(examples, str(tmp_path / "rr"), num_shards=3, compression_type="GZIP")
    dataset = TFRecordInput(str(tmp_path / "rr-*"), FEATURES, label_key="id",
                            global_batch_size=1, shuffle=False, repeat=False, cycle_length=1,
                            compression_type="GZIP")()
    batches = list(dataset.as_numpy_iterator())
    assert [int(label[0]) for _, label in batches] == [0, 3, 6, 9, 1, 4, 7, 2, 5, 8]
    for features, label in batches:
        np.testing.assert_allclose(features["x"][0], label[0] * np.array([1, 2, 3]))


def test_missing_feature_uses_default(tmp_path):
    pattern = _write(tmp_path, 4, 1)
    features = {**FEATURES, "weight": ([2], "float32", 0.5)}
    batch = next(iter(TFRecordInput(pattern, features, global_batch_size=4, shuffle=False)()))
    np.testing.assert_allclose(batch["weight"].numpy(), np.full((4, 2), 0.5))


# Sharding across input pipelines.


def test_file_sharding_gives_each_pipeline_disjoint_files(tmp_path, caplog):
    pattern = _write(tmp_path, 32, 8)  # Shard s holds ids 4s .. 4s+3.
    shards_per_pipeline = []
    all_ids = []
    with caplog.at_level(logging.WARNING):
        for pipeline in range(4):
            context = InputContext(4, pipeline, num_replicas_in_sync=4, global_batch_size=4)
            ids = _read_all(pattern, context)
            shards_per_pipeline.append({i // 4 for i in ids})
            all_ids += ids
    assert "input pipelines" not in caplog.text
    assert all(len(shards) == 2 for shards in shards_per_pipeline)
    assert set().union(*shards_per_pipeline) == set(range(8))
    assert sorted(all_ids) == list(range(32))  # Disjoint and complete.


def test_fewer_files_than_pipelines_shards_records_with_a_warning(tmp_path, caplog):
    pattern = _write(tmp_path, 20, 2)
    per_pipeline = []
    with caplog.at_level(logging.WARNING):
        for pipeline in range(4):
            context = InputContext(4, pipeline, num_replicas_in_sync=4, global_batch_size=4)
            # Shuffled and non-deterministic: record sharding must still be disjoint.
            per_pipeline.append(_read_all(pattern, context, shuffle=True, seed=3,
                                          deterministic=False))
    assert "2 file(s)" in caplog.text and "4 input pipelines" in caplog.text
    assert all(len(ids) == 5 for ids in per_pipeline)
    assert sorted(sum(per_pipeline, [])) == list(range(20))


def test_works_with_distribute_datasets_from_function(tmp_path):
    pattern = _write(tmp_path, 64, 4)
    strategy = tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")])
    replicas = strategy.num_replicas_in_sync
    inputs = TFRecordInput(pattern, FEATURES, label_key="id", shuffle=False)
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: inputs(InputContext.from_tf(ctx, 2 * replicas)))
    features, labels = next(iter(dataset))
    local = strategy.experimental_local_results(labels)
    assert len(local) == replicas
    assert all(t.shape == (2,) for t in local)
    assert strategy.experimental_local_results(features["x"])[0].shape == (2, 3)


# Batching and static shapes.


@pytest.mark.parametrize("label_key", [None, "id"])
def test_element_spec_is_fully_static(tmp_path, label_key):
    pattern = _write(tmp_path, 8, 2)
    dataset = TFRecordInput(pattern, FEATURES, label_key=label_key, global_batch_size=4)()
    specs = tf.nest.flatten(dataset.element_spec)
    assert specs and all(s.shape.is_fully_defined() for s in specs)
    if label_key:
        features, label = dataset.element_spec
        assert set(features) == {"x"} and label.shape == (4,)
        assert features["x"].shape == (4, 3)
    else:
        assert dataset.element_spec["x"].shape == (4, 3)
        assert dataset.element_spec["id"].shape == (4,)


def test_one_static_shape_check_for_builders_and_the_trainer():
    """`check_static` names the pipeline and feature; given the per-replica batch it
    also refuses another leading dimension (what the Trainer checks)."""
    from tputrain.data.batching import check_static
    spec = {"x": tf.TensorSpec([4, None]), "y": tf.TensorSpec([3])}
    with pytest.raises(ValueError, match=r"^TFDSInput: feature 'x' has dynamic shape "
                                         r"\(4, None\): TPUs and compiled loops need static "
                                         r"shapes; pad it$"):
        check_static("TFDSInput", spec, "pad it")
    spec["x"] = tf.TensorSpec([4, 2])
    check_static("train input", spec, "pad it")  # shapes alone are static
    with pytest.raises(ValueError, match="train input: feature 'y' has batch dimension 3 but "
                                         "the per-replica batch is 4"):
        check_static("train input", spec, "pad it", per_replica_batch=4)


def test_drop_remainder(tmp_path):
    pattern = _write(tmp_path, 10, 2)
    dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, shuffle=False,
                            repeat=False)()
    sizes = [int(batch["id"].shape[0]) for batch in dataset]
    assert sizes == [4, 4]


@pytest.mark.parametrize("cache", [False, "memory"])
def test_pad_remainder_keeps_every_example_with_weights(tmp_path, cache):
    """10 examples, batch 4: three static batches, the last padded with weight-0 zeros."""
    pattern = _write(tmp_path, 10, 2)
    dataset = TFRecordInput(pattern, FEATURES, label_key="id", global_batch_size=4,
                            shuffle=False, repeat=False, cache=cache, pad_remainder=True)()
    assert [s.shape.as_list() for s in tf.nest.flatten(dataset.element_spec)] == [[4, 3], [4], [4]]
    batches = list(dataset)
    assert len(batches) == 3
    ids = np.concatenate([b[1].numpy() for b in batches])
    weights = np.concatenate([b[2].numpy() for b in batches])
    np.testing.assert_array_equal(weights, [1] * 10 + [0, 0])
    assert sorted(ids[:10].tolist()) == list(range(10))
    np.testing.assert_array_equal(ids[10:], [0, 0])
    np.testing.assert_array_equal(batches[-1][0]["x"].numpy()[2:], np.zeros([2, 3]))


def test_pad_remainder_is_for_finite_labelled_eval(tmp_path):
    pattern = _write(tmp_path, 10, 2)
    with pytest.raises(ValueError, match="pad_remainder is for evaluation"):
        TFRecordInput(pattern, FEATURES, label_key="id", pad_remainder=True)  # repeats
    with pytest.raises(ValueError, match="pad_remainder is for evaluation"):
        TFRecordInput(pattern, FEATURES, repeat=False, pad_remainder=True)  # no label


def test_per_replica_batch_is_global_over_replicas(tmp_path):
    pattern = _write(tmp_path, 16, 2)
    inputs = TFRecordInput(pattern, FEATURES)
    batch = next(iter(inputs(InputContext(num_replicas_in_sync=4, global_batch_size=16))))
    assert batch["id"].shape == (4,)
    # A plain TF context plus the constructor's global batch.
    tf_context = tf.distribute.InputContext(num_replicas_in_sync=2)
    inputs = TFRecordInput(pattern, FEATURES, global_batch_size=8)
    assert next(iter(inputs(tf_context)))["id"].shape == (4,)
    wrapped = InputContext.from_tf(tf_context, 8)
    assert (wrapped.num_replicas_in_sync, wrapped.global_batch_size) == (2, 8)
    assert wrapped.get_per_replica_batch_size(8) == 4


def test_indivisible_global_batch_names_the_fix(tmp_path):
    pattern = _write(tmp_path, 4, 1)
    message = "global batch 100 is not divisible by 8 replicas: use a multiple of 8"
    inputs = TFRecordInput(pattern, FEATURES, global_batch_size=100)
    with pytest.raises(ValueError, match=message):
        inputs(InputContext(num_replicas_in_sync=8))
    with pytest.raises(ValueError, match=message):
        InputContext(num_replicas_in_sync=8, global_batch_size=100)


def test_missing_global_batch_says_where_to_set_it(tmp_path):
    pattern = _write(tmp_path, 4, 1)
    with pytest.raises(ValueError, match="global_batch_size"):
        TFRecordInput(pattern, FEATURES)()


# Errors that name the fix.


def test_no_matching_file_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "nothing-here-*")
    inputs = TFRecordInput(pattern, FEATURES, global_batch_size=2)
    with pytest.raises(FileNotFoundError, match="nothing-here-"):
        inputs()


@pytest.mark.parametrize("feature", [
    tf.io.VarLenFeature(tf.int64),
    tf.io.RaggedFeature(tf.int64),
    tf.io.FixedLenSequenceFeature([], tf.int64, allow_missing=True),
    tf.io.FixedLenFeature([None], tf.int64),
    ([None, 3], "float32"),
])
def test_variable_length_features_are_refused(feature):
    with pytest.raises(ValueError, match=r"'tokens'.*static shapes.*FixedLenFeature"):
        parse_feature_spec({"tokens": feature})
    with pytest.raises(ValueError, match="'tokens'"):
        TFRecordInput("unused-*", {"tokens": feature})


def test_constructor_validates_eagerly():
    with pytest.raises(ValueError, match="label_key 'y' is not a feature"):
        TFRecordInput("f-*", FEATURES, label_key="y")
    with pytest.raises(ValueError, match="float32, int64 or string"):
        parse_feature_spec({"x": ([2], "int32")})
    with pytest.raises(ValueError, match="shuffle_buffer"):
        TFRecordInput("f-*", FEATURES, shuffle_buffer=0)
    with pytest.raises(ValueError, match="compression_type"):
        TFRecordInput("f-*", FEATURES, compression_type="zip")


def test_short_form_feature_spec_and_gin():
    spec = parse_feature_spec({
        "image": ([64], "float32"),
        "label": ([], "int64"),
        "mask": ([2], tf.float32, 1.0),
        "full": tf.io.FixedLenFeature([2, 2], tf.string),
    })
    assert spec["image"] == tf.io.FixedLenFeature([64], tf.float32)
    assert spec["label"] == tf.io.FixedLenFeature([], tf.int64)
    assert spec["mask"].shape == [2] and spec["mask"].default_value.tolist() == [1.0, 1.0]
    assert spec["full"] == tf.io.FixedLenFeature([2, 2], tf.string)

    gin.clear_config()
    try:
        gin.parse_config("""
            TFRecordInput.features = {'image': ([64], 'float32'), 'label': ([], 'int64')}
            TFRecordInput.label_key = 'label'
        """)
        inputs = TFRecordInput("f-*")
    finally:
        gin.clear_config()
    assert inputs.features == {"image": tf.io.FixedLenFeature([64], tf.float32),
                               "label": tf.io.FixedLenFeature([], tf.int64)}
    assert inputs.label_key == "label"


# Atomic, validated writes.


def test_writer_leaves_no_temp_files(tmp_path):
    paths = write_tfrecords({"id": np.arange(6)}, str(tmp_path / "a"), num_shards=2)
    # The shards and their manifest, nothing else.
    assert sorted(tf.io.gfile.listdir(str(tmp_path))) == sorted(
        [p.split("/")[-1] for p in paths] + ["a.manifest.json"])


def test_writer_failure_leaves_nothing(tmp_path):
    def examples():
        for i in range(5):
            yield {"id": i}
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_tfrecords(examples(), str(tmp_path / "b"), num_shards=2)
    assert tf.io.gfile.listdir(str(tmp_path)) == []


def test_writer_validates_its_input(tmp_path):
    prefix = str(tmp_path / "c")
    with pytest.raises(ValueError, match="num_shards"):
        write_tfrecords({"id": np.arange(4)}, prefix, num_shards=0)
    with pytest.raises(ValueError, match=r"'a': 3, 'b': 4"):
        write_tfrecords({"a": np.zeros(3), "b": np.zeros(4)}, prefix, num_shards=1)
    with pytest.raises(ValueError, match="empty"):
        write_tfrecords({"id": np.zeros(0)}, prefix, num_shards=1)
    with pytest.raises(ValueError, match="empty"):
        write_tfrecords({}, prefix, num_shards=1)
    with pytest.raises(ValueError, match="empty"):
        write_tfrecords(iter([]), prefix, num_shards=1)
    with pytest.raises(ValueError, match="'x'.*pad"):
        write_tfrecords([{"x": [1, 2]}, {"x": [1, 2, 3]}], prefix, num_shards=1)
    with pytest.raises(ValueError, match="num_shards <= 2"):
        write_tfrecords({"id": np.arange(2)}, prefix, num_shards=3)
    assert tf.io.gfile.listdir(str(tmp_path)) == []


def test_writer_works_on_ram_filesystem():
    prefix = "ram://tputrain_test_data/d"
    paths = write_tfrecords({"id": np.arange(4), "x": np.ones((4, 3))}, prefix, num_shards=2)
    try:
        assert all(tf.io.gfile.exists(p) for p in paths)
        assert _read_all(prefix + "-*", InputContext(global_batch_size=2)) == [0, 2, 1, 3]
    finally:
        for p in paths:
            tf.io.gfile.remove(p)


# Shuffling and caching.


def test_seeded_shuffle_is_deterministic_across_builds(tmp_path):
    pattern = _write(tmp_path, 40, 4)

    def first_ids(seed):
        dataset = TFRecordInput(pattern, FEATURES, global_batch_size=8, seed=seed,
                                shuffle_buffer=16)()
        return _ids(dataset.take(10))  # Two epochs: reshuffled, still reproducible.

    first = first_ids(seed=7)
    assert first == first_ids(seed=7)
    assert first != first_ids(seed=8)
    assert sorted(first[:40]) == list(range(40)) and first[:40] != list(range(40))
    assert sorted(first[40:]) == list(range(40)) and first[40:] != first[:40]


def test_cache(tmp_path):
    pattern = _write(tmp_path, 12, 3)
    dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, cache=True)()
    ids = _ids(dataset.take(9))  # Three epochs, the last two from the cache.
    for epoch in range(3):
        assert sorted(ids[12 * epoch:12 * (epoch + 1)]) == list(range(12))


def test_memory_cache_sees_every_example_once_per_epoch_across_batches(tmp_path):
    pattern = _write(tmp_path, 10, 2)  # 10 examples, batches of 4: epochs end mid-batch
    def read(seed, shuffle=True):
        dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, cache="memory",
                                seed=seed, shuffle=shuffle)()
        return _ids(dataset.take(10))  # Four epochs.
    ids = read(seed=5)
    for epoch in range(4):
        assert sorted(ids[10 * epoch:10 * (epoch + 1)]) == list(range(10))
    assert ids[:10] != ids[10:20]  # Reshuffled each epoch...
    assert ids == read(seed=5) and ids != read(seed=6)  # ...reproducibly.
    in_order = TFRecordInput(pattern, FEATURES, global_batch_size=4, shuffle=False)()
    assert read(seed=0, shuffle=False) == _ids(in_order.take(10))  # Same order as uncached.
    one_pass = TFRecordInput(pattern, FEATURES, global_batch_size=4, cache="memory",
                             repeat=False, label_key="id")()
    assert len(list(one_pass)) == 2  # The partial last batch is dropped.


def test_memory_cache_keeps_pipelines_disjoint(tmp_path):
    pattern = _write(tmp_path, 24, 4)
    per_pipeline = [
        _read_all(pattern, InputContext(2, i, num_replicas_in_sync=2, global_batch_size=4),
                  cache="memory", shuffle=True)
        for i in range(2)]
    assert all(len(ids) == 12 for ids in per_pipeline)
    assert sorted(sum(per_pipeline, [])) == list(range(24))


def test_file_cache_writes_per_pipeline_files(tmp_path):
    pattern = _write(tmp_path, 12, 3)
    prefix = str(tmp_path / "cache" / "train")
    tf.io.gfile.makedirs(str(tmp_path / "cache"))
    dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, cache=prefix)()
    ids = _ids(dataset.take(6))  # Two epochs; the second reads the cache file.
    assert sorted(ids[:12]) == sorted(ids[12:]) == list(range(12))
    assert any(name.startswith("train-00000-of-00001") for name in os.listdir(tmp_path / "cache"))


def test_manifest_replaces_the_feature_spec(tmp_path):
    ids = np.arange(8)
    write_tfrecords({"x": ids[:, None] * np.ones((1, 3), np.float32), "id": ids},
                    str(tmp_path / "m"), num_shards=2)
    path = str(tmp_path / "m.manifest.json")
    inputs = TFRecordInput(manifest=path, label_key="id", global_batch_size=4, shuffle=False)
    assert inputs.features == {"x": tf.io.FixedLenFeature([3], tf.float32),
                               "id": tf.io.FixedLenFeature([], tf.int64)}
    with pytest.raises(ValueError, match="not both"):
        TFRecordInput(str(tmp_path / "m-*"), manifest=path)
    with pytest.raises(ValueError, match="features is not set"):
        TFRecordInput(str(tmp_path / "m-*"))
    with pytest.raises(FileNotFoundError, match="no manifest"):
        TFRecordInput(manifest=str(tmp_path / "nothing.json"))
    (tmp_path / "bad.json").write_text("{\"format\": \"other\"}")
    with pytest.raises(ValueError, match="not a tputrain TFRecord manifest"):
        TFRecordInput(manifest=str(tmp_path / "bad.json"))
    os.remove(tmp_path / "m-00001-of-00002.tfrecord")
    with pytest.raises(FileNotFoundError, match="1 shard.*missing.*m-00001-of-00002"):
        inputs()


def test_input_options_reach_tf_data(tmp_path):
    pattern = _write(tmp_path, 8, 2)
    options = InputOptions(threadpool_size=1, max_intra_op_parallelism=1, autotune=False,
                           autotune_ram_budget=2**28, prefetch=0,
                           external_state_policy="warn")
    dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, options=options)()
    tf_options = dataset.options()
    assert tf_options.threading.private_threadpool_size == 1
    assert tf_options.threading.max_intra_op_parallelism == 1
    assert tf_options.autotune.enabled is False and tf_options.autotune.ram_budget == 2**28
    assert tf_options.experimental_external_state_policy == (
        tf.data.experimental.ExternalStatePolicy.WARN)
    assert sorted(_ids(dataset.take(2))) == list(range(8))
    gin.parse_config("InputOptions.prefetch = 8\nTFRecordInput.options = @InputOptions()")
    assert TFRecordInput(pattern, FEATURES).options == InputOptions(prefetch=8)
    with pytest.raises(ValueError, match="threadpool_size"):
        InputOptions(threadpool_size=0)
    with pytest.raises(ValueError, match="grpc://host:port"):
        InputOptions(service_address="localhost:5050")
    with pytest.raises(ValueError, match="service_address"):
        InputOptions(service_job_name="job")


def test_tf_data_service_offloads_the_pipeline(tmp_path):
    pattern = _write(tmp_path, 16, 2)
    dispatcher = tf.data.experimental.service.DispatchServer()
    address = dispatcher.target.split("://")[1]
    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=address))
    try:
        options = InputOptions(service_address=dispatcher.target, service_job_name="t")
        dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, shuffle=False,
                                repeat=False, options=options)()
        assert sorted(_ids(dataset)) == list(range(16))
    finally:
        worker.stop()
        dispatcher.stop()


# Corrupt and truncated records.


def _corrupt(path, record, record_count):
    """Flips a byte inside the data of `record` (all records have the same size)."""
    data = bytearray(open(path, "rb").read())
    size = len(data) // record_count
    data[record * size + 14] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_corrupt_record_error_names_file_and_record(tmp_path):
    pattern = _write(tmp_path, 20, 2)
    bad = str(tmp_path / "data-00001-of-00002.tfrecord")
    _corrupt(bad, record=3, record_count=10)
    dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, shuffle=False)()
    with pytest.raises(tf.errors.DataLossError) as raised:
        _ids(dataset.take(10))
    error = explain_data_loss(raised.value)
    assert isinstance(error, CorruptRecordError)
    message = str(error)
    assert "\n" not in message
    assert bad in message and "record 3" in message and "skip_corrupt=True" in message
    unrelated = ValueError("not a data loss")
    assert explain_data_loss(unrelated) is unrelated


def test_corrupt_record_error_names_the_newest_pipelines_file(tmp_path):
    """An older pipeline's file, corrupt the same way, is not named instead (a notebook,
    or a test process, builds several pipelines)."""
    paths = {}
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        pattern = _write(tmp_path / name, 20, 2)
        paths[name] = str(tmp_path / name / "data-00001-of-00002.tfrecord")
        _corrupt(paths[name], record=3, record_count=10)
        dataset = TFRecordInput(pattern, FEATURES, global_batch_size=4, shuffle=False)()
    with pytest.raises(tf.errors.DataLossError) as raised:
        _ids(dataset.take(10))
    message = str(explain_data_loss(raised.value))
    assert paths["new"] in message and paths["old"] not in message


@pytest.mark.slow
@pytest.mark.parametrize("with_manifest", [True, False])
def test_skip_corrupt_reads_the_rest_and_reports_the_count(tmp_path, capfd, with_manifest):
    _write(tmp_path, 20, 2)
    bad = str(tmp_path / "data-00001-of-00002.tfrecord")
    _corrupt(bad, record=3, record_count=10)
    source = ({"manifest": str(tmp_path / "data.manifest.json")} if with_manifest else
              {"file_pattern": str(tmp_path / "data-*.tfrecord"), "features": FEATURES})
    dataset = TFRecordInput(**source, global_batch_size=1, shuffle=False, repeat=False,
                            skip_corrupt=True)()
    ids = _ids(dataset)
    # File 0 whole, file 1 up to its bad record 3: ids 10, 11, 12 of file 1.
    assert sorted(ids) == list(range(10)) + [10, 11, 12]
    stderr = capfd.readouterr().err
    count = "skipped 7" if with_manifest else "skipped ~7"
    assert f"{count} corrupt or unreadable record(s) of {bad}" in stderr
    assert "reading stopped at record 3" in stderr


def test_truncated_file_is_skipped_with_a_count(tmp_path, capfd):
    _write(tmp_path, 20, 2)
    bad = str(tmp_path / "data-00000-of-00002.tfrecord")
    data = open(bad, "rb").read()
    open(bad, "wb").write(data[:-30])  # The last record loses its end.
    dataset = TFRecordInput(manifest=str(tmp_path / "data.manifest.json"), global_batch_size=1,
                            shuffle=False, repeat=False, skip_corrupt=True)()
    assert len(_ids(dataset)) == 19
    assert f"skipped 1 corrupt or unreadable record(s) of {bad}" in capfd.readouterr().err


class _RecordsTask(tputrain.Task):
    """Classifies id parity from x = id * [1, 2, 3], read by TFRecordInput."""

    def __init__(self, pattern, **input_options):
        self.pattern = pattern
        self.input_options = input_options

    def build_model(self):
        x = keras.Input((3,), name="x")
        return keras.Model({"x": x}, keras.layers.Dense(2)(x))

    def build_inputs(self, split, input_context):
        dataset = TFRecordInput(self.pattern, FEATURES, label_key="id", shuffle=False,
                                **self.input_options)(input_context)
        return dataset.map(lambda features, ids: (features, ids % 2))

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)


def test_training_on_a_corrupt_shard_fails_in_one_line_or_skips(tmp_path, capfd):
    _write(tmp_path, 40, 2)
    bad = str(tmp_path / "data-00001-of-00002.tfrecord")
    _corrupt(bad, record=12, record_count=20)  # past the first batches: fails mid-training
    options = dict(train_steps=12, steps_per_loop=4, global_batch_size=4, checkpoint_every=12,
                   eval_steps=1, report_mfu=False,
                   strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    strict = tputrain.Trainer(_RecordsTask(str(tmp_path / "data-*.tfrecord")),
                              str(tmp_path / "strict"), **options)
    with pytest.raises(CorruptRecordError) as raised:
        strict.train()
    assert "\n" not in str(raised.value)
    assert bad in str(raised.value) and "record 12" in str(raised.value)

    skipping = tputrain.Trainer(
        _RecordsTask(str(tmp_path / "data-*.tfrecord"), skip_corrupt=True),
        str(tmp_path / "skip"), **options)
    skipping.train()
    assert int(skipping.step.numpy()) == 12
    assert f"skipped ~8 corrupt or unreadable record(s) of {bad}" in capfd.readouterr().err


def test_read_parallelism_follows_the_storage():
    inputs = TFRecordInput("f-*", FEATURES)
    assert inputs._read_parallelism(["gs://bucket/f-0"], 16) == tf.data.AUTOTUNE  # network-bound
    assert inputs._read_parallelism(["/data/f-0"], 16) == min(16, os.cpu_count())  # CPU-bound
    assert TFRecordInput("f-*", FEATURES, read_parallelism=4)._read_parallelism(["/d/f"], 2) == 2
    with pytest.raises(ValueError, match="read_parallelism must be >= 1"):
        TFRecordInput("f-*", FEATURES, read_parallelism=0)


# Globs that match more than the shards (issue item 9).


def test_prefix_glob_skips_the_writers_manifest_and_temp_files(tmp_path):
    """`write_tfrecords(..., "DIR/train")` then `TFRecordInput("DIR/train*")` reads the
    shards only: the manifest and the temp files of an interrupted write are not records."""
    ids = np.arange(12)
    write_tfrecords({"x": ids[:, None] * np.ones((1, 3), np.float32), "id": ids},
                    str(tmp_path / "train"), num_shards=2)
    token = "0123456789abcdef0123456789abcdef"
    (tmp_path / "train.manifest.json.tmp").write_text("{")  # an interrupted manifest write
    (tmp_path / f".train.manifest.json.tmp-{token}").write_text("{")
    (tmp_path / f".train-00000-of-00002.tfrecord.tmp-{token}").write_bytes(b"\x07half")
    (tmp_path / f".train.spool-{token}").write_bytes(b"\x07half")
    for pattern in ("train*", "*"):
        inputs = TFRecordInput(str(tmp_path / pattern), FEATURES, global_batch_size=4,
                               shuffle=False, repeat=False)
        assert sorted(_ids(inputs())) == list(range(12))
    with pytest.raises(FileNotFoundError, match="only.*train.manifest.json.*-NNNNN-of-NNNNN"):
        TFRecordInput(str(tmp_path / "train.m*"), FEATURES, global_batch_size=4)()


def test_a_file_that_is_not_a_tfrecord_is_named_with_the_reason(tmp_path):
    from tputrain.runtime.validate import probe_inputs

    _write(tmp_path, 8, 2)
    notes = tmp_path / "data-notes.txt"
    notes.write_text("these shards were written on Monday\n")
    dataset = TFRecordInput(str(tmp_path / "data*"), FEATURES, global_batch_size=4,
                            shuffle=False)()  # the first batch has a record of each file
    with pytest.raises(CorruptRecordError) as raised:
        probe_inputs(dataset, "train")
    message = str(raised.value)
    assert "\n" not in message
    assert f"{notes} is not a TFRecord file" in message and "text" in message
    assert "file_pattern" in message


# Records that do not match the feature spec (issue item 4).


def _write_shape_3(directory, **kwargs):
    ids = np.arange(8)
    write_tfrecords({"x": ids[:, None] * np.ones((1, 3), np.float32), "id": ids},
                    str(directory / "data"), num_shards=2, **kwargs)


@pytest.mark.parametrize("features, expected", [
    ({"x": ([4], "float32"), "id": ([], "int64")},
     r"feature 'x'.*float32 \[4\].*float32 \[3\]"),
    ({"x": ([3], "float32"), "id": ([], "float32")},
     r"feature 'id'.*float32 \[\].*int64 \[\]"),
    ({"x": ([3], "float32"), "y": ([], "int64")}, r"feature 'y'.*not in the data"),
])
def test_manifest_next_to_the_shards_catches_a_wrong_spec_before_reading(
        tmp_path, features, expected):
    from tputrain.data import FeatureSpecError

    _write_shape_3(tmp_path)
    inputs = TFRecordInput(str(tmp_path / "data-*"), features, global_batch_size=4)
    with pytest.raises(FeatureSpecError, match=expected) as raised:
        inputs()
    message = str(raised.value)
    assert "\n" not in message and str(tmp_path / "data.manifest.json") in message
    with pytest.raises(FeatureSpecError, match=expected):  # at construction with manifest=
        TFRecordInput(features=features, manifest=str(tmp_path / "data.manifest.json"))
    # A reshape of the same number of values reads fine.
    TFRecordInput(str(tmp_path / "data-*"), {"x": ([1, 3], "float32")}, global_batch_size=4)()


@pytest.mark.parametrize("features, expected", [
    ({"x": ([4], "float32"), "id": ([], "int64")},
     r"feature 'x'.*float32 \[4\] \(4 values\).*float_list of 3 values"),
    ({"x": ([3], "float32"), "id": ([], "float32")},
     r"feature 'id'.*float32 \[\].*int64_list of 1 value"),
    ({"x": ([3], "float32"), "y": ([], "int64")}, r"feature 'y'.*missing"),
])
def test_spec_mismatch_without_manifest_names_file_feature_and_data(tmp_path, features, expected):
    from tputrain.data import FeatureSpecError
    from tputrain.runtime.validate import probe_inputs

    _write_shape_3(tmp_path, manifest=False)
    dataset = TFRecordInput(str(tmp_path / "data-*"), features, global_batch_size=4,
                            shuffle=False)()
    with pytest.raises(FeatureSpecError, match=expected) as raised:
        probe_inputs(dataset, "train")
    message = str(raised.value)
    assert "\n" not in message and "record 0 of " + str(tmp_path / "data-0000") in message
    with pytest.raises(FeatureSpecError, match=expected):  # cache="memory" parses at build
        TFRecordInput(str(tmp_path / "data-*"), features, global_batch_size=4,
                      cache="memory")()


def test_trainer_preflight_reports_a_spec_mismatch_in_one_line(tmp_path):
    from tputrain.data import FeatureSpecError

    ids = np.arange(16)
    write_tfrecords({"x": ids[:, None] * np.ones((1, 4), np.float32), "id": ids},
                    str(tmp_path / "data"), num_shards=2, manifest=False)
    with pytest.raises(FeatureSpecError, match=r"feature 'x'.*\[3\].*4 values") as raised:
        tputrain.Trainer(_RecordsTask(str(tmp_path / "data-*")), str(tmp_path / "run"),
                         train_steps=4, global_batch_size=4, report_mfu=False,
                         strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    message = str(raised.value).split("\n  In call to configurable")[0]  # gin's addition
    assert "\n" not in message and "data-0000" in message
    assert not (tmp_path / "run").exists()


class _MaskingTask(tputrain.Task):
    """Two inputs (pixels, meta) -> a 1-unit regression; its map drops NaN rows after
    `batch(drop_remainder=True)`, so the pixels lose their static batch dimension."""

    def __init__(self, plain: bool = False):
        self.plain = plain

    def build_model(self):
        pixels, meta = keras.Input((6,), name="pixels"), keras.Input((2,), name="meta")
        joined = keras.layers.Concatenate()([pixels, meta])
        return keras.Model({"pixels": pixels, "meta": meta}, keras.layers.Dense(1)(joined))

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        pixels = np.random.default_rng(0).normal(size=(32, 6)).astype(np.float32)
        dataset = tf.data.Dataset.from_tensor_slices(
            ({"pixels": pixels, "meta": pixels[:, :2]}, pixels[:, :1])).repeat()

        def drop_nan_rows(features, labels):
            finite = tf.reduce_all(tf.math.is_finite(features["pixels"]), axis=1)
            pixels = tf.boolean_mask(features["pixels"], finite)
            return (pixels if self.plain else dict(features, pixels=pixels)), labels
        return dataset.batch(batch, drop_remainder=True).map(drop_nan_rows)

    def compute_loss(self, labels, outputs):
        return tf.reduce_mean(tf.square(labels - outputs), axis=-1)


@pytest.mark.parametrize("plain", [False, True])
def test_a_map_that_loses_the_batch_dimension_is_named_with_the_fix(tmp_path, plain):
    """The error names the feature (not its tuple index '0') and, since the batch
    already drops its remainder, says to restore the shape after the map."""
    with pytest.raises(ValueError) as raised:
        tputrain.Trainer(_MaskingTask(plain), str(tmp_path / "run"), train_steps=2,
                         global_batch_size=4, report_mfu=False,
                         strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    message = str(raised.value)
    name = "the features" if plain else "feature 'pixels'"
    assert message.startswith(f"train input: {name} has dynamic shape (None, 6)"), message
    assert "end that map with tf.ensure_shape(value, [4, 6])" in message, message
    assert "batch with drop_remainder=True" not in message, message


# Variable-length features: read per example, made static by a `to_static` transform.


def _write_tokens(directory, rows, **kwargs):
    """Writes token rows of different lengths (and their index as `id`); returns the manifest."""
    write_tfrecords({"tokens": rows, "id": np.arange(len(rows))}, str(directory / "seq"),
                    **kwargs)
    return str(directory / "seq.manifest.json")


def _pad_to(length):
    """A user's own to_static: pad every row to `length` and keep its true length."""
    def pad(example):
        tokens = example["tokens"]
        padded = tf.ensure_shape(tf.pad(tokens, [[0, length - tf.size(tokens)]]), [length])
        return {**example, "tokens": padded, "length": tf.size(tokens)}

    return lambda dataset: dataset.map(pad)


def test_variable_length_records_read_bitwise_through_to_static(tmp_path):
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 259, size=n) for n in [0, 3, 40, 0, 1, 17, 99, 2]]
    manifest = _write_tokens(tmp_path, rows, num_shards=2)
    inputs = TFRecordInput(manifest=manifest, global_batch_size=4, shuffle=False, repeat=False,
                           to_static=_pad_to(100))
    batches = list(inputs())
    assert all(b["tokens"].shape == (4, 100) for b in batches)
    got = {int(i): t[:n].tolist() for b in batches
           for i, t, n in zip(b["id"].numpy(), b["tokens"].numpy(), b["length"].numpy())}
    assert got == {i: r.tolist() for i, r in enumerate(rows)}


def test_variable_length_features_need_to_static_and_say_so(tmp_path):
    manifest = _write_tokens(tmp_path, [np.arange(n) for n in (1, 2, 3)], num_shards=1)
    with pytest.raises(ValueError) as e:
        TFRecordInput(manifest=manifest, global_batch_size=2)
    # One line (gin adds its own context line below it).
    assert re.search(r"feature 'tokens' is variable-length.*to_static=.*PackSequences",
                     str(e.value).splitlines()[0])
    with pytest.raises(ValueError, match="pad_remainder"):
        TFRecordInput(manifest=manifest, label_key="id", repeat=False, pad_remainder=True,
                      to_static=_pad_to(4))
    with pytest.raises(TypeError, match="to_static must be callable"):
        TFRecordInput(manifest=manifest, to_static=4)


def test_variable_length_spec_is_checked_against_the_manifest(tmp_path):
    from tputrain.data import FeatureSpecError
    manifest = _write_tokens(tmp_path, [np.arange(n) for n in (1, 2, 3)], num_shards=1)
    with pytest.raises(FeatureSpecError) as e:
        TFRecordInput(manifest=manifest, features={"tokens": ([5], "int64")})
    assert re.search(r"'tokens'.*int64 \[5\].*variable-length.*to_static",
                     str(e.value).splitlines()[0])
    with pytest.raises(FeatureSpecError, match=r"'tokens'.*float32 \[None\].*int64 \[None\]"):
        TFRecordInput(manifest=manifest, features={"tokens": ([None], "float32")},
                      to_static=_pad_to(4))
    # Fixed-length data reads as variable-length too (any number of values).
    write_tfrecords({"tokens": np.zeros((4, 3), np.int64)}, str(tmp_path / "fixed"), 1)
    TFRecordInput(manifest=str(tmp_path / "fixed.manifest.json"),
                  features={"tokens": tf.io.VarLenFeature(tf.int64)}, to_static=_pad_to(4))


@pytest.mark.parametrize("feature", [
    tf.io.VarLenFeature(tf.int64),
    tf.io.RaggedFeature(tf.int64),
    tf.io.FixedLenFeature([None], tf.int64),
    ([None], "int64"),
])
def test_variable_length_spec_forms_are_one_ragged_feature(feature):
    assert parse_feature_spec({"tokens": feature}, var_len=True) == {
        "tokens": tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)}


@pytest.mark.parametrize("feature", [
    ([None, 3], "float32"),
    tf.io.RaggedFeature(tf.int64, partitions=[tf.io.RaggedFeature.UniformRowLength(2)]),
    tf.io.FixedLenSequenceFeature([], tf.int64, allow_missing=True),
])
def test_variable_length_specs_of_more_than_one_dimension_are_refused(feature):
    with pytest.raises(ValueError, match="'tokens'.*one dimension"):
        parse_feature_spec({"tokens": feature}, var_len=True)


def test_a_variable_length_dtype_mismatch_names_the_record(tmp_path):
    from tputrain.data import FeatureSpecError, explain_parse_error
    write_tfrecords({"tokens": [np.float32([1.5]), np.float32([])]}, str(tmp_path / "f"),
                    num_shards=1, manifest=False)
    inputs = TFRecordInput(str(tmp_path / "f-*"), {"tokens": ([None], "int64")},
                           global_batch_size=2, shuffle=False, to_static=_pad_to(4))
    dataset = inputs()
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        next(iter(dataset))
    error = explain_parse_error(caught.value)
    assert isinstance(error, FeatureSpecError)
    assert "record 0 of" in str(error) and "int64 [None]" in str(error)


def test_a_batch_of_packed_rows_may_exceed_the_examples_it_packs(tmp_path):
    """Three long examples make many packed rows: the batch-fits check counts examples."""
    manifest = _write_tokens(tmp_path, [np.arange(1, 41)] * 3, num_shards=1)
    inputs = TFRecordInput(manifest=manifest, global_batch_size=8, shuffle=False, repeat=False,
                           to_static=tputrain.data.PackSequences(8))
    batches = list(inputs())
    assert len(batches) == 1 and batches[0]["tokens"].shape == (8, 8)


def test_a_to_static_that_leaves_lengths_dynamic_is_refused_by_name(tmp_path):
    manifest = _write_tokens(tmp_path, [np.arange(n) for n in (1, 2, 3)], num_shards=1)
    inputs = TFRecordInput(manifest=manifest, global_batch_size=1, to_static=lambda ds: ds)
    with pytest.raises(ValueError) as caught:
        inputs()
    first = str(caught.value).splitlines()[0]
    assert re.search(r"feature 'tokens' has dynamic shape.*static shapes.*PackSequences", first)


def test_iterators_made_earlier_do_not_change_the_shuffled_order(tmp_path):
    """The Trainer probes a dataset with other iterators before training from it (the
    input check, the iterator-size pre-flight). Each epoch's shuffles depend on the
    seed and the epoch only: an iterator that already read 10 epochs of the same
    dataset leaves the next iterator's order what a fresh process sees."""
    pattern = _write(tmp_path, 12, 3)

    def build():
        return TFRecordInput(pattern, FEATURES, shuffle=True, seed=3, shuffle_buffer=8,
                             repeat=True)(InputContext(global_batch_size=4))

    def first_ids(iterator, batches=30):
        return [int(i) for _ in range(batches) for i in next(iterator)["id"].numpy()]
    fresh = first_ids(iter(build()))
    probed = build()
    probe = iter(probed)
    first_ids(probe)  # 10 epochs of 12 examples
    assert first_ids(iter(probed)) == fresh
    assert fresh[:12] != fresh[12:24]  # and each epoch is still shuffled anew


# Empty inputs: one error when the dataset is built, never an endless read.


def _empty_shard(directory, name="empty"):
    directory.mkdir(exist_ok=True)
    (directory / f"{name}-00000-of-00001.tfrecord").write_bytes(b"")
    return str(directory / f"{name}-*")


@pytest.mark.parametrize("settings", [{"shuffle": True}, {"shuffle": False},
                                      {"cache": "memory"}, {"to_static": lambda d: d}],
                         ids=["shuffled", "ordered", "in-memory", "to_static"])
def test_a_pattern_of_only_empty_shards_is_one_error_when_the_dataset_is_built(tmp_path,
                                                                               settings):
    """A seeded shuffle built each epoch from its index and read 2**62 empty epochs."""
    pattern = _empty_shard(tmp_path)
    with pytest.raises(ValueError) as caught:
        TFRecordInput(pattern, FEATURES, **settings)(InputContext(global_batch_size=2))
    message = str(caught.value)
    assert type(caught.value).__name__ == "EmptyInputError" and "\n" not in message
    assert pattern in message and "0-byte" in message and "yields no batch" in message


def test_a_pattern_among_several_that_holds_nothing_is_named(tmp_path):
    good = _write(tmp_path, 8, 2)
    empty = _empty_shard(tmp_path / "other")
    with pytest.raises(ValueError, match=re.escape(repr(empty))):
        TFRecordInput([good, empty], FEATURES)(InputContext(global_batch_size=2))


def test_shards_without_records_and_a_filter_that_drops_everything_are_named(tmp_path):
    (tmp_path / "z").mkdir()
    with tf.io.TFRecordWriter(str(tmp_path / "z" / "gz-00000.tfrecord"), "GZIP"):
        pass  # a GZIP file of no records: not 0 bytes
    with pytest.raises(ValueError, match=r"no records.*yields no batch") as caught:
        TFRecordInput(str(tmp_path / "z" / "gz-*"), FEATURES, compression_type="GZIP",
                      seed=3)(InputContext(global_batch_size=2))
    assert "\n" not in str(caught.value)
    pattern = _write(tmp_path, 8, 2)
    with pytest.raises(ValueError, match=r"to_static.*none of the 8 examples") as caught:
        TFRecordInput(pattern, FEATURES, to_static=lambda d: d.filter(lambda e: e["id"] < 0)
                      )(InputContext(global_batch_size=2))
    assert "\n" not in str(caught.value)


def test_the_cli_refuses_a_shuffled_empty_shard_in_one_line_and_exit_2(tmp_path):
    """It spun at 100% CPU, deaf to SIGTERM (the timeout is a hang guard only)."""
    pattern = _empty_shard(tmp_path)
    stderr = cli_refusal(tmp_path, f"Trainer.task = @RecordsTask()\nRecordsTask.pattern = "
                         f"'{pattern}'\nRecordsTask.shuffle = True\nTrainer.train_steps = 2\n"
                         "Trainer.global_batch_size = 8\nTrainer.eval_steps = 1\n")
    assert pattern in stderr and "0-byte" in stderr


# ------------------------------------------------ options.without_autotune


def test_turning_autotuning_off_on_a_tuned_dataset_says_nothing(caplog):
    """The start-up probes read a copy without autotuning. A pipeline whose options turn
    it on (an InputOptions' `tf_options`) made tf.data log "Changing the value of
    option enabled from True to False" on every run's console."""
    options = tf.data.Options()
    options.autotune.enabled = True
    dataset = tf.data.Dataset.range(4).with_options(options)
    with caplog.at_level(logging.INFO):
        probed = without_autotune(dataset)
    assert probed.options().autotune.enabled is False
    assert dataset.options().autotune.enabled is True
    assert not [r for r in caplog.records if "Changing the value" in r.getMessage()], caplog.records


def test_an_input_options_pipeline_leaves_autotuning_at_tf_datas_default():
    """InputOptions(autotune=True) set the option explicitly, and each probe's copy
    (off) then made tf.data's C++ log "Changing the value of option field enabled from
    true to false", 6 lines on every digits run: on is left unset (tf.data's default)."""
    assert InputOptions().tf_options().autotune.enabled is None
    assert InputOptions(autotune=False).tf_options().autotune.enabled is False
