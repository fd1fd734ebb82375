"""Tests for tputrain/checkpointing/files.py: the room a save needs, as its error says it."""

import re
import shutil

import pytest
import tensorflow as tf

from tputrain.checkpointing import files
from tputrain.checkpointing.run_directory import ModelDirError

UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def shown_bytes(text: str) -> list[float]:
    """The sizes a message shows, in bytes."""
    return [float(number) * UNITS[unit]
            for number, unit in re.findall(r"([\d.]+) (bytes|KiB|MiB)\b", text)]


@pytest.mark.parametrize("free, needed", [
    (100_000, 120_000),  # the tryout's "0.1 MiB free and a checkpoint takes 0.1 MiB"
    (20_000, 41_000),  # "0.0 MiB free and a checkpoint takes 0.0 MiB"
    (40_999, 41_000),  # a byte short
    (300_000, 5_000_000),
    (0, 41_000),
])
def test_the_room_check_shows_free_below_needed(tmp_path, monkeypatch, free, needed):
    (tmp_path / "ckpt-4.index").write_bytes(b"\0" * 1000)
    (tmp_path / "ckpt-4.data-00000-of-00001").write_bytes(b"\0" * (needed - 1000))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))
    with pytest.raises(ModelDirError) as caught:
        files.check_room(str(tmp_path), 8, str(tmp_path / "ckpt-4"))
    message = str(caught.value)
    assert f"the last good checkpoint {tmp_path}/ckpt-4 is intact" in message
    shown_free, shown_needed = shown_bytes(message)
    assert shown_free < shown_needed, message
    assert (shown_free > 0) == (free > 0), message
    assert abs(shown_needed - needed) <= 0.05 * needed, message
    assert abs(shown_free - free) <= 0.05 * needed, message


def test_sizes_read_as_different_as_they_are():
    assert files.readable_sizes(2 << 20, 5 << 20) == ["2.0 MiB", "5.0 MiB"]
    assert files.readable_sizes(100_000, 120_000) == ["97.7 KiB", "117.2 KiB"]
    assert files.readable_sizes(40_999, 41_000) == ["40999 bytes", "41000 bytes"]
    assert files.readable_sizes(41_000, 41_000) == ["40.0 KiB", "40.0 KiB"]
    assert files.readable_sizes(20_000, 5 << 20) == ["0.02 MiB", "5.00 MiB"]


@pytest.mark.parametrize("error, cause", [
    (tf.errors.UnimplementedError(None, None, "GeneratorDataset does not support "
                                  "checkpointing. [Op:SerializeIterator]"), "GeneratorDataset"),
    (tf.errors.FailedPreconditionError(None, None, "RandomUniform is stateful. "
                                       "[Op:SerializeIterator]"), "RandomUniform"),
])
def test_a_save_the_input_refuses_names_the_input_not_the_disk(tmp_path, error, cause):
    """An iterator tf.data will not save fails the save whatever the disk: the error
    names the train input and its ways out, not "free some space"."""
    message = str(files.save_failed(str(tmp_path), 8, str(tmp_path / "ckpt-4"), error))
    assert cause in message and "input" in message and "input_mode='distributed'" in message
    assert "free some space" not in message
    assert f"the last good checkpoint {tmp_path}/ckpt-4 is intact" in message


def test_a_save_that_fails_for_the_disk_says_so(tmp_path):
    message = str(files.save_failed(str(tmp_path), 8, None, OSError(28, "No space left on device")))
    assert "is full" in message and "free some space" in message
