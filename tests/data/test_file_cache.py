"""Tests for tputrain.data.file_cache: an on-disk cache holds the data it is named for."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tputrain.data import InputContext, TFRecordInput, write_tfrecords


def _write(directory, name: str, value: float) -> str:
    """8 examples whose `x` is `value` (so a batch shows what data it came from)."""
    write_tfrecords({"x": np.full((8, 1), value, np.float32), "y": np.zeros(8, np.int64)},
                    str(directory / name), num_shards=1)
    return str(directory / f"{name}.manifest.json")


def _read(manifest: str, cache: str) -> list[float]:
    """One pass, in file order, through a file cache at `cache`."""
    inputs = TFRecordInput(manifest=manifest, label_key="y", shuffle=False, repeat=False,
                           cache=cache)
    return [float(v) for features, _ in inputs(InputContext(global_batch_size=4))
            for v in features["x"].numpy().ravel()]


def test_a_rewritten_source_is_read_again_not_served_from_the_old_cache(tmp_path):
    cache = str(tmp_path / "cache")
    assert _read(_write(tmp_path, "train", 1.0), cache) == [1.0] * 8
    assert _read(_write(tmp_path, "train", 2.0), cache) == [2.0] * 8


def test_train_and_eval_inputs_with_one_cache_prefix_each_read_their_own_data(tmp_path):
    cache = str(tmp_path / "cache")
    train, evaluation = _write(tmp_path, "train", 1.0), _write(tmp_path, "eval", 9.0)
    assert _read(train, cache) == [1.0] * 8
    assert _read(evaluation, cache) == [9.0] * 8
    assert _read(train, cache) == [1.0] * 8


def test_an_unchanged_source_reads_the_cache_it_wrote(tmp_path):
    """What a resumed run needs: the same data and options name the same cache file."""
    manifest, cache = _write(tmp_path, "train", 1.0), str(tmp_path / "cached" / "c")
    os.makedirs(tmp_path / "cached")
    assert _read(manifest, cache) == [1.0] * 8
    written = sorted(os.listdir(tmp_path / "cached"))
    assert any(name.endswith(".index") for name in written), written
    assert _read(manifest, cache) == [1.0] * 8
    assert sorted(os.listdir(tmp_path / "cached")) == written  # no second cache


def test_a_cache_folder_that_does_not_exist_is_made(tmp_path):
    manifest = _write(tmp_path, "train", 1.0)
    assert _read(manifest, str(tmp_path / "new" / "folder" / "c")) == [1.0] * 8
    assert any(name.endswith(".index") for name in os.listdir(tmp_path / "new" / "folder"))


def test_a_cache_folder_that_cannot_be_made_is_named_in_one_line(tmp_path):
    manifest = _write(tmp_path, "train", 1.0)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"cannot make the cache folder '.*a_file/sub'.*"
                                         "writable path prefix") as raised:
        _read(manifest, str(tmp_path / "a_file" / "sub" / "c"))
    assert "\n" not in str(raised.value)
