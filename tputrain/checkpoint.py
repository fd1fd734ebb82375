"""Checkpoints: periodic, keep-N, restore-latest, and what exact resume needs.

A checkpoint holds the model, the optimizer (with its slots), the step, the
host's input iterator (the data position, including shuffle buffers) and the
state of every Keras `SeedGenerator` in the model. Keras does not expose the
seed generators to `tf.train.Checkpoint`, so without tracking them explicitly
dropout masks after a resume differ from an uninterrupted run.

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
* A checkpoint written by a *different model* is not "corrupt": restoring
  stops with `CheckpointMismatchError`, naming the mismatched variables, instead
  of silently falling back or loading half of it.
* A checkpoint written under another input layout (replicas, hosts, global
  batch: `tputrain.input_layout`) is not "corrupt" either: its data iterator
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
  writer restores (one process owns model_dir: see `tputrain.lock`).

`async_save=True` takes a consistent snapshot of every saved value on the
training thread (eager reads: TensorFlow copies a variable's buffer before the
next in-place update while the snapshot holds it) and writes it on a background
thread while training continues. The `checkpoint` state file is updated only
after the write completes, so a kill mid-write is as harmless as above; `sync()`
(called by the Trainer on every exit path, and at interpreter exit) waits for
the write, so a normal exit or a preemption never loses it. TF's own
`CheckpointOptions(experimental_enable_async_checkpoint=True)` is not used: on
TF 2.21 its second save fails on Keras 3 variables ("tf.function only supports
singleton tf.Variables created on the first call").
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import threading
import time
import weakref
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from google.protobuf import text_format
from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

from tputrain.input_layout import KEY as LAYOUT_KEY
from tputrain.input_layout import InputLayout, LayoutChange, saved_layout
from tputrain.validate import ModelDirError

# Keys every TF2 checkpoint has besides the objects it saves (the input layout:
# older checkpoints lack it, and it describes the run, it is not restored).
_BOOKKEEPING_KEYS = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/", f"{LAYOUT_KEY}/")
_VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_SHOW = 6  # mismatches listed in an error message
_STATE_FILE = "checkpoint"  # TensorFlow's name for the list of checkpoints
_DAMAGED_DIR = "damaged"  # unreadable checkpoints are moved here, never deleted
_INDEX = re.compile(r"^ckpt-(\d+)\.index$")
_MIB = 1 << 20
_ITERATOR_FAILURE = "Failed to restore dataset iterator"  # TF's words


class CheckpointMismatchError(ValueError):
    """The checkpoint in model_dir was written by a different model or pipeline."""


class InputLayoutError(CheckpointMismatchError):
    """The checkpoint's data position has no equivalent under this run's input layout."""


class NonFiniteStateError(FloatingPointError):
    """Refusing to checkpoint variables that hold NaN or Inf."""


def seed_generator_states(model: keras.Model) -> list[tf.Variable]:
    """Returns the state variables of every `SeedGenerator` in `model`'s layers."""
    states, seen = [], set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for generator in getattr(layer, "_seed_generators", []):
            state = generator.state
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states


def _is_variable(obj: Any) -> bool:
    return isinstance(obj, (tf.Variable, keras.Variable))


def _expected_entries(checkpoint: tf.train.Checkpoint) -> dict[str, tuple[Any, str]] | None:
    """{checkpoint key: (shape or None, readable name)} of what `checkpoint` saves.

    Variables get their exact key; other saveables (the data iterator) a key
    prefix ending in "/.ATTRIBUTES/". Uses TF's object-graph traversal (the one
    `save` uses); returns None if that private API changes, which only loses the
    friendly mismatch message.
    """
    try:
        from tensorflow.python.checkpoint import graph_view
        from tensorflow.python.trackable import base as trackable_base

        objects, paths = graph_view.ObjectGraphView(checkpoint).breadth_first_traversal()
    except Exception as error:  # noqa: BLE001 - a private API; degrade gracefully
        logging.debug("tputrain: cannot list checkpoint keys (%s)", error)
        return None
    entries: dict[str, tuple[Any, str]] = {}
    for obj in objects:
        path = "/".join(ref.name for ref in paths[obj])
        if not path:
            continue
        if _is_variable(obj):
            name = getattr(obj, "path", None) or getattr(obj, "name", path)
            entries[path + _VARIABLE_SUFFIX] = (tuple(obj.shape), str(name).removesuffix(":0"))
        elif (type(obj)._serialize_to_tensors
              is not trackable_base.Trackable._serialize_to_tensors):
            entries[path + "/.ATTRIBUTES/"] = (None, path)
    return entries


def describe_mismatch(checkpoint: tf.train.Checkpoint, path: str,
                      ignore: tuple[str, ...] = ()) -> str:
    """'' if `path` holds what `checkpoint` saves, else the differences in words
    (keys starting with `ignore`, data state left out on a layout change, aside)."""
    expected = _expected_entries(checkpoint)
    if expected is None:
        return ""
    # save_counter exists once this object has saved: bookkeeping, not state to match.
    skip = _BOOKKEEPING_KEYS + ignore
    expected = {k: v for k, v in expected.items() if not k.startswith(skip)}
    shapes = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    saved = {k: tuple(v) for k, v in shapes.items() if not k.startswith(skip)}
    problems, matched = [], set()
    for key, (shape, name) in expected.items():
        if shape is None:  # a non-variable saveable: any key under its prefix
            hits = [k for k in saved if k.startswith(key)]
            matched.update(hits)
            if not hits:
                problems.append(f"{name} is not in the checkpoint")
            continue
        if key not in saved:
            problems.append(f"{name} {list(shape)} is not in the checkpoint")
            continue
        matched.add(key)
        if saved[key] != shape:
            problems.append(f"{name}: checkpoint has shape {list(saved[key])}, "
                            f"this model {list(shape)}")
    extra = [k for k in saved if k not in matched]
    problems += [f"{k.removesuffix(_VARIABLE_SUFFIX)} {list(saved[k])} is in the checkpoint "
                 "but not in this model" for k in extra]
    if not problems:
        return ""
    more = f" (and {len(problems) - _SHOW} more)" if len(problems) > _SHOW else ""
    return "; ".join(problems[:_SHOW]) + more


def _float_variables(trackables: Iterable[Any]) -> list[Any]:
    """The floating-point variables of the saved objects (for the finite check)."""
    found, seen = [], set()

    def add(variable):
        if id(variable) not in seen and variable.dtype in (tf.float16, tf.bfloat16,
                                                           tf.float32, tf.float64):
            seen.add(id(variable))
            found.append(variable)

    for obj in trackables:
        if _is_variable(obj):
            add(obj)
        elif isinstance(obj, (list, tuple)):
            found_inner = _float_variables(obj)
            for variable in found_inner:
                add(variable)
        elif hasattr(obj, "variables") and not callable(obj.variables):
            for variable in obj.variables:
                if _is_variable(variable):
                    add(variable)
    return found


def _every_value_finite(variables: list[Any]) -> tf.Tensor:
    """Whether every value of every variable is finite, element by element.

    Not the guard's checks (`tputrain.guard`), whose float32 sums (of squares)
    overflow for large finite weights (or one float64 weight above 3.4e38),
    which for a gradient is as bad, but here would refuse to save a good state.
    """
    if not variables:
        return tf.constant(True)
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v)))
                          for v in variables])


class Checkpointer:
    """Saves every `every` steps into `directory`, keeps `keep`, restores the latest.

    Args:
      directory: where checkpoints go (any `tf.io.gfile` path: local, gs://, ram://).
      step: the int64 step variable; names the checkpoints (`ckpt-<step>`).
      every: save when the step is a multiple of this.
      keep: how many checkpoints to keep.
      check_finite: refuse to save a state with NaN/Inf in a float variable.
      restore_directory: where to restore from, if not `directory`: multi-worker
        runs restore every worker from the chief's checkpoints, while non-chief
        workers write theirs to a scratch directory.
      async_save: write checkpoints on a background thread (see the module
        docstring); `sync()` waits for the write in flight.
      config_owned: variables whose value the config decides, not the checkpoint
        (the optimizer's learning rate): the values they hold when a restore begins
        (the config's, or what a script set on a live Trainer since) are put back
        after it, logged where the checkpoint held another value.
      per_host: state that differs between hosts (each host's data iterator). On
        one host it is saved with the rest; on several, each host writes its own to
        `<restore_directory>/hosts/host-<i>-of-<n>/ckpt-<step>` before the chief
        commits the step (after `barrier`), and restores its own.
      host: `(index, count)` of this host.
      barrier: on several hosts, returns once every host has called it.
      input_layout: how a step's batch is split (`tputrain.input_layout`); saved with
        every checkpoint, so that `per_host` state saved under another layout is
        recognised instead of failing to restore (or restoring batches of the old shape).
      reposition: called with the `LayoutChange` when the checkpoint's layout differs
        from `input_layout`: the `per_host` state is then not restored, and this moves
        the fresh one past the examples consumed (`LayoutChange.resume_steps`). None:
        such a checkpoint is refused.
      **trackables: what every host has the same of (model, optimizer, seeds...).
    """

    def __init__(self, directory: str, step: tf.Variable, every: int, keep: int = 3,
                 check_finite: bool = True, restore_directory: str | None = None,
                 async_save: bool = False, config_owned: Sequence[Any] = (),
                 per_host: dict[str, Any] | None = None, host: tuple[int, int] = (0, 1),
                 barrier: Callable[[], Any] | None = None,
                 input_layout: InputLayout | None = None,
                 reposition: Callable[[LayoutChange], None] | None = None, **trackables: Any):
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {every}")
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        self.directory = directory
        self.restore_directory = restore_directory or directory
        self.every = every
        self.step = step
        self.check_finite = check_finite
        self._hosts = _HostState(self.restore_directory, per_host or {}, host, barrier)
        if not self._hosts.apart:
            trackables = {**trackables, **(per_host or {})}
        self._trackables = dict(trackables)
        self._data_names = frozenset(per_host or {})
        self.input_layout, self._reposition = input_layout, reposition
        self._layout = {LAYOUT_KEY: input_layout.variable()} if input_layout else {}
        self.checkpoint = tf.train.Checkpoint(step=step, **trackables, **self._layout)
        self._manager: tf.train.CheckpointManager | None = None
        self._saved_step: int | None = None  # the step last saved or restored here
        self.keep = keep
        self._config_owned = list(config_owned)
        self._config_values: list[tuple[Any, tf.Tensor]] = []
        self.async_save = async_save
        self._float_vars = _float_variables(trackables.values())
        self._finite_fn = tf.function(lambda: _every_value_finite(self._float_vars))
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        if async_save:
            _PENDING.add(self)

    @property
    def manager(self) -> tf.train.CheckpointManager:
        """TF's keep-N manager, made on first use: it reads the state file when made,
        so it must come after `restore_latest` has repaired a damaged one."""
        if self._manager is None:
            self._manager = tf.train.CheckpointManager(
                self.checkpoint, self.directory, max_to_keep=self.keep, step_counter=self.step)
        return self._manager

    @property
    def latest(self) -> str | None:
        """The newest listed checkpoint written by this Checkpointer's directory."""
        listed = _listed(self.directory)
        return listed[-1] if listed else None

    @property
    def checkpoints(self) -> list[str]:
        """Listed checkpoints in `directory`, oldest first."""
        return _listed(self.directory)

    def _candidates(self) -> list[str]:
        """Listed checkpoints, newest first (re-read: another process may have saved)."""
        return list(reversed([p for p in _listed(self.restore_directory) if p]))

    def check_compatible(self) -> None:
        """Raises `CheckpointMismatchError` if the latest checkpoint is another model's.

        Reads only the checkpoint's index (names and shapes), so the Trainer can
        call it before anything is written to model_dir.
        """
        for path in self._candidates():
            try:
                reader = tf.train.load_checkpoint(path)
                saved = saved_layout(reader)
                ignore = self._data_keys(saved is not None and self.input_layout is not None
                                         and saved.split() != self.input_layout.split())
                problems = describe_mismatch(self.checkpoint, path, ignore)
            except (tf.errors.OpError, ValueError, IndexError):
                continue  # unreadable: restore_latest falls back past it
            if problems:
                raise CheckpointMismatchError(self._mismatch_message(path, problems))
            return

    def _mismatch_message(self, path: str, problems: str) -> str:
        return (f"checkpoint {path} was written by a different model or input pipeline: "
                f"{problems}. Use a new model_dir for a new model, or restore the config "
                "that wrote it")

    def restore_latest(self) -> str | None:
        """Restores the newest readable checkpoint; returns its path or None.

        Unreadable checkpoints are skipped (with a warning) in favour of older
        ones; a checkpoint of a different model raises `CheckpointMismatchError`,
        one whose data position this input layout cannot take `InputLayoutError`.
        """
        candidates = self._candidates()
        self._keep_config_values()
        path, change, failures = first_readable(candidates, self._restore, "restored")
        if path is None:
            if not candidates:
                self._after_restore(None, [])
            if failures:
                raise RuntimeError(_unreadable_message(self.restore_directory, failures))
            return None
        if change is None:
            self._hosts.restore(int(self.step.numpy()))
        else:
            self._reposition(change)  # the fresh data state, moved to the step
        self._saved_step = int(self.step.numpy())  # this step is on disk already
        logging.info("tputrain: restored %s (step %d)", path, int(self.step.numpy()))
        self._after_restore(path, [failed for failed, _ in failures])
        return path

    def _restore(self, path: str) -> LayoutChange | None:
        """Restores `path`, leaving out the data state when its layout differs (returned).

        Raises `CheckpointMismatchError` for another model's checkpoint (or a layout
        with no matching data position), OpError/ValueError for an unreadable one.
        """
        reader = tf.train.load_checkpoint(path)
        saved = saved_layout(reader)
        change = self._layout_change(path, reader, saved)
        problems = describe_mismatch(self.checkpoint, path, self._data_keys(change is not None))
        if problems:
            raise CheckpointMismatchError(self._mismatch_message(path, problems))
        left_out = set(self._data_names) if change else set()
        if saved is None or not self._layout:
            left_out.add(LAYOUT_KEY)  # not in both: restored by neither
        try:
            if not left_out:
                self.checkpoint.restore(path).assert_consumed()
            else:
                root = tf.train.Checkpoint(**{name: obj for name, obj in self._saveables().items()
                                              if name not in left_out})
                status = root.restore(path)
                if change is not None or saved is not None:  # some of it deliberately unread
                    status.expect_partial().assert_existing_objects_matched()
                else:
                    status.assert_consumed()
        except AssertionError as error:  # structure differs in a way we did not list
            raise CheckpointMismatchError(
                self._mismatch_message(path, str(error).splitlines()[0])) from error
        finally:
            if self.input_layout is not None:  # the layout saved next is this run's
                self._layout[LAYOUT_KEY].assign(self.input_layout.to_json())
        if change is not None:  # and its data starts where the checkpoint's stopped
            self._layout[LAYOUT_KEY].assign(change.continued().to_json())
            if not self._data_names:
                _check_distributed_position(change)
                return None
        elif saved is not None and self.input_layout is not None:
            self._layout[LAYOUT_KEY].assign(saved.to_json())  # its start carried on
        return change

    def _data_keys(self, left_out: bool) -> tuple[str, ...]:
        """Checkpoint key prefixes of the data state, when a layout change leaves it out
        (a host count change also moves it in or out of the main checkpoint)."""
        return tuple(f"{name}/" for name in sorted(self._data_names)) if left_out else ()

    @property
    def recorded_layout(self) -> InputLayout | None:
        """This run's layout and where its data started: what the next save records
        (after a restore, `input_steps(step)` is the input's position)."""
        if not self._layout:
            return None
        return InputLayout.from_json(self._layout[LAYOUT_KEY].numpy())

    def _saveables(self) -> dict[str, Any]:
        """What `self.checkpoint` saves, by name (save_counter aside)."""
        return {"step": self.step, **self._trackables, **self._layout}

    def _layout_change(self, path: str, reader: Any,
                       saved: InputLayout | None) -> LayoutChange | None:
        """The change of input layout, if any: the data state (if saved) is then left
        out, and `reposition` reads the fresh input past the examples consumed; raises
        `InputLayoutError` if there is data state and no `reposition` to do that."""
        if (saved is None or self.input_layout is None
                or saved.split() == self.input_layout.split()):
            return None  # nothing to compare, or the saved iterator fits
        step = int(reader.get_tensor("step" + _VARIABLE_SUFFIX))
        change = LayoutChange(path, step, saved, self.input_layout.split())
        if self._data_names and self._reposition is None:
            raise InputLayoutError(_layout_refusal(
                change, "this run cannot move its data position to the examples consumed"))
        return change

    # ------------------------------------------------------ after a restore

    def _after_restore(self, restored: str | None, failed: list[str]) -> None:
        """The config's hyper-parameters back; as the writer, the directory tidied:
        unreadable checkpoints and a damaged state file moved to `damaged/`, the state
        file rewritten, and temp folders of killed writes removed."""
        self._apply_config_values()
        if self.restore_directory != self.directory:
            return  # a non-chief worker reads the chief's directory, never tidies it
        state = list_checkpoints(self.directory)
        if state.damage:
            logging.warning("tputrain: the checkpoint state file is damaged (%s); used the "
                            "checkpoint files on disk instead", state.damage)
        if state.missing and restored is not None:
            logging.warning("tputrain: %s has no checkpoint state file (`%s`): resumed from "
                            "the newest intact checkpoint file %s and wrote a new state file "
                            "listing %d", self.directory, _STATE_FILE, restored,
                            len(state.paths) - len(failed))
        if failed or state.damage or state.missing:
            if failed or state.damage:
                self._quarantine(failed, state_file=state.damage is not None)
            kept = [p for p in state.paths if p not in failed and tf.io.gfile.exists(f"{p}.index")]
            if restored is not None:
                from tensorflow.python.checkpoint import checkpoint_management

                # Timestamps after last_preserved: TF's manager then rotates these too.
                stamps = [time.time() - len(kept) + i for i in range(len(kept))]
                checkpoint_management.update_checkpoint_state_internal(
                    self.directory, restored, all_model_checkpoint_paths=kept,
                    all_model_checkpoint_timestamps=stamps,
                    last_preserved_timestamp=min(stamps, default=time.time()) - 1,
                    save_relative_paths=True)
            self._manager = None  # it read the old state file
        for leftover in tf.io.gfile.glob(f"{self.directory.rstrip('/')}/ckpt-*_temp*"):
            logging.info("tputrain: removing %s, left by a killed checkpoint write", leftover)
            tf.io.gfile.rmtree(leftover) if tf.io.gfile.isdir(leftover) else tf.io.gfile.remove(leftover)

    def _quarantine(self, failed: list[str], state_file: bool) -> None:
        """Moves damaged files into `directory/damaged/` (kept for a post-mortem)."""
        target = f"{self.directory.rstrip('/')}/{_DAMAGED_DIR}"
        tf.io.gfile.makedirs(target)
        sources = [f for prefix in failed for f in _files_of(prefix)]
        if state_file:
            sources.append(f"{self.directory.rstrip('/')}/{_STATE_FILE}")
        for source in sources:
            destination = f"{target}/{source.rsplit('/', 1)[-1]}"
            tf.io.gfile.rename(source, destination, overwrite=True)
            logging.warning("tputrain: moved damaged %s to %s", source, destination)

    def _keep_config_values(self) -> None:
        """Before a restore: the config-owned values as they are now, not as they were
        when the Checkpointer was made (a script may have lowered the learning rate on
        a live Trainer between two `train()` calls)."""
        self._config_values = [(v, tf.identity(v)) for v in self._config_owned]

    def _apply_config_values(self) -> None:
        """Puts the config's hyper-parameters back over what a checkpoint held."""
        for variable, value in self._config_values:
            restored = variable.numpy()
            if not np.array_equal(restored, value.numpy()):
                logging.warning("tputrain: %s is %s in the config and %s in the checkpoint: "
                                "using the config's", getattr(variable, "path", variable.name),
                                value.numpy(), restored)
                variable.assign(value)

    def restore_weights(self, exclude: Iterable[str] = ("iterator", "step")) -> str | None:
        """Restores the latest checkpoint except `exclude` (used to roll back).

        Returns its path, or None if there is no checkpoint yet.
        """
        path = self._candidates()[0] if self._candidates() else None
        if path is None:
            return None
        exclude = set(exclude)
        self._keep_config_values()
        partial = tf.train.Checkpoint(
            **{name: obj for name, obj in {"step": self.step, **self._trackables}.items()
               if name not in exclude})
        partial.restore(path).expect_partial().assert_existing_objects_matched()
        self._apply_config_values()
        return path

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def all_finite(self) -> bool:
        """Whether every float variable that would be saved is finite."""
        return bool(self._finite_fn())

    def save(self) -> str:
        """Saves at the current step unless a checkpoint for it already exists.

        Raises `NonFiniteStateError` instead of saving NaN/Inf weights.
        """
        with self._lock:
            if self.async_save:
                self._join_writer()  # the write in flight may be this very step
            step = int(self.step.numpy())
            latest = self.latest
            # Decided in memory, not from the files: on several hosts the chief may
            # still be writing, and all or none of them must reach the barrier below.
            if step == self._saved_step:
                return latest or f"{self.restore_directory.rstrip('/')}/ckpt-{step}"
            if self.check_finite and not self.all_finite():
                bad = [getattr(v, "path", v.name) for v in self._float_vars
                       if not np.all(np.isfinite(np.asarray(v)))]
                raise NonFiniteStateError(
                    f"not saving step {step}: NaN/Inf in {', '.join(map(str, bad[:_SHOW]))}. "
                    f"The last good checkpoint is {latest}; lower the learning rate or "
                    "enable the non-finite guard (NonFiniteGuard.policy)")
            logging.info("tputrain: saving checkpoint at step %d", step)
            self._check_room(step, latest)
            self._hosts.save(step, self.keep)  # every host's own state before the commit
            if self.async_save:
                self._saved_step = step
                return self._save_async(step)
            try:
                path = self.manager.save(checkpoint_number=step)
            except (tf.errors.OpError, OSError) as error:
                raise self._save_failed(step, latest, error) from None
            self._saved_step = step
            logging.info("tputrain: saved checkpoint %s", path)
            return path

    def _check_room(self, step: int, latest: str | None) -> None:
        """Local disks: refuse a save that cannot fit, judged by the last one's real size,
        before a half-written checkpoint takes the last free bytes."""
        if latest is None or "://" in self.directory or not os.path.isdir(self.directory):
            return
        needed = _checkpoint_bytes(latest)
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise ModelDirError(
                f"not saving step {step}: {self.directory} has {free / _MIB:.1f} MiB free and a "
                f"checkpoint takes {needed / _MIB:.1f} MiB; the last good checkpoint {latest} is "
                "intact: free some space (or lower Trainer.keep_checkpoints) and rerun to resume")

    def _save_failed(self, step: int, latest: str | None, error: BaseException) -> Exception:
        """Removes a partly written checkpoint and says what happened to the last good one."""
        prefix = f"{self.directory.rstrip('/')}/ckpt-{step}"
        if prefix != latest:
            for path in _files_of(prefix) + tf.io.gfile.glob(f"{prefix}_temp*"):
                tf.io.gfile.rmtree(path) if tf.io.gfile.isdir(path) else tf.io.gfile.remove(path)
        what = "is full" if _is_disk_full(error) else f"failed ({type(error).__name__})"
        return ModelDirError(
            f"saving step {step} to {self.directory} {what}: {_first_line(error)}; the last good "
            f"checkpoint {latest} is intact: free some space or fix the directory, and rerun to "
            "resume")

    # ------------------------------------------------------------ async save

    def _save_async(self, step: int) -> str:
        """Snapshots now, writes on a thread; returns the path the write will have."""
        self._join_writer()
        self.checkpoint.save_counter.assign_add(1)  # as CheckpointManager.save does
        snapshot, registered = _snapshot(self.checkpoint)
        prefix = f"{self.directory.rstrip('/')}/ckpt-{step}"
        self._writer = threading.Thread(target=self._write, args=(snapshot, registered, prefix),
                                        name="tputrain-checkpoint-writer", daemon=True)
        self._writer.start()
        return prefix

    def _write(self, snapshot, registered, prefix: str) -> None:
        """Writer thread: data and index files, then the state file, then old files."""
        try:
            from tensorflow.python.checkpoint import checkpoint_management, functional_saver

            tf.io.gfile.makedirs(self.directory)
            saver = functional_saver.MultiDeviceSaver(snapshot, registered)
            saver.save(tf.constant(prefix))
            listed = [p for p in _listed(self.directory) if p != prefix] + [prefix]
            # What CheckpointManager does: an atomic rewrite of the state file.
            checkpoint_management.update_checkpoint_state_internal(
                self.directory, prefix, all_model_checkpoint_paths=listed[-self.keep:],
                save_relative_paths=True)
            for old in listed[:-self.keep]:
                for path in tf.io.gfile.glob(f"{old}.*"):
                    tf.io.gfile.remove(path)
            logging.info("tputrain: saved checkpoint %s (async)", prefix)
        except BaseException as error:  # noqa: BLE001 - re-raised on the training thread
            self._writer_error = error

    def _join_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            error, self._writer_error = self._writer_error, None
            if _is_disk_full(error):
                raise ModelDirError(f"the background checkpoint write failed, the disk is full "
                                    f"({_first_line(error)}): free some space and rerun to "
                                    "resume from the last good checkpoint") from error
            raise RuntimeError(f"the background checkpoint write failed: {error}") from error

    def sync(self) -> None:
        """Waits for a background write in flight (no-op for synchronous saves)."""
        with self._lock:
            self._join_writer()


class CheckpointList(NamedTuple):
    """The checkpoints of a directory, oldest first, and why its state file was
    not used (None when it was read, or when there is none yet). `missing`: there
    is no state file but there are checkpoint files (listed from the disk)."""

    paths: list[str]
    damage: str | None
    missing: bool = False


def list_checkpoints(directory: str) -> CheckpointList:
    """Reads the `checkpoint` state file strictly; if it is damaged or missing, the
    ckpt files.

    TensorFlow's own reader logs "Checkpoint ignored" for a garbled state file
    and returns None, which makes a run start over at step 0 and rotate the good
    checkpoints away; a 0-byte or non-UTF-8 file raises with no fix named. A
    missing one did the same to a model_dir copied without it.
    """
    path = f"{directory.rstrip('/')}/{_STATE_FILE}"
    if not tf.io.gfile.exists(path):
        on_disk = _checkpoints_on_disk(directory) if tf.io.gfile.isdir(directory) else []
        return CheckpointList(on_disk, None, missing=bool(on_disk))
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            state = text_format.Parse(f.read().decode("utf-8"), CheckpointState())
        if not state.model_checkpoint_path:
            raise ValueError("it names no checkpoint")
    except (ValueError, text_format.ParseError, tf.errors.OpError) as error:
        return CheckpointList(_checkpoints_on_disk(directory), f"{path}: {_first_line(error)}")
    paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
    return CheckpointList([p if "://" in p or os.path.isabs(p) else f"{directory.rstrip('/')}/{p}"
                           for p in paths], None)


def _checkpoints_on_disk(directory: str) -> list[str]:
    """`ckpt-<step>` prefixes that have an index file, oldest first."""
    steps = []
    for name in tf.io.gfile.listdir(directory):
        match = _INDEX.match(name)
        if match:
            steps.append(int(match.group(1)))
    return [f"{directory.rstrip('/')}/ckpt-{step}" for step in sorted(steps)]


class _HostState:
    """State each host has its own of (its data iterator), on multi-host runs.

    Every host writes its part for a step, all meet at a barrier, and only then
    does the chief commit the step (its state file): a listed step always has
    every host's part. Restoring, each host reads its own part of that step.
    """

    def __init__(self, directory: str, trackables: dict[str, Any], host: tuple[int, int],
                 barrier: Callable[[], Any] | None):
        index, count = host
        self.apart = count > 1 and bool(trackables)
        self.directory = f"{directory.rstrip('/')}/hosts/host-{index}-of-{count}"
        self.checkpoint = tf.train.Checkpoint(**trackables) if self.apart else None
        self.barrier = barrier or (lambda: None)

    def save(self, step: int, keep: int) -> None:
        if not self.apart:
            return
        self.checkpoint.write(f"{self.directory}/ckpt-{step}")
        self.barrier()
        stale = sorted(int(m.group(1)) for m in map(_INDEX.match, tf.io.gfile.listdir(
            self.directory)) if m)[:-(keep + 1)]
        for old in stale:  # keep + 1: the chief may still list the oldest of them
            for path in _files_of(f"{self.directory}/ckpt-{old}"):
                tf.io.gfile.remove(path)

    def restore(self, step: int) -> None:
        if not self.apart:
            return
        prefix = f"{self.directory}/ckpt-{step}"
        if not tf.io.gfile.exists(f"{prefix}.index"):
            raise RuntimeError(f"this host's data position for step {step} ({prefix}) is "
                               "missing: restore it, or start over in a new model_dir")
        self.checkpoint.read(prefix).assert_consumed()


def _check_distributed_position(change: LayoutChange) -> None:
    """With no saved data state (input_mode="distributed") the input is rebuilt on
    every resume and skips `recorded_layout.input_steps(step)` batches: after a layout
    change, the examples consumed rounded up to this run's batch. One line says so."""
    logging.warning("tputrain: %s", change.recovered(
        rebuilt="the input is rebuilt on every resume (no data iterator is saved)"))


def _layout_refusal(change: LayoutChange, why: str) -> str:
    """The cause, both layouts, what is intact and what to do."""
    return (f"checkpoint {change.path} (step {change.step}) was written with "
            f"{change.saved.describe()}, this run has {change.now.describe()}: {why}. The "
            "checkpoint is intact: resume with the layout that wrote it, or through the "
            "Trainer (which reads the input past the examples consumed), or start a new "
            "model_dir from its weights (tputrain.InitCheckpoint)")


def _unreadable_message(directory: str, failures: list[tuple[str, BaseException]]) -> str:
    """Why no checkpoint was restored, and what to do about it."""
    details = "; ".join(f"{p}: {type(e).__name__}: {_first_line(e)}" for p, e in failures)
    if any(_ITERATOR_FAILURE in str(error) for _, error in failures):
        return (f"no checkpoint in {directory} could be restored ({details}). A data iterator "
                "that fails to restore means the input pipeline is not the one that saved it "
                "(its ops, batching or sharding; for checkpoints written before tputrain "
                "recorded the input layout, also another replica count). The files are intact: "
                "resume once with the setup that wrote them (later checkpoints record the "
                "layout and resume on another replica count), or start a new model_dir")
    return (f"no checkpoint in {directory} could be read ({details}): delete the damaged files "
            "(or the whole directory to start over)")


def _listed(directory: str) -> list[str]:
    return list_checkpoints(directory).paths


def _files_of(prefix: str) -> list[str]:
    """A checkpoint's files: `<prefix>.index`, `<prefix>.data-*` (not `ckpt-10` for `ckpt-1`)."""
    return tf.io.gfile.glob(f"{prefix}.*")


def _checkpoint_bytes(prefix: str) -> int:
    return sum(tf.io.gfile.stat(path).length for path in _files_of(prefix))


def _is_disk_full(error: BaseException) -> bool:
    return (isinstance(error, tf.errors.ResourceExhaustedError)
            or getattr(error, "errno", None) == errno.ENOSPC
            or "no space left" in str(error).lower())


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


# Checkpointers with async saves: their writes finish before the interpreter exits.
_PENDING: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


@atexit.register
def _sync_all() -> None:
    for checkpointer in list(_PENDING):
        try:
            checkpointer.sync()
        except Exception as error:  # noqa: BLE001 - at exit, report and go on
            logging.error("tputrain: %s", error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# What makes a checkpoint unreadable (not another model's): as `restore_latest` skips.
UNREADABLE_ERRORS = (tf.errors.OpError, ValueError, IndexError)


def first_readable(candidates: Sequence[str], read: Callable[[str], Any], verb: str
                   ) -> tuple[str | None, Any, list[tuple[str, BaseException]]]:
    """(path, `read(path)`, failures) for the first of `candidates` (newest first)
    that `read` can read, warning once for each newer one it skipped; (None, None,
    failures) if none. A `CheckpointMismatchError` (another model) is raised as is:
    an older checkpoint of the wrong model is no fallback."""
    failures: list[tuple[str, BaseException]] = []
    for path in candidates:
        try:
            value = read(path)
        except CheckpointMismatchError:
            raise
        except UNREADABLE_ERRORS as error:
            failures.append((path, error))
            continue
        for failed, error in failures:
            logging.warning("tputrain: checkpoint %s is unreadable (%s: %s); %s the older %s "
                            "instead", failed, type(error).__name__, _first_line(error), verb, path)
        return path, value, failures
    return None, None, failures


def read_newest(paths: Sequence[str], read: Callable[[str], Any], directory: str
                ) -> tuple[str, Any]:
    """(path, what `read` returned) for the newest of `paths` (oldest first) that
    `read` can read, for readers that are not the run's `Checkpointer` (export,
    eval): a truncated or damaged one is skipped for the older one, with the
    warning `restore_latest` logs; none readable is `_unreadable_message`'s
    RuntimeError."""
    path, value, failures = first_readable(list(reversed(list(paths))), read, "read")
    if path is None:
        raise RuntimeError(_unreadable_message(directory, failures))
    return path, value
