"""`BestCheckpoint`, and what both actions that watch one evaluation metric share
(`Watch`, their records): keep the best checkpoint here, stop early in
`early_stopping.py`.

Both keep their state on disk in model_dir, so a preempted (or kill -9'd) run
that resumes ends with the same best checkpoint and stops at the same step as
an uninterrupted one:

* `BestCheckpoint` copies the checkpoint of each improving evaluation into
  `model_dir/best/` (outside the keep-N rotation) and then writes
  `best/best.json` (step, value, and the last step evaluated) atomically after
  every evaluation: that rename is the commit. The Controller evaluates *before*
  it saves at a step, so instead of waiting for that save the action asks the
  Checkpointer for it at once (`Checkpointer.save` at a step already saved is a
  no-op; the Controller's save that follows becomes one).
* `EarlyStopping` records every evaluation (`{step: value}`) in
  `checkpoints/early_stopping.json`, rewritten atomically after each one. On
  resume it keeps the evaluations up to the restored step (those after it are
  repeated by the resumed run) and recomputes its decision from them, so the
  record can never be ahead of or behind the checkpoint it resumes from.
* A kill between the checkpoint of an evaluated step and a record of its
  evaluation: the resumed run evaluates that step again for the action that has
  no record of it (`Action.eval_recorded`, the Controller), so the best step,
  the stop step and the export are the uninterrupted run's.
* Copies into `best/` that best.json does not name (a copy cut short by a kill
  or a full disk, the previous best left by a kill) are deleted before the
  pre-flight measures the room (`tidy_best`); a copy that fails deletes its
  partial files and stops the run with `ModelDirError`, the rerun continues.
* The best that best.json names is read back at pre-flight (`repair`): missing
  or damaged files (bit rot, a partial copy of model_dir) are copied again from
  the same step in `checkpoints/`, or the run stops naming them. A worse step is
  never kept in its place: best.json stays the commit point.
* A record that is there but cannot be read (`read_record`: a damaged byte, a
  field tputrain does not write) stops the run naming it and the fix, before
  anything in best/ is deleted: taken for none, it started the best over.

Hooks run on every host with the same (agreed) eval metrics; only the chief writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Callable, Mapping

import tensorflow as tf
from absl import logging

from tputrain import _compat
from tputrain.actions.base import Action
from tputrain.checkpointing.atomic import TEMP_MARK, write_atomically
from tputrain.checkpointing.files import first_line
from tputrain.checkpointing.recovery import UNREADABLE_ERRORS
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.runtime.context import ActionContext
from tputrain.loop.eval_sets import is_default, log_keys
from tputrain.checkpointing.run_directory import ModelDirError


BEST_DIR = RunDirectory.BEST
BEST_FILE = RunDirectory.BEST_RECORD
CHECKSUM = "checksum"  # the records' SHA-256 of their other fields (`write_json`)


class Watch:
    """One eval metric and what counts as better: `mode` "max" or "min", by more
    than `min_delta`. NaN/Inf never improves (a diverged eval is never the best)."""

    def __init__(self, owner: str, metric: str, mode: str, min_delta: float = 0.0):
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"{owner}.metric must be a metric name such as 'accuracy' or "
                             f"'eval/loss', got {metric!r}")
        if mode not in ("max", "min"):
            raise ValueError(f"{owner}.mode must be 'max' or 'min', got {mode!r}")
        if not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"{owner}.min_delta must be a number >= 0, got {min_delta!r}")
        self.owner, self.metric, self.mode = owner, metric, mode
        self.key = metric.removeprefix("eval/")  # eval logs are {"loss": ..., "accuracy": ...}
        self.min_delta = float(min_delta)

    def value(self, logs: Mapping[str, float]) -> float:
        key = self.metric if self.metric in logs else self.key  # (a set named "eval")
        if key not in logs:
            raise ValueError(f"{self.owner}.metric {self.metric!r} is not an eval metric of "
                             f"this task: use one of {sorted(k for k in logs if not k.startswith('_'))}")
        return float(logs[key])

    def check(self, context: ActionContext) -> None:
        """Before training (`Action.preflight`): with named eval sets the metric must
        name one, "<set>/<metric>" (a Task's own eval logs are checked at the first
        evaluation, which `value` does)."""
        splits = context.options.eval_splits
        named = {name.split("/", 1)[0] for name in (self.metric, self.key) if "/" in name}
        if is_default(splits) or named & set(splits):
            return
        names = log_keys(splits, ["loss", *(metric.name for metric in context.eval_metrics)])
        raise ValueError(f"{self.owner}.metric {self.metric!r} names no eval set's metric "
                         f"(Trainer.eval_splits={splits}): use one of {names}")

    def improved(self, value: float, best: float | None) -> bool:
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        if self.mode == "max":
            return value > best + self.min_delta
        return value < best - self.min_delta


def write_json(path: str, record: Mapping[str, Any]) -> None:
    """Writes `record` with its checksum to a temp file, then renames it over `path`: a
    kill leaves the old file or the new one, never half of one."""
    record = {**record, CHECKSUM: _checksum(record)}
    write_atomically(path, json.dumps(record, indent=1) + "\n")


def _checksum(record: Mapping[str, Any]) -> str:
    """SHA-256 of the record's fields: damage that leaves valid JSON ("max" read as
    "min", a value's digit) is told from the record written."""
    canonical = json.dumps({k: v for k, v in record.items() if k != CHECKSUM},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_json(path: str) -> dict[str, Any] | None:
    """The record at `path`; None if there is none or it cannot be read (said once).
    For a reader that only reports (tracking tags); an action's own record is read
    with `read_record`, which stops on damage."""
    if not tf.io.gfile.exists(path):
        return None
    try:
        return _parse(path, lambda record: None)
    except (ValueError, TypeError, KeyError, tf.errors.OpError) as error:
        logging.warning("tputrain: ignoring %s, which cannot be read (%s)", path, error)
        return None


def read_record(path: str, check: Callable[[dict[str, Any]], None],
                fix: str) -> dict[str, Any] | None:
    """An action's record at `path` (`check` raises ValueError on a wrong field); None if
    there is none. One that is there but cannot be read stops the run with `fix`: taken
    for absent, it started the best or the early stop over (a worse step kept and
    exported, the true best deleted, an early-stopped run trained on)."""
    if not tf.io.gfile.exists(path):
        return None
    try:
        return _parse(path, check)
    except (ValueError, TypeError, KeyError, tf.errors.OpError) as error:
        raise ModelDirError(f"{path} is damaged or unreadable ({first_line(error)}): "
                            f"{fix}") from None


def _parse(path: str, check: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    with tf.io.gfile.GFile(path, "r") as f:
        record = json.loads(f.read())
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if CHECKSUM in record and record.pop(CHECKSUM) != _checksum(record):
        raise ValueError("its checksum does not match its fields")  # older records have none
    check(record)
    return record


def check_watched(record: Mapping[str, Any]) -> None:
    """The metric and mode both records begin with (ValueError if they are not)."""
    if not isinstance(record.get("metric"), str) or record.get("mode") not in ("max", "min"):
        raise ValueError(f"metric {record.get('metric')!r} and mode {record.get('mode')!r} "
                         "are not a metric name and 'max' or 'min'")


def _check_best(record: Mapping[str, Any]) -> None:
    """best.json's fields: the watch, the step evaluated, and the best, its value and
    checkpoint together (ValueError if not)."""
    check_watched(record)
    steps = [record[key] for key in ("evaluated", "step") if key in record]
    if any(type(step) is not int or step < 0 for step in steps):
        raise ValueError(f"a step is not a whole number: {steps}")
    if "step" in record or "checkpoint" in record or "value" in record:
        if record.get("checkpoint") != f"ckpt-{record.get('step')}" or \
                not isinstance(record.get("value"), (int, float)):
            raise ValueError("its step, value and checkpoint do not agree")


def read_best(directory: str) -> dict[str, Any] | None:
    """`directory`/best.json, or None; a damaged one stops the run naming the fix."""
    return read_record(
        os.path.join(directory, BEST_FILE), _check_best,
        f"put it back from a copy of this model_dir, or delete {directory} to keep the "
        "best of the evaluations from now on")


def best_record(model_dir: str, directory: str | None = None,
                strict: bool = True) -> dict[str, Any] | None:
    """The best checkpoint kept in `directory` (default model_dir/best): the
    `best.json` record ({"step", "value", "metric", "mode", "checkpoint"}) with
    "checkpoint" made a full path, or None if there is none whose files exist. A
    damaged record raises `ModelDirError` (never "no best": the latest would be
    exported in its place), or with `strict=False` is said and taken as none."""
    directory = directory or RunDirectory(model_dir).best
    path = os.path.join(directory, BEST_FILE)
    record = read_best(directory) if strict else read_json(path)
    if record is None or "checkpoint" not in record:
        return None
    record["checkpoint"] = os.path.join(directory, record["checkpoint"])
    if not tf.io.gfile.exists(f"{record['checkpoint']}.index"):
        logging.warning("tputrain: %s names %s, which is missing", BEST_FILE, record["checkpoint"])
        return None
    return record


class BestCheckpoint(Action):
    """Keeps the checkpoint with the best eval `metric` in model_dir/best/, apart from
    the keep-N rotation; `tputrain.Export` and `tputrain export` export it when set.

    Args:
      metric: an eval metric, "accuracy" or "eval/accuracy" (the same), "loss", ...;
        with named eval sets (`Trainer.eval_splits`) "<set>/<metric>", e.g.
        "validation/accuracy".
      mode: "max" (accuracy) or "min" (loss): which way is better.
      directory: where to keep it; None: model_dir/best.
    """

    def __init__(self, metric: str = "accuracy", mode: str = "max",
                 directory: str | None = None):
        self.watch = Watch("BestCheckpoint", metric, mode)
        self.directory = directory
        self.step: int | None = None
        self.value: float | None = None
        self.loaded = False

    def directory_of(self, context: ActionContext) -> str:
        return self.directory or RunDirectory(context.model_dir).best

    def preflight(self, context: ActionContext) -> None:
        self.watch.check(context)

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        self._load(context)

    def _load(self, context: ActionContext) -> None:
        """Reads back the best so far (a resumed run keeps comparing against it). From
        best.json alone: a best whose files went missing is still the value to beat
        (pre-flight copies it again or stops), never a reason to take a worse one."""
        record = read_best(self.directory_of(context))
        self.step = self.value = None
        self.loaded = True
        if record is None or "step" not in record:
            return
        if (record.get("metric"), record.get("mode")) != (self.watch.key, self.watch.mode):
            logging.warning("tputrain: %s kept the best %s (%s); now %s (%s): starting over",
                            self.directory_of(context), record.get("metric"),
                            record.get("mode"), self.watch.key, self.watch.mode)
            return
        self.step, self.value = int(record["step"]), float(record["value"])

    def eval_recorded(self, context: ActionContext, step: int) -> bool:
        """best.json names a step evaluated at or after `step` (evaluations come in order)."""
        record = read_best(self.directory_of(context)) or {}
        if (record.get("metric"), record.get("mode")) != (self.watch.key, self.watch.mode):
            return False
        return int(record.get("evaluated", record.get("step", -1))) >= step

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if not self.loaded:  # Trainer.evaluate() outside train()
            self._load(context)
        value = self.watch.value(logs)
        if not self.watch.improved(value, self.value):
            if context.is_chief:  # the evaluation is recorded, the best unchanged
                self._commit(context, step, self.step, self.value)
            return
        # Eval runs before the Controller's save at this step: save now (every host
        # takes part; a step already saved is not written twice), then copy it.
        path = context.checkpointer.save()
        context.checkpointer.sync()  # an async write must be on disk before the copy
        if context.is_chief:
            self._keep(context, step, value, path)
        logging.info("tputrain: best %s %.4g at step %d (was %s)", self.watch.key, value, step,
                     "none" if self.value is None else f"{self.value:.4g} at step {self.step}")
        self.step, self.value = step, value

    def _keep(self, context: ActionContext, step: int, value: float, path: str) -> None:
        """Copies the checkpoint files, then commits best.json, then drops the old copy."""
        directory = self.directory_of(context)
        name = f"ckpt-{step}"
        try:
            copy_checkpoint(path, directory, name)
        except (tf.errors.OpError, OSError) as error:
            raise ModelDirError(
                f"copying the best checkpoint {path} into {directory} {_failure(error)}; the "
                f"partial copy is deleted, best.json and {path} are intact: free some space "
                "and rerun, which evaluates that step again and keeps it if it is the "
                "best") from None
        self._commit(context, step, step, value)
        tidy_best(directory)  # the previous best's files

    def repair(self, context: ActionContext) -> None:
        """Pre-flight (chief): a best that best.json names but whose files are missing or
        damaged is copied again from the same step in checkpoints/, else the run stops.
        (A run that started the best over took a worse step for the best, deleted what
        was left of the true one and exported the worse one.)"""
        directory = self.directory_of(context)
        record = read_best(directory) or {}  # a damaged one stops the run here
        if "checkpoint" not in record or \
                (record.get("metric"), record.get("mode")) != (self.watch.key, self.watch.mode):
            return  # no best yet, or another metric's (started over by _load)
        name = str(record["checkpoint"])
        damage = checkpoint_damage(os.path.join(directory, name))
        if damage is None:
            return
        source = os.path.join(RunDirectory(context.model_dir).checkpoints, name)
        what = (f"the best checkpoint {os.path.join(directory, name)} ({record.get('metric')} "
                f"{record.get('value')} at step {record.get('step')}, named by {BEST_FILE}) "
                f"{damage}")
        if checkpoint_damage(source) is not None:
            raise ModelDirError(
                f"{what}, and {os.path.dirname(source)} holds no intact {name} to copy it "
                f"from: put back {name}.* from a copy of this model_dir, or delete "
                f"{directory} to keep the best of the evaluations from now on")
        logging.warning("tputrain: %s: copying it again from %s", what, source)
        try:
            copy_checkpoint(source, directory, name)
        except (tf.errors.OpError, OSError) as error:
            raise ModelDirError(f"{what}; copying it again from {source} {_failure(error)}: "
                                "free some space and rerun") from None

    def _commit(self, context: ActionContext, evaluated: int, step: int | None,
                value: float | None) -> None:
        """Writes best.json: the best so far and the last step evaluated (the commit)."""
        record: dict[str, Any] = {"metric": self.watch.key, "mode": self.watch.mode,
                                  "evaluated": evaluated}
        if step is not None:
            record.update(step=step, value=value, checkpoint=f"ckpt-{step}")
        write_json(os.path.join(self.directory_of(context), BEST_FILE), record)



def _failure(error: BaseException) -> str:
    """'ran out of room (...)' or 'failed (...)': a full disk said as such."""
    text = first_line(error)
    full = "no space left" in text.lower() or isinstance(error, tf.errors.ResourceExhaustedError)
    return f"{'ran out of room' if full else 'failed'} ({text})"


def copy_checkpoint(path: str, directory: str, name: str) -> None:
    """Copies the checkpoint `path`'s files to `directory`/`name`.*, the index last: a
    copy cut short has no index, so it never looks like a checkpoint. A copy that fails
    deletes its partial files (a full disk must not leave a file every rerun trips
    over) and raises."""
    tf.io.gfile.makedirs(directory)
    sources = sorted(tf.io.gfile.glob(f"{path}.*"), key=lambda s: s.endswith(".index"))
    if not any(s.endswith(".index") for s in sources):
        raise FileNotFoundError(f"BestCheckpoint: the checkpoint {path} has no files")
    try:
        for source in sources:
            suffix = source[len(path):]  # ".index", ".data-00000-of-00001"
            tf.io.gfile.copy(source, os.path.join(directory, name + suffix), overwrite=True)
    except (tf.errors.OpError, OSError):
        for partial in tf.io.gfile.glob(os.path.join(directory, f"{name}.*")):
            tf.io.gfile.remove(partial)
        raise


def checkpoint_damage(prefix: str) -> str | None:
    """Why the checkpoint at `prefix` cannot be used ("... is missing", "is damaged
    (...)"), or None when every tensor reads back (TensorFlow checks each one's
    checksum; the data iterator's state, a variant NumPy cannot hold, is read as a
    tensor by the restore op)."""
    name = os.path.basename(prefix)
    if not tf.io.gfile.exists(f"{prefix}.index"):
        return f"is missing its index file {name}.index"
    if not tf.io.gfile.glob(f"{prefix}.data-*"):
        return f"is missing its data file {name}.data-*"
    try:
        reader = tf.train.load_checkpoint(prefix)
        variants = []
        for key, dtype in reader.get_variable_to_dtype_map().items():
            if dtype == tf.variant:
                variants.append(key)
            else:
                reader.get_tensor(key)
        if variants:
            with tf.device("/cpu:0"):
                tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=variants,
                                     shape_and_slices=[""] * len(variants),
                                     dtypes=[tf.variant] * len(variants))
    except UNREADABLE_ERRORS as error:
        return f"is damaged ({type(error).__name__}: {first_line(error)})"
    return None


def tidy_best(directory: str) -> None:
    """Deletes files in `directory` that best.json does not name: a copy cut short (a kill,
    a full disk), the previous best left by a kill after the commit, temp records."""
    if not tf.io.gfile.isdir(directory):
        return
    record = read_best(directory) or {}  # a damaged one stops the run: it may name any
    keep = f"{record['checkpoint']}." if "checkpoint" in record else None
    # Index files first: a deletion cut short leaves no index without its data.
    for name in sorted(tf.io.gfile.listdir(directory), key=lambda n: not n.endswith(".index")):
        stray = (name.startswith("ckpt-") and not (keep and name.startswith(keep))) \
            or name.startswith(f"{BEST_FILE}{TEMP_MARK}")
        if stray:
            logging.info("tputrain: removing %s from %s (not the kept best checkpoint)",
                         name, directory)
            tf.io.gfile.remove(os.path.join(directory, name))


def __getattr__(name: str) -> Any:
    """`EarlyStopping` moved to `tputrain.actions.early_stopping` (`_compat.MOVED_NAMES`)."""
    return _compat.moved_name(__name__, name)
