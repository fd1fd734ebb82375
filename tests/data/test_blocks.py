"""Tests for tputrain.data.blocks: every K-th record's byte offset, from the manifest
write_tfrecords writes, or from a one-time header scan cached beside the data."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tputrain.data import read_manifest, write_tfrecords
from tputrain.data.blocks import block_table, scan_offsets
from tputrain.data.manifest import writer_side_file


def _read_at(path: str, offset: int, count: int) -> list[bytes]:
    """`count` records of `path` from byte `offset` (TFRecordDatasetV2, inside flat_map)."""
    def read(off):
        return tf.data.experimental.from_variant(tf.raw_ops.TFRecordDatasetV2(
            filenames=[path], compression_type="", buffer_size=tf.constant(4096, tf.int64),
            byte_offsets=tf.reshape(off, [1])), tf.TensorSpec([], tf.string))
    dataset = tf.data.Dataset.from_tensors(tf.constant(offset, tf.int64)).flat_map(read)
    return list(dataset.take(count).as_numpy_iterator())


def _plain_shard(path: str, records: int) -> list[bytes]:
    """A shard tputrain did not write: records of varied lengths."""
    written = [b"x" * (i % 7) + str(i).encode() for i in range(records)]
    with tf.io.TFRecordWriter(path) as writer:
        for record in written:
            writer.write(record)
    return written


def test_write_tfrecords_records_every_kth_offset_in_the_manifest(tmp_path):
    prefix = str(tmp_path / "train")
    write_tfrecords({"x": np.arange(1000, dtype=np.int64)}, prefix, num_shards=2)
    manifest = read_manifest(prefix + ".manifest.json")
    assert manifest.block_records == 256
    for path, shard in zip(manifest.files(), manifest.shards):
        offsets, count = scan_offsets(path, 256)
        assert shard.block_offsets == tuple(offsets) and count == shard.num_examples
        everything = list(tf.data.TFRecordDataset(path).as_numpy_iterator())
        for block, offset in enumerate(shard.block_offsets):
            assert _read_at(path, offset, 3) == everything[block * 256:block * 256 + 3]


def test_compressed_shards_record_no_offsets_and_read_by_record_index(tmp_path):
    prefix = str(tmp_path / "train")
    write_tfrecords({"x": np.arange(600, dtype=np.int64)}, prefix, num_shards=1,
                    compression_type="GZIP")
    manifest = read_manifest(prefix + ".manifest.json")
    assert manifest.shards[0].block_offsets is None
    blocks = block_table(manifest.files(), [manifest], compression="GZIP")
    assert blocks.offsets.tolist() == [-1, -1, -1]
    assert blocks.first.tolist() == [0, 256, 512] and blocks.counts.tolist() == [256, 256, 88]


def test_a_foreign_shard_is_scanned_once_and_cached_beside_it(tmp_path):
    path = str(tmp_path / "data.tfrecord")
    written = _plain_shard(path, 700)
    blocks = block_table([path], block_records=100)
    assert blocks.counts.tolist() == [100] * 7 and blocks.first.tolist() == list(range(0, 700, 100))
    for offset, first in zip(blocks.offsets, blocks.first):
        assert _read_at(path, int(offset), 2) == written[first:first + 2]
    cache = tmp_path / ".data.tfrecord.blocks-100.json"
    assert cache.exists() and writer_side_file(str(cache))  # a glob of the shards skips it
    # The cache is what the next table reads: a stale size makes it scan again.
    cache_text = cache.read_text()
    assert block_table([path], block_records=100).offsets.tolist() == blocks.offsets.tolist()
    _plain_shard(path, 650)
    again = block_table([path], block_records=100)
    assert again.counts.tolist() == [100] * 6 + [50] and cache.read_text() != cache_text


def test_a_read_only_data_folder_caches_in_cache_dir(tmp_path, monkeypatch):
    from tputrain.data import blocks as blocks_module
    data, model_dir = tmp_path / "data", tmp_path / "model"
    data.mkdir()
    path = str(data / "data.tfrecord")
    _plain_shard(path, 300)
    real_write = blocks_module.write_atomically

    def read_only(target, text, durable=True):  # root ignores chmod: refuse the data folder
        if os.path.dirname(target) == str(data):
            raise PermissionError(f"read-only: {target}")
        return real_write(target, text, durable)
    monkeypatch.setattr(blocks_module, "write_atomically", read_only)
    blocks = block_table([path], block_records=128, cache_dir=str(model_dir))
    assert blocks.counts.tolist() == [128, 128, 44]
    assert [p.name for p in (model_dir / "input_blocks").iterdir()][0].startswith("data.tfrecord.")
    assert not any(p.name.endswith(".json") for p in data.iterdir())


def test_a_truncated_shard_fails_the_scan_naming_it(tmp_path):
    path = str(tmp_path / "data.tfrecord")
    _plain_shard(path, 10)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(tf.errors.DataLossError, match="not a whole TFRecord file"):
        scan_offsets(path, 4)


def test_a_shard_whose_size_differs_from_its_manifest_is_scanned_not_trusted(tmp_path, caplog):
    """A shard rewritten after its manifest (600 records, then 900 by another writer):
    the manifest's counts and offsets would read 600; its size shows it is stale."""
    prefix = str(tmp_path / "d")
    path = write_tfrecords({"x": np.arange(600, dtype=np.int64)}, prefix, num_shards=1)[0]
    manifest = read_manifest(prefix + ".manifest.json")
    written = _plain_shard(path, 900)
    with caplog.at_level("WARNING"):
        blocks = block_table([path], [manifest])
    assert blocks.num_records == 900 and blocks.counts.tolist() == [256, 256, 256, 132]
    for offset, first in zip(blocks.offsets, blocks.first):
        assert _read_at(path, int(offset), 2) == written[first:first + 2]
    assert any("d.manifest.json" in r.getMessage() and "stale" in r.getMessage()
               for r in caplog.records)


def test_a_shard_rewritten_at_the_same_size_is_scanned_again(tmp_path):
    """The same records in reverse order: the size is the same, the offsets are not; a
    cache checked by size alone made a healthy file read as corrupt."""
    path = str(tmp_path / "data.tfrecord")
    written = _plain_shard(path, 700)
    size = os.path.getsize(path)
    block_table([path], block_records=100)  # cached beside it
    with tf.io.TFRecordWriter(path) as writer:
        for record in reversed(written):
            writer.write(record)
    assert os.path.getsize(path) == size
    blocks = block_table([path], block_records=100)
    assert blocks.offsets.tolist() == scan_offsets(path, 100)[0]
    for offset, first in zip(blocks.offsets, blocks.first):
        assert _read_at(path, int(offset), 2) == written[::-1][first:first + 2]
