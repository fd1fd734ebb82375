"""Tests for tputrain.data.text_corpus: the standard library's own source as a byte-level
corpus, written once, split by file, read back exactly."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tputrain.data import (PackSequences, TFRecordInput, read_manifest, stdlib_files,
                           write_text_corpus)
from tputrain.data import text_corpus

FILES = 6


def _decoded(manifest_path):
    """Every record's tokens, as bytes (the EOS id stripped), from a split's manifest."""
    manifest = read_manifest(manifest_path)
    out = []
    for record in tf.data.TFRecordDataset(manifest.files()):
        tokens = tf.io.parse_single_example(record, manifest.features)["tokens"].numpy()
        assert tokens[-1] == text_corpus.EOS_ID and (tokens[:-1] < 256).all()
        out.append(bytes(tokens[:-1].astype(np.uint8).tolist()))
    return out


def test_stdlib_files_are_a_deterministic_spread_of_python_sources():
    files = stdlib_files(FILES)
    assert files == stdlib_files(FILES) and len(files) == FILES
    assert all(path.endswith(".py") and os.path.isfile(path) for path in files)
    assert files == sorted(files)
    assert len({os.path.dirname(p) for p in stdlib_files(40)}) > 3  # not all from one folder
    assert not any(f"{os.sep}test{os.sep}" in p or "site-packages" in p
                   for p in stdlib_files(None))


def test_the_corpus_holds_every_file_exactly_split_by_file(tmp_path):
    corpus = write_text_corpus(str(tmp_path / "corpus"), max_files=FILES, heldout_fraction=0.3)
    train, heldout = _decoded(corpus.train), _decoded(corpus.heldout)
    assert train and heldout
    sources = {open(path, "rb").read() for path in stdlib_files(FILES)}
    assert sorted(train + heldout) == sorted(sources)  # each file once, bytes exact
    assert not set(train) & set(heldout)
    assert corpus.vocab_size == 258 and corpus.num_files == {"train": len(train),
                                                             "heldout": len(heldout)}
    assert corpus.num_bytes["train"] == sum(map(len, train))
    # Only the finished corpus is left: no temp directory beside it.
    assert os.listdir(tmp_path) == ["corpus"]


def test_the_corpus_is_written_once_and_reused(tmp_path, monkeypatch):
    first = write_text_corpus(str(tmp_path / "c"), max_files=FILES)

    def no_write(*args, **kwargs):
        raise AssertionError("the corpus was written again")

    monkeypatch.setattr(text_corpus, "write_tfrecords", no_write)
    assert write_text_corpus(str(tmp_path / "c"), max_files=FILES) == first
    with pytest.raises(ValueError, match="was written with max_files=6.*another directory"):
        write_text_corpus(str(tmp_path / "c"), max_files=FILES + 1)


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return original(*args, **kwargs)

    original = text_corpus.write_tfrecords
    monkeypatch.setattr(text_corpus, "write_tfrecords", fail_second)
    with pytest.raises(OSError, match="disk full"):
        write_text_corpus(str(tmp_path / "c"), max_files=FILES)
    assert os.listdir(tmp_path) == []


def test_the_corpus_packs_through_tfrecord_input(tmp_path):
    corpus = write_text_corpus(str(tmp_path / "c"), max_files=FILES)
    inputs = TFRecordInput(manifest=corpus.train, global_batch_size=2, seed=0,
                           to_static=PackSequences(128))
    batch = next(iter(inputs()))
    assert batch["tokens"].shape == (2, 128) and batch["segment_ids"].shape == (2, 128)
    assert int(tf.reduce_max(batch["tokens"])) < corpus.vocab_size
