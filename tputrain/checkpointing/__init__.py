"""Checkpoints: periodic, keep-N, restore-latest, and what exact resume needs.

A checkpoint holds the model, the optimizer (with its slots), the step, the
host's input iterator (the data position, including shuffle buffers) and the
state of every Keras `SeedGenerator` in the model. Keras does not expose the
seed generators to `tf.train.Checkpoint`, so without tracking them explicitly
dropout masks after a resume differ from an uninterrupted run. Nor does it expose
the weights of layers a subclassed model keeps in a list or dict: those are saved
under a second root (`model_variables.py`), and every reader of the model (resume,
export, the eval side-car, fine-tuning, the precision audit) reads both.

Integrity, in the order things can go wrong:

* A save killed mid-write is never chosen: `CheckpointManager` writes the data
  and index files first and only then (atomically) the `checkpoint` state file
  that lists the checkpoints; restore only considers listed ones.
* A listed checkpoint that cannot be read (truncated, bit rot, a lost data
  file) is skipped with a warning and the previous one is tried. The writer
  then moves the unreadable files into `damaged/` (kept for inspection, never
  restored again) and rewrites the state file, so the next save at that step
  really writes instead of finding the damaged one "already there".
* A damaged `checkpoint` state file (garbage, 0 bytes, not UTF-8) is not read
  as "no checkpoint" (TensorFlow's reader would start over from step 0 and
  rotate the good checkpoints away): the `ckpt-<step>.index` files on disk are
  tried newest first instead, and the writer moves the bad state file aside
  (`checkpoint.damaged`) and writes a new one.
* A missing `checkpoint` state file with `ckpt-<step>` files on disk (deleted, or
  a model_dir copied without it) is a resume, not a fresh start: the files are
  tried newest first, one warning says which was restored, and the writer writes
  a new state file listing them (rotation goes on from there).
  A save killed before its commit with no state file yet (the first one, its
  index cut short or its `_temp` folder left: `files.never_committed`) is no
  checkpoint: not listed, moved into `damaged/` by the writer with a warning.
* A checkpoint written by a *different model* is not "corrupt": restoring
  stops with `CheckpointMismatchError`, naming the mismatched variables, instead
  of silently falling back or loading half of it.
* A checkpoint written under another input layout (replicas, hosts, global
  batch: `tputrain.checkpointing.input_layout`) is not "corrupt" either: its data iterator
  cannot feed this run's batches, so it is left out and `reposition` moves the
  fresh one past the examples consumed (a Checkpointer without `reposition`
  refuses it with `InputLayoutError`). Checkpoints from before layouts were
  recorded restore as before.
* A state with NaN/Inf in any variable is never saved (`NonFiniteStateError`).
* Hyper-parameters the config owns (`config_owned`: the learning-rate
  variables) are set back to the config's values after every restore, with a
  log line when they differ: a rerun with a lower learning rate uses it, and so
  does a script's next `train()` after it set one on a live Trainer.
  Everything else (weights, slots, step, data position, RNG) comes from the
  checkpoint.
* `ckpt-<step>_temp*` folders left by a killed write are removed when the
  writer restores (one process owns model_dir: see `tputrain.fault_tolerance.lock`).

Where each part lives: `manager` (`Checkpointer`: cadence, keep-N, restore),
`files` (the state file and the files on disk), `integrity` (another model's
checkpoint, NaN/Inf), `recovery` (unreadable checkpoints skipped and moved
aside), `layout` (a checkpoint of another input layout), `host_state` (each
host's data position), `config_owned` (hyper-parameters the config decides),
`async_writer` (`async_save=True`) and `seeds` (Keras' seed generators);
`run_directory` (`RunDirectory`: every path of a model_dir, its layout) and `atomic`
(`write_atomically`: every file written whole, the package's only rename).
The public names below are importable from here (and from the old path
`tputrain.checkpoint`), loaded at first use so that the package itself stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module defining it (what `tputrain.checkpoint` exported).
_NAMES = {
    "CheckpointList": "files", "list_checkpoints": "files",
    "CheckpointMismatchError": "integrity", "InputLayoutError": "integrity",
    "NonFiniteStateError": "integrity", "describe_mismatch": "integrity",
    "Checkpointer": "manager", "UNREADABLE_ERRORS": "recovery",
    "first_readable": "recovery", "read_newest": "recovery",
    "seed_generator_states": "seeds",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'tputrain.checkpointing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tputrain.checkpointing.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
