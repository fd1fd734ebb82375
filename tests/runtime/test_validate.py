"""Tests for tputrain/runtime/validate.py's room check (the rest: tests/test_errors.py)."""

import re
import shutil

import pytest
from iterators import autotune_of_iterators

from tputrain.checkpointing.run_directory import ModelDirError
from tputrain.runtime.validate import check_model_dir

UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def test_a_disk_below_a_checkpoint_says_free_and_needed_as_different_as_they_are(
        tmp_path, monkeypatch):
    """The tryout's "has 0.1 MiB free but a checkpoint needs 0.1 MiB": both rounded to
    the same figure. Now free, one checkpoint and all that the run keeps differ as
    they do."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=100_000))
    with pytest.raises(ModelDirError) as caught:
        check_model_dir(str(tmp_path / "model"), checkpoint_bytes=120_000, keep=2)
    message = str(caught.value)
    shown = [float(n) * UNITS[u] for n, u in re.findall(r"([\d.]+) (bytes|KiB|MiB)\b", message)]
    free, one, needed = shown
    assert free < one < needed, message
    assert abs(needed - 3 * 120_000) <= 0.01 * needed and abs(free - 100_000) <= 1000, message
    assert "keep_checkpoints=2 plus the one being written" in message


def test_the_first_batch_probe_reads_without_autotuning_and_leaves_the_users_options(
        monkeypatch):
    # Its throwaway iterator is freed right after one element: with autotuning on, the
    # tuning thread that element starts can find the iterator already cancelled, and
    # TensorFlow logs "Optimization loop failed: CANCELLED" to the user's console
    # (seen under load in tests/test_examples.py), or holds the free for seconds.
    import tensorflow as tf

    from tputrain.runtime.validate import probe_inputs

    dataset = tf.data.Dataset.range(8).map(lambda x: x * 2,
                                           num_parallel_calls=tf.data.AUTOTUNE).batch(2)
    seen = autotune_of_iterators(monkeypatch)
    assert probe_inputs(dataset, "train").numpy().tolist() == [0, 2]
    assert seen == [False]
    assert dataset.options().autotune.enabled is None  # the user's dataset: as it was
    assert [b.numpy().tolist() for b in dataset.take(1)] == [[0, 2]]
