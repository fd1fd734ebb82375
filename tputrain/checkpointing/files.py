"""A checkpoint directory's files: the state file that lists the checkpoints, the
`ckpt-<step>` files on disk, and the room a save needs.

TensorFlow's own reader of the state file turns damage into "no checkpoint"
(a run then starts over at step 0 and rotates the good checkpoints away), so
the listing here is strict and falls back to the files on disk.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import struct
from typing import NamedTuple

import tensorflow as tf
from google.protobuf import text_format
from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

from tputrain.checkpointing.run_directory import ModelDirError

STATE_FILE = "checkpoint"  # TensorFlow's name for the list of checkpoints
INDEX = re.compile(r"^ckpt-(\d+)\.index$")
# The last bytes of every whole index file (TensorFlow's table format, its footer).
_INDEX_END = struct.pack("<Q", 0xDB4775248B80FB57)
_UNITS = ((1 << 20, "MiB"), (1 << 10, "KiB"))


class CheckpointList(NamedTuple):
    """The checkpoints of a directory, oldest first, and why its state file was
    not used (None when it was read, or when there is none yet). `missing`: there
    is no state file but there are checkpoint files (listed from the disk).
    `uncommitted`: with no state file, saves killed before their commit
    (`never_committed`), not listed; the writer moves them aside."""

    paths: list[str]
    damage: str | None
    missing: bool = False
    uncommitted: list[str] = []


def list_checkpoints(directory: str) -> CheckpointList:
    """Reads the `checkpoint` state file strictly; if it is damaged or missing, the
    ckpt files.

    TensorFlow's own reader logs "Checkpoint ignored" for a garbled state file
    and returns None, which makes a run start over at step 0 and rotate the good
    checkpoints away; a 0-byte or non-UTF-8 file raises with no fix named. A
    missing one did the same to a model_dir copied without it.
    """
    path = f"{directory.rstrip('/')}/{STATE_FILE}"
    if not tf.io.gfile.exists(path):
        on_disk = checkpoints_on_disk(directory) if tf.io.gfile.isdir(directory) else []
        uncommitted = [prefix for prefix in on_disk if never_committed(prefix)]
        on_disk = [prefix for prefix in on_disk if prefix not in uncommitted]
        return CheckpointList(on_disk, None, missing=bool(on_disk), uncommitted=uncommitted)
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            state = text_format.Parse(f.read().decode("utf-8"), CheckpointState())
        if not state.model_checkpoint_path:
            raise ValueError("it names no checkpoint")
    except (ValueError, text_format.ParseError, tf.errors.OpError) as error:
        return CheckpointList(checkpoints_on_disk(directory), f"{path}: {first_line(error)}")
    paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
    return CheckpointList([p if "://" in p or os.path.isabs(p) else f"{directory.rstrip('/')}/{p}"
                           for p in paths], None)


def checkpoints_on_disk(directory: str) -> list[str]:
    """`ckpt-<step>` prefixes that have an index file, oldest first."""
    steps = []
    for name in tf.io.gfile.listdir(directory):
        match = INDEX.match(name)
        if match:
            steps.append(int(match.group(1)))
    return [f"{directory.rstrip('/')}/ckpt-{step}" for step in sorted(steps)]


def never_committed(prefix: str) -> bool:
    """A save killed before its commit, which the disk alone shows as a checkpoint (TF
    writes `ckpt-<step>.index` at its final name, then the state file): its `_temp`
    folder is left or its index stops short of the table's footer, and it cannot be
    read. Only asked with no state file: a damaged whole checkpoint is not one."""
    index = f"{prefix}.index"
    if not tf.io.gfile.glob(f"{prefix}_temp*") and _whole(index):
        return False
    try:
        tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError):
        return True
    return not tf.io.gfile.glob(f"{prefix}.data-*")


def _whole(index: str) -> bool:
    """The index file ends with the table's footer (not cut short by a kill)."""
    try:
        size = tf.io.gfile.stat(index).length
        if size < len(_INDEX_END):
            return False
        with tf.io.gfile.GFile(index, "rb") as f:
            f.seek(size - len(_INDEX_END))
            return f.read() == _INDEX_END
    except tf.errors.OpError:
        return False


def listed(directory: str) -> list[str]:
    return list_checkpoints(directory).paths


def step_of(prefix: str) -> int:
    """The step of a `ckpt-<step>` prefix (a path or a name)."""
    return int(prefix.rsplit("-", 1)[-1])


def files_of(prefix: str) -> list[str]:
    """A checkpoint's files: `<prefix>.index`, `<prefix>.data-*` (not `ckpt-10` for `ckpt-1`)."""
    return tf.io.gfile.glob(f"{prefix}.*")


def checkpoint_bytes(prefix: str) -> int:
    return sum(tf.io.gfile.stat(path).length for path in files_of(prefix))


def is_disk_full(error: BaseException) -> bool:
    return (isinstance(error, tf.errors.ResourceExhaustedError)
            or getattr(error, "errno", None) == errno.ENOSPC
            or "no space left" in str(error).lower())


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def readable_sizes(*sizes: int) -> list[str]:
    """`sizes` (bytes) in the unit of the largest (MiB, KiB), with the decimals (1 or 2)
    that keep them as different as they are and a size above 0 above 0, else in bytes:
    "0.1 MiB free and a checkpoint takes 0.1 MiB" read as if there were room."""
    unit, name = next(((u, n) for u, n in _UNITS if max(sizes, default=0) >= u), (1, ""))
    for decimals in (1, 2) if name else ():
        shown = [round(size / unit, decimals) for size in sizes]
        alike = all((a < b) == (x < y) and (a == b) == (x == y) and (a > 0) == (x > 0)
                    for a, x in zip(sizes, shown) for b, y in zip(sizes, shown))
        if alike:
            return [f"{value:.{decimals}f} {name}" for value in shown]
    return [f"{size} bytes" for size in sizes]


def check_room(directory: str, step: int, latest: str | None) -> None:
    """Local disks: refuse a save that cannot fit, judged by the last one's real size,
    before a half-written checkpoint takes the last free bytes."""
    if latest is None or "://" in directory or not os.path.isdir(directory):
        return
    needed = checkpoint_bytes(latest)
    free = shutil.disk_usage(directory).free
    if free < needed:
        shown_free, shown_needed = readable_sizes(free, needed)
        raise ModelDirError(
            f"not saving step {step}: {directory} has {shown_free} free and a "
            f"checkpoint takes {shown_needed}; the last good checkpoint {latest} is "
            "intact: free some space (or lower Trainer.keep_checkpoints) and rerun to resume")


def save_failed(directory: str, step: int, latest: str | None,
                error: BaseException) -> Exception:
    """Removes a partly written checkpoint and says what happened to the last good one."""
    prefix = f"{directory.rstrip('/')}/ckpt-{step}"
    if prefix != latest:
        for path in files_of(prefix) + tf.io.gfile.glob(f"{prefix}_temp*"):
            tf.io.gfile.rmtree(path) if tf.io.gfile.isdir(path) else tf.io.gfile.remove(path)
    what = "is full" if is_disk_full(error) else f"failed ({type(error).__name__})"
    fix = ("the train input's iterator cannot be saved: build the input from tensors or "
           "files, or use Trainer.input_mode='distributed' (docs/input_pipeline.md)"
           if refused_by_input(error) else "free some space or fix the directory")
    return ModelDirError(
        f"saving step {step} to {directory} {what}: {first_line(error)}; the last good "
        f"checkpoint {latest} is intact: {fix}, and rerun to resume")


def refused_by_input(error: BaseException) -> bool:
    """tf.data refused to save the train iterator (a GeneratorDataset, a stateful op the
    start-up checks did not see): no disk or directory fix helps."""
    return (isinstance(error, (tf.errors.UnimplementedError, tf.errors.FailedPreconditionError))
            and "SerializeIterator" in str(error))
