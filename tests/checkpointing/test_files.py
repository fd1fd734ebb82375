"""Tests for tputrain/checkpointing/files.py: the room a save needs, as its error says it,
and what is listed as a checkpoint when there is no state file."""

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


def first_save(directory, step: int = 2) -> str:
    """A real checkpoint at `step` in `directory` (state file written)."""
    root = tf.train.Checkpoint(v=tf.Variable([1.0, 2.0]), step=tf.Variable(step))
    return tf.train.CheckpointManager(root, str(directory), max_to_keep=3).save(
        checkpoint_number=step)


def killed_before_commit(prefix: str, temp: bool, size: int = 0) -> None:
    """As a kill -9 while TF writes the index of the first save leaves it: the data file,
    a short index at its final name, its `_temp` folder, and no state file."""
    directory, name = prefix.rsplit("/", 1)
    tf.io.gfile.remove(f"{directory}/checkpoint")
    with open(f"{prefix}.index", "r+b") as f:
        f.truncate(size)
    if temp:
        tf.io.gfile.makedirs(f"{prefix}_temp")


@pytest.mark.parametrize("temp, size", [(True, 0), (True, 100), (False, 0), (False, 100)])
def test_a_save_never_committed_is_not_listed_without_a_state_file(tmp_path, temp, size):
    """Issue: with no state file, a first save killed while its index was written was
    listed from the disk as a checkpoint, and every rerun failed on it (exit 2)."""
    prefix = first_save(tmp_path, 4)
    killed_before_commit(prefix, temp, size)
    listing = files.list_checkpoints(str(tmp_path))
    assert listing.paths == [] and not listing.missing and listing.uncommitted == [prefix]


def test_an_intact_checkpoint_stays_listed_beside_a_save_never_committed(tmp_path):
    older = first_save(tmp_path, 2)
    prefix = first_save(tmp_path, 4)
    killed_before_commit(prefix, temp=True)
    listing = files.list_checkpoints(str(tmp_path))
    assert listing.paths == [older] and listing.missing and listing.uncommitted == [prefix]


def test_a_damaged_whole_index_without_a_state_file_stays_listed(tmp_path):
    """Damage that is not a write cut short (the index whole, no `_temp`) is still a
    checkpoint that cannot be read: restore falls back past it or names it."""
    prefix = first_save(tmp_path, 4)
    tf.io.gfile.remove(f"{tmp_path}/checkpoint")
    index = bytearray(open(f"{prefix}.index", "rb").read())
    index[10:20] = b"\xff" * 10
    open(f"{prefix}.index", "wb").write(bytes(index))
    listing = files.list_checkpoints(str(tmp_path))
    assert listing.paths == [prefix] and listing.missing and listing.uncommitted == []
