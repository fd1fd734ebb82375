"""`async_save=True`: a snapshot on the training thread, the write on another.

A consistent snapshot of every saved value is taken on the training thread
(eager reads: TensorFlow copies a variable's buffer before the next in-place
update while the snapshot holds it) and written on a background thread while
training continues. The `checkpoint` state file is updated only after the write
completes, so a kill mid-write is as harmless as for a synchronous save;
`sync()` (called by the Trainer on every exit path, and at interpreter exit)
waits for the write, so a normal exit or a preemption never loses it. TF's own
`CheckpointOptions(experimental_enable_async_checkpoint=True)` is not used: on
TF 2.21 its second save fails on Keras 3 variables ("tf.function only supports
singleton tf.Variables created on the first call").
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, Protocol

import tensorflow as tf
from absl import logging

from tputrain.checkpointing.files import first_line, is_disk_full, listed
from tputrain.checkpointing.run_directory import ModelDirError


class AsyncWriter:
    """Writes snapshots of a checkpoint into `directory`, one at a time, keeping `keep`."""

    def __init__(self, directory: str, announce: bool = True):
        self.directory = directory
        self.announce = announce  # log each write's path (not a worker's scratch one)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, checkpoint: tf.train.Checkpoint, step: int, keep: int) -> str:
        """Snapshots now, writes on a thread; returns the path the write will have."""
        self.join()
        checkpoint.save_counter.assign_add(1)  # as CheckpointManager.save does
        snapshot, registered = _snapshot(checkpoint)
        prefix = f"{self.directory.rstrip('/')}/ckpt-{step}"
        self._thread = threading.Thread(target=self._write,
                                        args=(snapshot, registered, prefix, keep),
                                        name="tputrain-checkpoint-writer", daemon=True)
        self._thread.start()
        return prefix

    def _write(self, snapshot, registered, prefix: str, keep: int) -> None:
        """Writer thread: data and index files, then the state file, then old files."""
        try:
            from tensorflow.python.checkpoint import checkpoint_management, functional_saver

            tf.io.gfile.makedirs(self.directory)
            saver = functional_saver.MultiDeviceSaver(snapshot, registered)
            saver.save(tf.constant(prefix))
            paths = [p for p in listed(self.directory) if p != prefix] + [prefix]
            # What CheckpointManager does: an atomic rewrite of the state file.
            checkpoint_management.update_checkpoint_state_internal(
                self.directory, prefix, all_model_checkpoint_paths=paths[-keep:],
                save_relative_paths=True)
            for old in paths[:-keep]:
                for path in tf.io.gfile.glob(f"{old}.*"):
                    tf.io.gfile.remove(path)
            if self.announce:
                logging.info("tputrain: saved checkpoint %s (async)", prefix)
        except BaseException as error:  # noqa: BLE001 - re-raised on the training thread
            self._error = error

    def join(self) -> None:
        """Waits for the write in flight; raises here what failed on the writer thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if is_disk_full(error):
                raise ModelDirError(f"the background checkpoint write failed, the disk is full "
                                    f"({first_line(error)}): free some space and rerun to "
                                    "resume from the last good checkpoint") from error
            raise RuntimeError(f"the background checkpoint write failed: {error}") from error


def _snapshot(checkpoint: tf.train.Checkpoint):
    """What `checkpoint.write` would save, with every value read now (eagerly).

    Uses TF's own serialization of the object graph (the same tensors and keys a
    synchronous save writes); only the reading of variables is moved earlier.
    """
    serialized, _, registered, _ = checkpoint._saver._gather_serialized_tensors(None)
    from tensorflow.python.training.saving import saveable_object
    from tensorflow.python.util import object_identity

    def read(value):
        if isinstance(value, dict):
            return {k: read(v) for k, v in value.items()}
        if isinstance(value, saveable_object.SaveSpec):
            tensor = value.tensor
            tensor = tensor() if callable(tensor) else tensor
            return saveable_object.SaveSpec(tensor=tf.identity(tensor), slice_spec=value.slice_spec,
                                            name=value.name, dtype=value.dtype,
                                            device=value.device)
        if callable(value):
            value = value()
        if hasattr(value, "read_value"):
            value = value.read_value()
        return value

    snapshot = object_identity.ObjectIdentityDictionary()  # variables are unhashable
    for obj, tensors in serialized.items():
        snapshot[obj] = {key: read(value) for key, value in tensors.items()}
    return snapshot, registered


class _Syncable(Protocol):
    def sync(self) -> None: ...


# Checkpointers with async saves: their writes finish before the interpreter exits.
_PENDING: "weakref.WeakSet[Any]" = weakref.WeakSet()


def sync_at_exit(owner: _Syncable) -> None:
    """Calls `owner.sync()` at interpreter exit (while `owner` lives)."""
    _PENDING.add(owner)


@atexit.register
def _sync_all() -> None:
    for checkpointer in list(_PENDING):
        try:
            checkpointer.sync()
        except Exception as error:  # noqa: BLE001 - at exit, report and go on
            logging.error("tputrain: %s", error)
