"""The state of Keras callbacks, saved in every checkpoint by `KerasCallbacks`.

Keras callbacks keep their state in attributes that `on_train_begin` resets
(ReduceLROnPlateau's wait and best, EarlyStopping's best weights...), so a resumed
run would start them over and cut the rate or stop at other epochs than the
uninterrupted run. `KerasCallbacks` saves their state inside each checkpoint (one
object of it, `CheckpointedState`: written and committed with the checkpoint, so
a kill between them cannot mismatch) and sets it back after `on_train_begin`.

What is saved, per callback (matched by position and class on restore):
- a callback with `get_state()` and `set_state(state)` (the opt-in for your own):
  what `get_state()` returns: numbers, strings, None, lists, dicts with string
  keys and NumPy arrays;
- `ReduceLROnPlateau`: wait, cooldown counter, best; `EarlyStopping`: wait, best,
  best epoch, stopped epoch and best weights; `ModelCheckpoint`: best and its
  batch counters (`save_freq=N`);
- `CSVLogger`: its columns and the file's size: a resume cuts the file back to
  that size and appends, so no row is lost or written twice;
- other callbacks: nothing (stateless ones such as `TerminateOnNaN` or
  `LearningRateScheduler` need nothing).

No pickle: the state is JSON plus NumPy arrays read with `allow_pickle=False`, so a
model_dir from elsewhere cannot run code through it.
"""

from __future__ import annotations

import io
import json
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import write_atomically

# Stock callbacks' attributes their state is made of (those their on_train_begin resets).
_STOCK: tuple[tuple[type, tuple[str, ...]], ...] = (
    (keras.callbacks.ReduceLROnPlateau, ("wait", "cooldown_counter", "best")),
    (keras.callbacks.EarlyStopping, ("wait", "best", "best_epoch", "stopped_epoch",
                                     "best_weights")),
    (keras.callbacks.ModelCheckpoint, ("best", "_batches_seen_since_last_saving",
                                       "_last_batch_seen")),
)


class CheckpointedState(tf.train.experimental.PythonState):
    """A checkpoint object whose value is `gather()` at each save (taken on the training
    thread, also by an async save's snapshot); a restore leaves it in `restored`."""

    def __init__(self, gather: Callable[[], Any]):
        self._gather = gather
        self.restored: Any = None

    def serialize(self) -> bytes:
        return encode(self._gather())

    def deserialize(self, string_value: bytes) -> None:
        self.restored = decode(string_value)

    def take(self) -> Any:
        """The restored state, once (None when the checkpoint held none)."""
        restored, self.restored = self.restored, None
        return restored


def _attributes(callback: keras.callbacks.Callback) -> tuple[str, ...] | None:
    for kind, names in _STOCK:
        if isinstance(callback, kind):
            return names
    return None


def opts_in(callback: keras.callbacks.Callback) -> bool:
    return callable(getattr(callback, "get_state", None)) and callable(
        getattr(callback, "set_state", None))


def state_of(callback: keras.callbacks.Callback) -> Any:
    """What is saved of `callback` (None: nothing)."""
    if opts_in(callback):
        return callback.get_state()
    if isinstance(callback, keras.callbacks.CSVLogger):
        size = (tf.io.gfile.stat(callback.filename).length
                if tf.io.gfile.exists(callback.filename) else 0)
        return {"size": int(size), "keys": callback.keys and list(callback.keys)}
    names = _attributes(callback)
    if names is None:
        return None
    return {name: getattr(callback, name) for name in names if hasattr(callback, name)}


def before_train_begin(callback: keras.callbacks.Callback, state: Any) -> Any:
    """A CSVLogger's file cut back to the checkpoint's size (rows written after it are
    written again) and opened for appending by `on_train_begin`; returns what
    `after_train_begin` puts back."""
    if not isinstance(callback, keras.callbacks.CSVLogger) or opts_in(callback) or not state:
        return None
    _cut(callback.filename, int(state["size"]))
    append, callback.append = callback.append, True
    return append


def after_train_begin(callback: keras.callbacks.Callback, state: Any, kept: Any) -> None:
    """Sets `state` back on `callback` once its `on_train_begin` has reset it."""
    if opts_in(callback):
        callback.set_state(state)
    elif isinstance(callback, keras.callbacks.CSVLogger):
        if kept is not None:
            callback.append = kept
        callback.keys = state.get("keys")
    elif _attributes(callback) is not None:
        for name, value in state.items():
            setattr(callback, name, value)


def _cut(path: str, size: int) -> None:
    """Cuts the file at `path` to its first `size` bytes (replaced whole: gs:// too)."""
    if not tf.io.gfile.exists(path):
        return
    with tf.io.gfile.GFile(path, "rb") as f:
        data = f.read()
    if len(data) <= size:
        return
    write_atomically(path, data[:size])
    logging.info("tputrain: %s: rows written after the restored checkpoint removed (they "
                 "are written again)", path)


def encode(state: Any) -> bytes:
    """JSON with the NumPy arrays beside it, in one .npz (no pickle)."""
    arrays: list[np.ndarray] = []

    def pack(value: Any) -> Any:
        if isinstance(value, (np.ndarray, keras.Variable, tf.Tensor, tf.Variable)):
            arrays.append(np.asarray(value))
            return {"__array__": len(arrays) - 1}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, dict):
            return {"__dict__": [[str(k), pack(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [pack(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"a Keras callback's state holds a {type(value).__name__}: get_state() "
                        "may return numbers, strings, None, lists, dicts and NumPy arrays")

    document = json.dumps(pack(state)).encode()
    buffer = io.BytesIO()
    np.savez(buffer, __json__=np.frombuffer(document, np.uint8),
             **{f"a{n}": array for n, array in enumerate(arrays)})
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    with np.load(io.BytesIO(data), allow_pickle=False) as stored:
        arrays = {name: stored[name] for name in stored.files}

    def unpack(value: Any) -> Any:
        if isinstance(value, list):
            return [unpack(v) for v in value]
        if isinstance(value, dict):
            if "__array__" in value:
                return arrays[f"a{value['__array__']}"]
            return {k: unpack(v) for k, v in value["__dict__"]}
        return value

    return unpack(json.loads(arrays.pop("__json__").tobytes()))
