"""Locating a corrupt record among the files this process's pipelines read."""

import pytest
import tensorflow as tf

from tputrain.data import bad_records
from tputrain.data.bad_records import CorruptRecordError, explain_data_loss


def _records(path, count=10):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for index in range(count):
            writer.write(b"record-%03d" % index)


def test_a_file_of_an_older_pipeline_on_an_unreachable_filesystem_is_passed_over(
        tmp_path, monkeypatch):
    # A process-wide registry: an older pipeline (a test, a notebook cell) read a
    # gs:// shard whose filesystem is now unreachable. The newest pipeline's corrupt
    # file is still named, not the filesystem's error about the old path.
    monkeypatch.setattr(bad_records, "_FILES_READ", {})
    bad = tmp_path / "bad.tfrecord"
    _records(bad)
    data = bytearray(bad.read_bytes())
    data[40] ^= 0xFF
    bad.write_bytes(bytes(data))
    bad_records.register_files(["nosuchscheme://bucket/old-00000.tfrecord"], None)
    bad_records.register_files([str(bad)], None)
    with pytest.raises(tf.errors.DataLossError) as raised:
        list(tf.data.TFRecordDataset(str(bad)))
    error = explain_data_loss(raised.value)
    assert isinstance(error, CorruptRecordError), error
    assert str(bad) in str(error)
