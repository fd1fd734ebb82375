"""`Checkpointer`: saves every N steps, keeps K, restores the newest readable one.

The package docstring (`tputrain.checkpointing`) says what a checkpoint holds
and how each way a checkpoint directory can go wrong is handled; this module
is the cadence and the order of things, the parts live beside it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Sequence

import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.async_writer import AsyncWriter, sync_at_exit
from tputrain.checkpointing.config_owned import ConfigOwned
from tputrain.checkpointing.files import check_room, listed, save_failed
from tputrain.checkpointing.host_state import HostState
from tputrain.checkpointing.integrity import (ACTION_STATE, SHOW, CheckpointMismatchError,
                                              FiniteCheck, NonFiniteStateError,
                                              describe_mismatch, root_names)
from tputrain.checkpointing.layout import LayoutRecord
from tputrain.checkpointing.model_variables import ROOT as MODEL_VARIABLES, has_root
from tputrain.checkpointing.recovery import newest_readable, tidy_after_restore
from tputrain.checkpointing.input_layout import InputLayout, LayoutChange, saved_layout


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
      async_save: write checkpoints on a background thread (see
        `tputrain.checkpointing.async_writer`); `sync()` waits for the write in flight.
      config_owned: variables whose value the config decides, not the checkpoint
        (the optimizer's learning rate): the values they hold when a restore begins
        (the config's, or what a script set on a live Trainer since) are put back
        after it, logged where they differ; or a `ConfigOwned` (its `set_by`).
      per_host: state that differs between hosts (each host's data iterator). On
        one host it is saved with the rest; on several, each host writes its own to
        `<restore_directory>/hosts/host-<i>-of-<n>/ckpt-<step>` before the chief
        commits the step (after `barrier`), and restores its own.
      host: `(index, count)` of this host.
      barrier: on several hosts, returns once every host has called it.
      input_layout: how a step's batch is split (`tputrain.checkpointing.input_layout`); saved with
        every checkpoint, so that `per_host` state saved under another layout is
        recognised instead of failing to restore (or restoring batches of the old shape).
      reposition: called with the `LayoutChange` when the checkpoint's layout differs
        from `input_layout`: the `per_host` state is then not restored, and this moves
        the fresh one past the examples consumed (`LayoutChange.resume_steps`). None:
        such a checkpoint is refused.
      action_state: the actions' own state by name (`Action.checkpoint_state`), saved
        under `action_state/` inside every checkpoint and read back where the checkpoint
        has it (an older one, or one of a run without those actions, restores the rest);
        never restored by `restore_weights`.
      **trackables: what every host has the same of (model, optimizer, seeds...).
    """

    def __init__(self, directory: str, step: tf.Variable, every: int, keep: int = 3,
                 check_finite: bool = True, restore_directory: str | None = None,
                 async_save: bool = False, config_owned: Sequence[Any] | ConfigOwned = (),
                 per_host: dict[str, Any] | None = None, host: tuple[int, int] = (0, 1),
                 barrier: Callable[[], Any] | None = None,
                 input_layout: InputLayout | None = None,
                 reposition: Callable[[LayoutChange], None] | None = None,
                 action_state: dict[str, Any] | None = None, **trackables: Any):
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {every}")
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        self.directory = directory
        self.restore_directory = restore_directory or directory
        # A non-chief worker's part of each save, in a directory deleted at its end: its
        # saves are not logged (the chief's line names the checkpoint).
        self.scratch = self.restore_directory != directory
        self.every = every
        self.step = step
        self.check_finite = check_finite
        self._hosts = HostState(self.restore_directory, per_host or {}, host, barrier)
        if not self._hosts.apart:
            trackables = {**trackables, **(per_host or {})}
        self._trackables = dict(trackables)
        self.input_layout = input_layout
        self._layout = LayoutRecord(input_layout, per_host or {}, reposition)
        self._action_state = _holder(action_state or {})
        self.checkpoint = tf.train.Checkpoint(step=step, **trackables, **self._layout.saveables,
                                              **self._action_state)
        self._manager: tf.train.CheckpointManager | None = None
        self._saved_step: int | None = None  # the step last saved or restored here
        self.keep = keep
        self._config = ConfigOwned.of(config_owned)
        self.async_save = async_save
        self._finite = FiniteCheck(trackables.values())
        self._lock = threading.Lock()
        self._writer = AsyncWriter(directory, announce=not self.scratch)
        if async_save:
            sync_at_exit(self)

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
        paths = listed(self.directory)
        return paths[-1] if paths else None

    @property
    def checkpoints(self) -> list[str]:
        """Listed checkpoints in `directory`, oldest first."""
        return listed(self.directory)

    def _candidates(self) -> list[str]:
        """Listed checkpoints, newest first (re-read: another process may have saved)."""
        return list(reversed([p for p in listed(self.restore_directory) if p]))

    def check_compatible(self) -> None:
        """Raises `CheckpointMismatchError` if the latest checkpoint is another model's.

        Reads only the checkpoint's index (names and shapes), so the Trainer can
        call it before anything is written to model_dir.
        """
        for path in self._candidates():
            try:
                reader = tf.train.load_checkpoint(path)
                ignore = self._layout.data_keys(self._layout.differs(saved_layout(reader)))
                problems = describe_mismatch(
                    self._checkpoint_for(self._older_than_model_variables(reader)), path, ignore)
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
        self._config.keep()
        path, change, failures = newest_readable(candidates, self._restore, "restored",
                                                 self.restore_directory)
        if path is None:  # there was none (an unreadable one raised)
            self._after_restore(None, [])
            return None
        if change is None:
            self._hosts.restore(int(self.step.numpy()))
        else:
            self._layout.reposition(change)  # the fresh data state, moved to the step
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
        change = self._layout.change(path, reader, saved)
        older = self._older_than_model_variables(reader, path)
        problems = describe_mismatch(self._checkpoint_for(older), path,
                                     self._layout.data_keys(change is not None))
        if problems:
            raise CheckpointMismatchError(self._mismatch_message(path, problems))
        left_out = self._layout.left_out(change, saved) | older | set(self._action_state)
        saved_actions = ACTION_STATE in root_names(reader)
        try:
            if not left_out and not saved_actions:
                self.checkpoint.restore(path).assert_consumed()
            else:
                root = tf.train.Checkpoint(**{name: obj for name, obj in self._saveables().items()
                                              if name not in left_out})
                status = root.restore(path)
                if change is not None or saved is not None or saved_actions:  # some unread
                    status.expect_partial().assert_existing_objects_matched()
                else:
                    status.assert_consumed()
            if self._action_state and saved_actions:  # what of it this run's actions have
                tf.train.Checkpoint(**self._action_state).read(path).expect_partial()
        except AssertionError as error:  # structure differs in a way we did not list
            raise CheckpointMismatchError(
                self._mismatch_message(path, str(error).splitlines()[0])) from error
        finally:
            self._layout.reset()  # the layout saved next is this run's
        return self._layout.restored(change, saved)

    @property
    def recorded_layout(self) -> InputLayout | None:
        """This run's layout and where its data started: what the next save records
        (after a restore, `input_steps(step)` is the input's position)."""
        return self._layout.recorded()

    def _checkpoint_for(self, left_out: set[str]) -> tf.train.Checkpoint:
        """What a checkpoint was written from: this run's objects but `left_out` (the
        `model_variables` of one that predates that root: `_older_than_model_variables`)."""
        if not left_out:
            return self.checkpoint
        return tf.train.Checkpoint(**{name: obj for name, obj in self._saveables().items()
                                      if name not in left_out})

    def _older_than_model_variables(self, reader: Any, path: str | None = None) -> set[str]:
        """{MODEL_VARIABLES} if this model needs that root and the checkpoint has none
        (written before tputrain saved the weights Keras hides from TensorFlow's
        checkpoints): restored as written then, its optimizer giving back the listed
        layers' trainable weights; with `path`, a warning names what it cannot."""
        holder = self._trackables.get(MODEL_VARIABLES)
        held = [v for v in vars(holder).values() if isinstance(v, keras.Variable)] \
            if holder is not None else []
        if not held or has_root(reader):
            return set()
        if path is not None:
            kept = [v.path for v in held if not v.trainable]
            logging.warning(
                "tputrain: %s was written before tputrain saved the weights of layers a "
                "subclassed model keeps in a list or dict; restoring it as written: %s keep "
                "their current values (the next save holds everything)", path,
                ", ".join(kept) or "nothing")
        return {MODEL_VARIABLES}

    def _saveables(self) -> dict[str, Any]:
        """What `self.checkpoint` saves, by name (save_counter aside)."""
        return {"step": self.step, **self._trackables, **self._layout.saveables,
                **self._action_state}

    def _after_restore(self, restored: str | None, failed: list[str]) -> None:
        """The config's hyper-parameters back; as the writer, the directory tidied
        (`tidy_after_restore`)."""
        self._manager = None  # lists once, when made: else stale (two Trainers, one dir)
        self._config.apply()
        if self.restore_directory != self.directory:
            return  # a non-chief worker reads the chief's directory, never tidies it
        tidy_after_restore(self.directory, restored, failed)

    def restore_weights(self, exclude: Iterable[str] = ("iterator", "step")) -> str | None:
        """Restores the latest checkpoint except `exclude` (used to roll back).

        Returns its path, or None if there is no checkpoint yet.
        """
        path = self._candidates()[0] if self._candidates() else None
        if path is None:
            return None
        exclude = set(exclude)
        self._config.keep()
        partial = tf.train.Checkpoint(
            **{name: obj for name, obj in {"step": self.step, **self._trackables}.items()
               if name not in exclude})
        partial.restore(path).expect_partial().assert_existing_objects_matched()
        self._config.apply()
        return path

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def all_finite(self) -> bool:
        """Whether every float variable that would be saved is finite."""
        return self._finite()

    def save(self) -> str:
        """Saves at the current step unless a checkpoint for it already exists.

        Raises `NonFiniteStateError` instead of saving NaN/Inf weights.
        """
        with self._lock:
            if self.async_save:
                self._writer.join()  # the write in flight may be this very step
            step = int(self.step.numpy())
            latest = self.latest
            # Decided in memory, not from the files: on several hosts the chief may
            # still be writing, and all or none of them must reach the barrier below.
            if step == self._saved_step:
                return latest or self._final(step)
            if self.check_finite and not self.all_finite():
                bad = self._finite.non_finite()
                raise NonFiniteStateError(
                    f"not saving step {step}: NaN/Inf in {', '.join(bad[:SHOW])}. "
                    f"The last good checkpoint is {latest}; lower the learning rate or "
                    "enable the non-finite guard (NonFiniteGuard.policy)")
            logging.info("tputrain: saving checkpoint at step %d", step)
            check_room(self.directory, step, latest)
            self._hosts.save(step, self.keep)  # every host's own state before the commit
            if self.async_save:
                self._saved_step = step
                path = self._writer.start(self.checkpoint, step, self.keep)
                return self._final(step) if self.scratch else path
            try:
                path = self.manager.save(checkpoint_number=step)
            except (tf.errors.OpError, OSError) as error:
                raise save_failed(self.directory, step, latest, error) from None
            self._saved_step = step
            if self.scratch:  # a worker's scratch path is gone when it ends: the chief's
                return self._final(step)
            logging.info("tputrain: saved checkpoint %s", path)
            return path

    def _final(self, step: int) -> str:
        """The checkpoint of `step` where the chief writes it."""
        return f"{self.restore_directory.rstrip('/')}/ckpt-{step}"

    def sync(self) -> None:
        """Waits for a background write in flight (no-op for synchronous saves)."""
        with self._lock:
            self._writer.join()


def _holder(states: dict[str, Any]) -> dict[str, Any]:
    """{ACTION_STATE: an object holding each action's state by name}, or {} for none."""
    if not states:
        return {}
    holder = tf.Module(name=ACTION_STATE)
    for name, state in states.items():
        setattr(holder, name, state)
    return {ACTION_STATE: holder}
