"""Tests for tputrain.data.writer, its Example encoder and the write-tfrecords CLI."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tputrain.data import InputContext, TFRecordInput, read_manifest, write_tfrecords
from tputrain.data.example_codec import encode_example, varint, varints
from tputrain.data.writer import _as_array, choose_num_shards
from tputrain.data.arrays import read_csv, read_input
from faults import FullDiskWriter, child_env


def _reference(example):
    """The same example built with TensorFlow's own protobuf classes."""
    feature = {}
    for key, value in example.items():
        array = _as_array(key, value)
        flat = array.ravel()
        if array.dtype.kind == "f":
            feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=flat.tolist()))
        elif array.dtype.kind in "iub":
            feature[key] = tf.train.Feature(
                int64_list=tf.train.Int64List(value=flat.astype(np.int64).tolist()))
        else:
            values = [v.encode() if isinstance(v, str) else v for v in flat.tolist()]
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature))


# The fast encoder writes what TensorFlow's protobuf classes write.


def test_encoder_matches_tensorflow_for_every_dtype():
    rng = np.random.default_rng(0)
    example = {
        "floats": rng.normal(size=(2, 3)).astype(np.float32),
        "doubles": rng.normal(size=4),  # stored as float32, like tf.train.FloatList
        "ints": np.array([-1, 0, 1, 127, 128, 300, 2**40, -2**63, 2**63 - 1]),
        "bools": np.array([True, False, True]),
        "uint8": np.array([0, 255], np.uint8),
        "bytes": np.array([b"ab", b"", b"\x00\xff"], dtype=object),
        "text": np.array(["h\u00e9llo", "x"]),
        "empty": np.zeros((0,), np.float32),
        "empty_ints": np.zeros((0,), np.int64),
        "scalar": 1.5,
    }
    arrays = {key: _as_array(key, value) for key, value in example.items()}
    ours = tf.train.Example.FromString(encode_example(arrays))
    assert ours == _reference(example)


def test_varints_match_protobuf_for_random_int64():
    values = np.random.default_rng(1).integers(-2**63, 2**63 - 1, size=500, dtype=np.int64)
    values[:5] = [0, 1, 127, 128, -1]
    expected = tf.train.Int64List(value=values.tolist()).SerializeToString()
    # Int64List is field 1, packed: tag, payload length, then the varints themselves.
    assert expected == b"\x0a" + varint(len(varints(values))) + varints(values)


# Choosing the number of shards.


def test_choose_num_shards():
    mb = 2**20
    assert choose_num_shards(1000 * mb, 10**6, num_hosts=1, target_shard_mb=128) == 8
    assert choose_num_shards(1000 * mb, 10**6, num_hosts=3, target_shard_mb=128) == 9
    assert choose_num_shards(1 * mb, 10**6, num_hosts=4, target_shard_mb=128) == 4  # >= hosts
    assert choose_num_shards(10 * mb, 5, num_hosts=2, target_shard_mb=1) == 4  # <= examples
    with pytest.raises(ValueError, match="one shard for each of 4 hosts"):
        choose_num_shards(mb, 3, num_hosts=4)


def test_automatic_shards_are_a_multiple_of_hosts_with_a_manifest(tmp_path):
    ids = np.arange(300)
    examples = {"x": np.repeat(ids[:, None], 100, axis=1).astype(np.float32), "id": ids}
    # ~0.4 KB per example, 120 KB in all: 0.05 MB shards give 3, rounded up to 4 for 2 hosts.
    paths = write_tfrecords(examples, str(tmp_path / "d"), num_hosts=2, target_shard_mb=0.05)
    assert len(paths) == 4
    manifest = read_manifest(str(tmp_path / "d.manifest.json"))
    assert manifest.num_examples == 300 and manifest.files() == paths
    assert [s.num_examples for s in manifest.shards] == [75] * 4
    assert all(s.num_bytes == os.path.getsize(p) for s, p in zip(manifest.shards, paths))
    assert manifest.features["x"] == tf.io.FixedLenFeature([100], tf.float32)
    batches = TFRecordInput(manifest=str(tmp_path / "d.manifest.json"), label_key="id",
                            shuffle=False, repeat=False, cycle_length=1)(
        InputContext(global_batch_size=50))
    assert np.concatenate([label for _, label in batches]).tolist() == list(range(300))


def test_unknown_length_iterable_is_spooled_and_dealt_round_robin(tmp_path):
    def examples():  # a generator: no len()
        for i in range(40):
            yield {"id": i, "x": [float(i)] * 50}

    paths = write_tfrecords(examples(), str(tmp_path / "g"), num_hosts=2, target_shard_mb=0.004)
    assert len(paths) % 2 == 0 and len(paths) > 2
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(p) for p in paths] + ["g.manifest.json"])  # no spool left behind
    first = [int(tf.train.Example.FromString(r.numpy()).features.feature["id"].int64_list.value[0])
             for r in tf.data.TFRecordDataset(paths[1])]
    assert first == list(range(1, 40, len(paths)))


def test_tf_data_dataset_and_sized_iterables(tmp_path):
    dataset = tf.data.Dataset.from_tensor_slices({"id": tf.range(10, dtype=tf.int64),
                                                  "name": tf.constant([b"n%d" % i for i in range(10)])})
    write_tfrecords(dataset, str(tmp_path / "ds"), num_shards=2)
    manifest = read_manifest(str(tmp_path / "ds.manifest.json"))
    assert manifest.features == {"id": tf.io.FixedLenFeature([], tf.int64),
                                 "name": tf.io.FixedLenFeature([], tf.string)}
    batches = list(TFRecordInput(manifest=str(tmp_path / "ds.manifest.json"), shuffle=False,
                                 repeat=False, global_batch_size=10)())
    assert sorted(batches[0]["id"].numpy().tolist()) == list(range(10))
    assert sorted(batches[0]["name"].numpy().tolist()) == sorted(b"n%d" % i for i in range(10))

    write_tfrecords([{"id": i} for i in range(6)], str(tmp_path / "list"))  # len() known
    assert read_manifest(str(tmp_path / "list.manifest.json")).num_examples == 6

    supervised = tf.data.Dataset.from_tensor_slices((tf.range(4), tf.range(4)))
    with pytest.raises(TypeError, match="map it to one dict"):
        write_tfrecords(supervised, str(tmp_path / "sup"), num_shards=1)
    with pytest.raises(ValueError, match="infinite"):
        write_tfrecords(dataset.repeat(), str(tmp_path / "inf"))


def test_parallel_writers_write_identical_gzip_shards(tmp_path):
    examples = {"x": np.random.default_rng(2).normal(size=(2000, 32)).astype(np.float32),
                "id": np.arange(2000)}
    one = write_tfrecords(examples, str(tmp_path / "a"), 4, "GZIP", num_workers=1)
    four = write_tfrecords(examples, str(tmp_path / "b"), 4, "GZIP", num_workers=4)
    for p, q in zip(one, four):
        assert open(p, "rb").read() == open(q, "rb").read()
    # The manifest records the compression, so the reader needs no compression_type.
    dataset = TFRecordInput(manifest=str(tmp_path / "b.manifest.json"), repeat=False,
                            shuffle=False, global_batch_size=500)()
    assert sum(int(b["id"].shape[0]) for b in dataset) == 2000


def test_feature_type_changes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'v' is float in example 1 but int64 in example 0"):
        write_tfrecords([{"v": 1}, {"v": 1.5}], str(tmp_path / "t"), num_shards=1)
    assert os.listdir(tmp_path) == []


# The write-tfrecords CLI.


def test_read_csv_types_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("label,weight,name\n1,0.5,a\n2,1,b\n")
    columns = read_csv(str(path))
    assert columns["label"].dtype == np.int64 and columns["label"].tolist() == [1, 2]
    assert columns["weight"].dtype == np.float32
    assert columns["name"].tolist() == ["a", "b"]
    path.write_text("a,b\n1\n")
    with pytest.raises(ValueError, match="line 2 has 1 fields but the header has 2"):
        read_csv(str(path))


def test_read_csv_keeps_codes_and_names_missing_numbers(tmp_path):
    """`02134` (a ZIP code) was written as the int 2134, and one empty cell turned a
    numeric column into strings without a word: codes with leading zeros stay text,
    and a number column with empty cells is refused, naming the column and line."""
    path = tmp_path / "t.csv"
    path.write_text("zip,price,label\n02134,1.5,0\n10001,2,1\n")
    columns = read_csv(str(path))
    assert columns["zip"].tolist() == ["02134", "10001"]
    assert columns["price"].dtype == np.float32 and columns["label"].dtype == np.int64
    path.write_text("zip,price,label\n02134,1.5,0\n10001,,1\n94105,2.25,1\n")
    with pytest.raises(ValueError, match="column 'price'.* empty .*line 3"):
        read_csv(str(path))


def test_cli_writes_shards_and_manifest_from_npz(tmp_path):
    np.savez(tmp_path / "d.npz", image=np.ones((20, 4, 4), np.float32), label=np.arange(20))
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.data.arrays", f"--input={tmp_path / 'd.npz'}",
         f"--output_prefix={tmp_path / 'out' / 'train'}", "--num_hosts=2",
         "--compression=gzip"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote 20 examples to 2 shard(s)" in result.stdout
    # The fact once (issue 52): not again as write_tfrecords' own progress line.
    assert "20 examples" not in result.stderr, result.stderr
    manifest = json.loads((tmp_path / "out" / "train.manifest.json").read_text())
    assert manifest["compression_type"] == "GZIP"
    assert manifest["features"]["image"] == {"shape": [4, 4], "dtype": "float32"}
    with pytest.raises(ValueError, match="use a .npz or a .csv file"):
        read_input("x.parquet")


# Bytes round-trip exactly: numpy's fixed-width bytes strip trailing NULs.

_AWKWARD_BYTES = [b"abc\x00", b"\x00", b"", b"a\x00b", b"\xff\xfe\x00\x00", b"\x00\x00x\x00"]


def _read_back(prefix):
    manifest = f"{prefix}.manifest.json"
    (batch,) = TFRecordInput(manifest=manifest, shuffle=False, repeat=False,
                             global_batch_size=len(_AWKWARD_BYTES))()
    return batch


def test_bytes_round_trip_exactly_from_a_dict_of_arrays(tmp_path):
    n = len(_AWKWARD_BYTES)
    pixels = [bytes([7, i, 0, 0][: 4 - i % 2]) for i in range(n)]  # raw images ending in 0
    write_tfrecords({"blob": np.array(_AWKWARD_BYTES, dtype=object),
                     "pair": np.array([[b, b"\x00"] for b in _AWKWARD_BYTES], dtype=object),
                     "pixels": pixels,  # a plain list of bytes
                     "id": np.arange(n)}, str(tmp_path / "cols"), num_shards=1)
    batch = _read_back(tmp_path / "cols")
    assert batch["blob"].numpy().tolist() == _AWKWARD_BYTES
    assert batch["pair"].numpy().tolist() == [[b, b"\x00"] for b in _AWKWARD_BYTES]
    assert batch["pixels"].numpy().tolist() == pixels


def test_bytes_round_trip_exactly_from_an_iterable_of_dicts(tmp_path):
    examples = [{"blob": b, "list": [b, b"z\x00"], "id": i}
                for i, b in enumerate(_AWKWARD_BYTES)]
    write_tfrecords(examples, str(tmp_path / "rows"), num_shards=1)
    batch = _read_back(tmp_path / "rows")
    assert batch["blob"].numpy().tolist() == _AWKWARD_BYTES
    assert batch["list"].numpy().tolist() == [[b, b"z\x00"] for b in _AWKWARD_BYTES]

    dataset = tf.data.Dataset.from_tensor_slices({"blob": tf.constant(_AWKWARD_BYTES)})
    write_tfrecords(dataset, str(tmp_path / "ds"), num_shards=1)
    assert _read_back(tmp_path / "ds")["blob"].numpy().tolist() == _AWKWARD_BYTES


def _cli_error(call) -> str:
    """The one-line message `tputrain write-tfrecords` prints (it exits 2 on these types)."""
    with pytest.raises((ValueError, OSError)) as caught:
        call()
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_missing_npz_is_named(tmp_path):
    """Issue 33.6: TensorFlow's NotFoundError traceback (not an OSError: exit 1)."""
    assert "does not exist" in _cli_error(lambda: read_input(str(tmp_path / "none.npz")))


def test_an_empty_npz_is_named(tmp_path):
    """Issue 33.6: numpy's EOFError traceback."""
    (tmp_path / "empty.npz").write_bytes(b"")
    assert "is empty (0 bytes)" in _cli_error(lambda: read_input(str(tmp_path / "empty.npz")))


def test_an_output_prefix_under_a_file_is_one_line_and_exit_2(tmp_path):
    """Issue 33.6: TensorFlow's traceback from the first shard, exit 1."""
    np.savez(tmp_path / "d.npz", label=np.arange(4))
    (tmp_path / "file").write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.cli", "write-tfrecords", f"--input={tmp_path / 'd.npz'}",
         f"--output_prefix={tmp_path / 'file' / 'sub' / 'train'}"], capture_output=True,
        text=True, timeout=120)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last.startswith("tputrain write-tfrecords: error: --output_prefix=")
    assert f"{tmp_path / 'file'} is a file" in last


# Variable-length features.


def _varlen_rows():
    """Token rows of many lengths, empty ones and ones longer than a packing length included."""
    rng = np.random.default_rng(3)
    lengths = [0, 1, 5, 0, 300, 17, 2, 0, 64, 1000]
    return [rng.integers(0, 259, size=n).astype(np.int64) for n in lengths]


def _read_varlen(manifest_path, key):
    """Every record's `key`, parsed with the manifest's spec, in file order."""
    manifest = read_manifest(manifest_path)
    records = tf.data.TFRecordDataset(manifest.files())
    return [tf.io.parse_single_example(r, manifest.features)[key].numpy() for r in records]


def test_variable_length_columns_round_trip_bitwise(tmp_path):
    rows = _varlen_rows()
    floats = [np.random.default_rng(4).normal(size=n).astype(np.float32) for n in (3, 0, 2) * 3]
    floats.append(np.float32([1.5]))
    write_tfrecords({"tokens": rows, "w": floats, "id": np.arange(len(rows))},
                    str(tmp_path / "v"), num_shards=1)
    manifest = read_manifest(str(tmp_path / "v.manifest.json"))
    assert manifest.features["tokens"] == tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)
    assert manifest.features["w"] == tf.io.RaggedFeature(tf.float32, row_splits_dtype=tf.int64)
    assert manifest.features["id"] == tf.io.FixedLenFeature([], tf.int64)
    saved = json.load(open(tmp_path / "v.manifest.json"))
    assert saved["features"]["tokens"] == {"shape": [None], "dtype": "int64"}
    got = _read_varlen(str(tmp_path / "v.manifest.json"), "tokens")
    assert [g.dtype for g in got] == [np.int64] * len(rows)
    assert [g.tolist() for g in got] == [r.tolist() for r in rows]
    got_w = _read_varlen(str(tmp_path / "v.manifest.json"), "w")
    assert all(g.tobytes() == f.tobytes() for g, f in zip(got_w, floats))


def test_variable_length_streams_and_ragged_tensors_round_trip(tmp_path):
    rows = _varlen_rows()
    # A stream needs var_len for the feature; empty Python lists take the feature's dtype.
    stream = [{"tokens": r.tolist(), "id": i} for i, r in enumerate(rows)]
    write_tfrecords(stream, str(tmp_path / "s"), num_shards=2, var_len=["tokens"])
    got = sorted(map(tuple, (g.tolist() for g in _read_varlen(str(tmp_path / "s.manifest.json"),
                                                             "tokens"))))
    assert got == sorted(tuple(r.tolist()) for r in rows)

    ragged = tf.ragged.constant([r.tolist() for r in rows], dtype=tf.int64)
    write_tfrecords({"tokens": ragged}, str(tmp_path / "r"), num_shards=1)
    assert [g.tolist() for g in _read_varlen(str(tmp_path / "r.manifest.json"), "tokens")] == [
        r.tolist() for r in rows]

    dataset = tf.data.Dataset.from_tensor_slices({"tokens": ragged})  # spec [None]: var-len
    write_tfrecords(dataset, str(tmp_path / "d"), num_shards=1)
    assert [g.tolist() for g in _read_varlen(str(tmp_path / "d.manifest.json"), "tokens")] == [
        r.tolist() for r in rows]


def test_variable_length_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"'t' has shape \(3,\) in example 1.*var_len=\['t'\]"):
        write_tfrecords([{"t": [1, 2]}, {"t": [1, 2, 3]}], str(tmp_path / "a"), num_shards=1)
    with pytest.raises(ValueError, match="'t' is float in example 1 but int64"):
        write_tfrecords([{"t": [1, 2]}, {"t": [1.5]}], str(tmp_path / "b"), num_shards=1,
                        var_len=["t"])
    with pytest.raises(ValueError, match="'t'.*one dimension"):
        write_tfrecords({"t": [np.zeros((2, 2)), np.zeros((3, 2))]}, str(tmp_path / "c"),
                        num_shards=1)
    with pytest.raises(ValueError, match="var_len names 'u', which is not a feature"):
        write_tfrecords({"t": [[1], [2, 3]]}, str(tmp_path / "d"), num_shards=1, var_len=["u"])
    assert os.listdir(tmp_path) == []


def test_a_second_write_to_a_prefix_leaves_only_its_own_shards(tmp_path, caplog):
    """100 examples in 4 shards, then 30 in 1 to the same prefix: the 4 old shards stayed
    beside the new one, and the glob the command prints (what a TFRecordInput or predict
    reads) mixed both datasets: 130 examples. The older write's shards are removed once
    the new one is whole, and the log says so; other files are left alone."""
    prefix = str(tmp_path / "data")
    write_tfrecords({"x": np.arange(100, dtype=np.int64)}, prefix, num_shards=4)
    other = tmp_path / "data-notes.txt"
    other.write_text("mine")
    with caplog.at_level("INFO"):
        paths = write_tfrecords({"x": np.arange(30, dtype=np.int64)}, prefix, num_shards=1)
    assert sorted(tf.io.gfile.glob(f"{prefix}-*.tfrecord")) == paths
    assert sum(1 for _ in tf.data.TFRecordDataset(tf.io.gfile.glob(f"{prefix}-*.tfrecord"))) == 30
    assert other.read_text() == "mine" and read_manifest(f"{prefix}.manifest.json").num_examples == 30
    assert any("removed 4 shard(s) of an earlier write" in r.getMessage() for r in caplog.records)


def test_a_write_without_a_manifest_removes_an_earlier_writes_manifest(tmp_path, caplog):
    """600 examples with a manifest, then 900 to the same prefix with manifest=False: the
    first manifest stayed beside the new shard and described it (600 examples), which
    a positional read trusted. The new write leaves no manifest, and says so."""
    prefix = str(tmp_path / "d")
    write_tfrecords({"x": np.arange(600, dtype=np.int64)}, prefix, num_shards=1)
    with caplog.at_level("INFO"):
        write_tfrecords({"x": np.arange(900, dtype=np.int64)}, prefix, num_shards=1,
                        manifest=False)
    assert not os.path.exists(f"{prefix}.manifest.json")
    assert any("removed the manifest of an earlier write" in r.getMessage()
               for r in caplog.records)
    inputs = TFRecordInput(f"{prefix}-*", {"x": ([], "int64")}, seed=0, repeat=False,
                           positional=True)
    read = [int(v) for batch in inputs(InputContext(global_batch_size=100))
            for v in batch["x"].numpy()]
    assert sorted(read) == list(range(900))


# A full disk, and temp files of a killed writer.


def test_a_full_disk_leaves_no_temp_shard_behind(tmp_path, monkeypatch):
    """The close in the clean-up raised again on the full disk (it flushes), so the temp
    shards, which the docstring promises to remove, stayed and kept the disk full."""
    monkeypatch.setattr(tf.io, "TFRecordWriter", FullDiskWriter)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="No space left"):
        write_tfrecords({"x": np.arange(2000, dtype=np.int64)}, str(tmp_path / "d"),
                        num_shards=2)
    assert os.listdir(tmp_path) == []


def test_the_cli_on_a_full_disk_is_one_line_and_exit_2(tmp_path):
    """It was a chained traceback (exit 1)."""
    np.savez(tmp_path / "d.npz", x=np.arange(2000, dtype=np.int64))
    script = ("import sys, tensorflow as tf, faults\n"
              "tf.io.TFRecordWriter = faults.FullDiskWriter\n"
              "from tputrain.cli.write_tfrecords import console_main\n"
              "sys.argv = ['tputrain write-tfrecords'] + sys.argv[1:]\nconsole_main()\n")
    result = subprocess.run(
        [sys.executable, "-c", script, f"--input={tmp_path / 'd.npz'}",
         f"--output_prefix={tmp_path / 'out' / 'train'}", "--num_shards=2"],
        capture_output=True, text=True, timeout=120, env=child_env())
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tputrain write-tfrecords: error: ") and "No space left" in last
    assert "free some space" in last
    assert os.listdir(tmp_path / "out") == []


def test_temp_files_of_a_killed_writer_are_removed_by_the_next_write(tmp_path):
    """A killed writer's temp shards (hidden, named by host and pid) stayed for ever, even
    after a rerun succeeded. A live writer's temps (another process writing the same
    prefix now) are left alone."""
    from tputrain.checkpointing.atomic import temp_path

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    prefix = str(tmp_path / "d")
    shard = f"{prefix}-00000-of-00001.tfrecord"
    killed = temp_path(shard, hidden=True).replace(f"-{os.getpid()}-",
                                                   f"-{int(dead.stdout)}-")
    live = temp_path(shard, hidden=True)
    for path in (killed, live):
        open(path, "wb").write(b"\0" * 64)
    write_tfrecords({"x": np.arange(10, dtype=np.int64)}, prefix, num_shards=1)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["d-00000-of-00001.tfrecord", "d.manifest.json", os.path.basename(live)])


# A rewrite killed while its shards are renamed into place.

_KILLED_AT_THE_THIRD_RENAME = """
import os, sys
import numpy as np
from tputrain.data import writer
real, moved = writer.move, []
def move(*args, **kwargs):
    if len(moved) == 2:
        os._exit(9)
    moved.append(args[1])
    real(*args, **kwargs)
writer.move = move
writer.write_tfrecords({"x": np.arange(3000, 4000, dtype=np.int64)}, sys.argv[1], num_shards=4)
"""


def _read_x(make_input) -> list[int]:
    return sorted(int(v) for batch in make_input()(InputContext(global_batch_size=100))
                  for v in batch["x"].numpy())


def test_a_rewrite_killed_between_shard_renames_is_refused_until_it_is_rerun(tmp_path):
    """Shards renamed one by one over the old ones, then the manifest: a kill between
    two renames left two new shards beside two old ones (the same sizes) and the old
    manifest, read as good by the manifest and by the glob. Now the prefix is marked
    until the manifest is written: both refuse in one line naming the fix, and the
    rerun's data is read (the killed writer's temp shards gone)."""
    prefix = str(tmp_path / "d")
    write_tfrecords({"x": np.arange(1000, 2000, dtype=np.int64)}, prefix, num_shards=4)
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT_THE_THIRD_RENAME, prefix],
                            capture_output=True, text=True, timeout=120, env=child_env())
    assert killed.returncode == 9, killed.stderr[-3000:]
    readers = (lambda: TFRecordInput(manifest=f"{prefix}.manifest.json", repeat=False,
                                     shuffle=False),
               lambda: TFRecordInput(f"{prefix}-*", {"x": ([], "int64")}, repeat=False,
                                     shuffle=False))
    for make_input in readers:
        with pytest.raises(ValueError) as caught:
            _read_x(make_input)
        line = str(caught.value).splitlines()[0]  # (gin adds the configurable below it)
        assert "rerun the write" in line and f"--output_prefix={prefix}" in line, line
    write_tfrecords({"x": np.arange(3000, 4000, dtype=np.int64)}, prefix, num_shards=4)
    for make_input in readers:
        assert _read_x(make_input) == list(range(3000, 4000))
    assert sorted(os.listdir(tmp_path)) == [f"d-0000{i}-of-00004.tfrecord" for i in range(4)] + [
        "d.manifest.json"]
