"""Evaluating checkpoints apart from training: once, or as a side-car beside a run.

A side-car is a second process on the model_dir a training process owns
(`tputrain.fault_tolerance.lock`): it must read checkpoints and write eval summaries, and
nothing that the trainer writes. Hence:

* `ReadOnlyTrainer` is the gin-configured Trainer without the writer's
  pre-flight: it takes no lock on model_dir and writes no probe files (it only
  checks, reading an index, that the checkpoints are this model's); `train()`
  refuses, and `evaluate()` runs no actions (a `BestCheckpoint` would write).
* A checkpoint is read with `read_checkpoint` (the model and the step, by
  path), never `Checkpointer.restore_latest`: that one, as the writer, tidies
  the directory (moves damaged files aside, removes the `ckpt-*_temp` folder of
  a write in flight).
* Only checkpoints that the `checkpoint` state file lists are read: TensorFlow
  lists one after its files are complete, so a write in progress is never read.
* It writes TensorBoard scalars to `model_dir/eval/` at the checkpoint's step
  (as the Trainer's own evaluations do; an earlier step than the run's latest
  hides no later point: `tputrain.observe.eval_events`) and `eval/evaluated_checkpoints.json`,
  the steps evaluated (with their metrics) and skipped, rewritten atomically
  after each, so a restarted side-car does not evaluate a step again. A lock on
  `eval/` (not on model_dir) keeps a second side-car out.

`continuous=True` evaluates every listed checkpoint not evaluated yet, in step
order, polling every `poll_seconds`, and stops once it has handled one at step
>= `until_step` (default `Trainer.train_steps`: give the side-car the run's
config). A checkpoint that keep-N rotation deleted before it was read, or that
cannot be read, is skipped with a warning; a skipped step listed again with other
files (training moved a damaged one aside and saved the step afresh) is read
again, and the end names the steps not evaluated. No new checkpoint for `timeout` seconds (the training
process died or hangs) raises `NoNewCheckpointError`, holding the results so far.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable

import tensorflow as tf
from absl import logging

from tputrain.checkpointing.atomic import write_atomically
from tputrain.checkpointing.files import list_checkpoints, step_of
from tputrain.checkpointing.integrity import CheckpointMismatchError, describe_mismatch
from tputrain.checkpointing.model_variables import model_trackables
from tputrain.checkpointing.recovery import UNREADABLE_ERRORS, read_newest
from tputrain.checkpointing.run_directory import ModelDirError, RunDirectory
from tputrain.core.checks import check_int
from tputrain.data.file_cache import file_stamp
from tputrain.fault_tolerance.lock import ModelDirInUseError, lock_model_dir, release_model_dir
from tputrain.jobs.predict import Outputs, predict_weights
from tputrain.runtime.run_view import RunView, view_of
from tputrain.runtime.validate import write_failure, write_probe
from tputrain.trainer import Trainer  # ReadOnlyTrainer is one

EVAL_DIR = RunDirectory.EVAL
RECORD_FILE = RunDirectory.EVAL_RECORD
Metrics = dict[str, float]


class NoNewCheckpointError(TimeoutError):
    """No new checkpoint appeared within the timeout; `results` holds what was evaluated."""

    def __init__(self, message: str, results: dict[int, Metrics]):
        super().__init__(message)
        self.results = results


class ReadOnlyTrainer(Trainer):
    """A Trainer that only reads model_dir: for evaluating beside a training process.

    Built like `Trainer` (same arguments and gin bindings), minus the writer's
    pre-flight: no lock on model_dir (the training process holds it), no probe
    files. Checkpoints are read by `read_checkpoint`, which does not tidy.
    """

    def _preflight(self) -> None:
        self.checkpointer.check_compatible()  # reads the latest index only

    def train(self, num_steps: int | None = None) -> Metrics:
        raise TypeError("a ReadOnlyTrainer only evaluates (it does not own model_dir): "
                        "build a tputrain.Trainer to train")

    def evaluate(self) -> Metrics:
        """Evaluates the latest listed checkpoint (no actions run, nothing tidied)."""
        listed = list_checkpoints(checkpoint_dir(self.view())).paths
        if listed:
            read_checkpoint(self.view(), listed[-1])
        else:
            logging.warning("tputrain: no checkpoint in %s: evaluating the initial (untrained) "
                            "weights", self.model_dir)
        return self.evaluate_weights()

    def predict(self, source: str = "eval", log_every: int = 100,
                step: int | None = None) -> Outputs:
        """`Trainer.predict` of the checkpoint of `step` (None: the latest readable);
        ValueError if there is none (nothing tidied, nothing written)."""
        check_int("ReadOnlyTrainer.predict", "step", step, 0, allow_none=True)
        view = self.view()
        _read_one(view, _one_checkpoint(view, step), fall_back=step is None)
        return predict_weights(view, source, log_every)


def checkpoint_dir(view: RunView) -> str:
    return RunDirectory(view.model_dir).checkpoints


def checkpoint_step(path: str) -> int:
    """The step of `.../ckpt-<step>`."""
    return step_of(path)


def read_checkpoint(view: RunView, path: str) -> None:
    """Reads the weights and the step of checkpoint `path` into `view`'s run, and
    nothing else: the optimizer, data position and RNG are the training's, and
    the directory is left as it is (see the module docstring). With
    `Trainer.ema_decay`, the EMA weights too, which evaluation and predict use."""
    view = view_of(view)  # a Trainer or a view
    ema = {"ema": view.ema.state} if view.ema is not None else {}
    try:
        model = model_trackables(view.model, path)
        tf.train.Checkpoint(step=view.step, **model, **ema).read(path) \
            .expect_partial().assert_existing_objects_matched()
    except (AssertionError, ValueError) as error:  # another model's, or damaged?
        problems = describe_mismatch(view.checkpointer.checkpoint, path)
        if not problems:
            raise
        raise CheckpointMismatchError(
            f"checkpoint {path} does not hold this model: {problems}; evaluate with the "
            "config that trained it") from error


class EvalRecord:
    """`model_dir/eval/evaluated_checkpoints.json`: {"evaluated": {step: metrics},
    "skipped": {step: why}, "skipped_files": {step: stamp}}, rewritten atomically (a
    temp file renamed) after each. A skipped step's stamp (`checkpoint_stamp`) tells a
    checkpoint saved again at that step (training moves a damaged one aside and saves
    the step afresh) from the one skipped: that one is read again."""

    def __init__(self, model_dir: str):
        self.path = RunDirectory(model_dir).eval_record
        self.evaluated: dict[int, Metrics] = {}
        self.skipped: dict[int, str] = {}
        self.stamps: dict[int, str] = {}
        if not tf.io.gfile.exists(self.path):
            return
        try:
            with tf.io.gfile.GFile(self.path, "r") as f:
                saved = json.load(f)
            self.evaluated = {int(k): dict(v) for k, v in saved["evaluated"].items()}
            self.skipped = {int(k): str(v) for k, v in saved["skipped"].items()}
            # (a record of an older side-car has none: its skips are read once more)
            self.stamps = {int(k): str(v) for k, v in saved.get("skipped_files", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError, tf.errors.OpError) as error:
            logging.warning("tputrain: ignoring the damaged %s (%s): its checkpoints are "
                            "evaluated again", self.path, error)

    def done(self) -> set[int]:
        """Steps handled: evaluated or skipped."""
        return set(self.evaluated) | set(self.skipped)

    def handled(self, path: str) -> bool:
        """Whether listed checkpoint `path` needs no reading: its step is evaluated, or
        skipped and its files are the ones skipped."""
        step = checkpoint_step(path)
        return step in self.evaluated or (
            step in self.skipped and self.stamps.get(step) == checkpoint_stamp(path))

    def add(self, step: int, metrics: Metrics | None = None, skipped: str | None = None,
            stamp: str = "") -> None:
        """Records `step` evaluated (`metrics`), or skipped (`skipped`: why) with the
        `checkpoint_stamp` of the files it had before they were read."""
        if metrics is not None:
            self.evaluated[step] = dict(metrics)
            self.skipped.pop(step, None)
            self.stamps.pop(step, None)
        else:
            self.skipped[step] = skipped or "skipped"
            self.stamps[step] = stamp
        text = json.dumps({name: {str(k): v for k, v in sorted(entries.items())}
                           for name, entries in (("evaluated", self.evaluated),
                                                 ("skipped", self.skipped),
                                                 ("skipped_files", self.stamps))}, indent=1)
        write_atomically(self.path, text)


def checkpoint_stamp(path: str) -> str:
    """A digest of checkpoint `path`'s files, each by name and `file_stamp` (size,
    modification time, first bytes; "" when it has none): another value is another
    write of that step."""
    try:
        files = sorted(tf.io.gfile.glob(f"{path}.*"))
    except tf.errors.OpError:  # gone while looked at
        return ""
    if not files:
        return ""
    text = json.dumps([[os.path.basename(name), *file_stamp(name).values()] for name in files])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def evaluate_checkpoints(view: RunView, step: int | None = None, continuous: bool = False,
                         poll_seconds: float = 10.0, timeout: float | None = 3600.0,
                         until_step: int | None = None,
                         on_result: Callable[[int, Metrics], None] | None = None
                         ) -> dict[int, Metrics]:
    """Evaluates checkpoints of `trainer.model_dir`; returns {step: metrics}.

    Args:
      view: a `ReadOnlyTrainer` beside a training process; a `Trainer` in the
        process that trains (its weights and step are then the last checkpoint read).
      step: the checkpoint of this step; None: the latest (not with `continuous`).
      continuous: evaluate each new checkpoint once, in step order, until one at
        step >= `until_step` (see the module docstring).
      poll_seconds: continuous: how often the checkpoint list is read.
      timeout: continuous: raise `NoNewCheckpointError` after this many seconds
        without a new checkpoint; None waits for ever.
      until_step: continuous: the last step; None: `trainer.train_steps`.
      on_result: called with (step, metrics) as each checkpoint is evaluated, so a
        side-car's output appears per checkpoint, not at its end (the CLI prints).
    """
    view = view_of(view)  # a Trainer or a view
    _check_arguments(step, continuous, poll_seconds, timeout, until_step)
    view.checkpointer.sync()  # an async save in flight in this process lands first
    path = None if continuous else _one_checkpoint(view, step)  # nothing written if none
    eval_dir = RunDirectory(view.model_dir).eval
    _check_writable(eval_dir)
    try:
        lock_model_dir(eval_dir)
    except ModelDirInUseError as error:
        raise ModelDirInUseError(f"another evaluation writes {eval_dir}: {error}") from None
    try:
        record = EvalRecord(view.model_dir)
        if path is None:
            last = view.plan.options.train_steps if until_step is None else until_step
            return _follow(view, record, poll_seconds, timeout, last, on_result)
        path = _read_one(view, path, fall_back=step is None)
        logs = _evaluate_read(view, path, record)
        if on_result is not None:
            on_result(checkpoint_step(path), logs)
        return {checkpoint_step(path): logs}
    finally:
        view.progress.close()  # restates the later eval points a lower step hid
        release_model_dir(eval_dir)


def _check_writable(eval_dir: str) -> None:
    """eval/ takes the summaries and the record: one that takes no writes (a read-only
    model_dir) is a `ModelDirError` before any evaluation, not a failure of the
    summary writer's thread after the first."""
    try:
        tf.io.gfile.makedirs(eval_dir)
        write_probe(eval_dir)
    except (tf.errors.OpError, OSError) as error:
        kind, text = write_failure(error)
        what, fix = {"not a directory": ("is not a directory", "move that file away"),
                     "full": ("is full", "free some space")}.get(
            kind, ("is not writable", "fix its permissions, or evaluate a copy of the run "
                                      "in a writable folder"))
        raise ModelDirError(f"{eval_dir} {what} ({text}): tputrain eval writes its summaries "
                            f"and {RECORD_FILE} there; {fix}") from None


def _check_arguments(step: int | None, continuous: bool, poll_seconds: float,
                     timeout: float | None, until_step: int | None) -> None:
    check_int("evaluate_checkpoints", "step", step, 0, allow_none=True)
    check_int("evaluate_checkpoints", "until_step", until_step, 0, allow_none=True)
    if continuous and step is not None:
        raise ValueError("evaluate_checkpoints: pass step or continuous=True, not both")
    if not poll_seconds > 0:
        raise ValueError(f"evaluate_checkpoints.poll_seconds must be > 0, got {poll_seconds}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"evaluate_checkpoints.timeout must be > 0 or None, got {timeout}")


def _one_checkpoint(view: RunView, step: int | None) -> str:
    """The listed checkpoint of `step` (None: the latest); ValueError if there is none."""
    listed = list_checkpoints(checkpoint_dir(view)).paths
    if not listed:
        raise ValueError(f"no checkpoint in {checkpoint_dir(view)}: train first")
    if step is None:
        return listed[-1]
    found = [p for p in listed if checkpoint_step(p) == step]
    if not found:
        raise ValueError(f"no checkpoint of step {step} in {checkpoint_dir(view)}: it has "
                         f"steps {[checkpoint_step(p) for p in listed]}")
    return found[0]


def _read_one(view: RunView, path: str, fall_back: bool) -> str:
    """Reads `path`, or with `fall_back` (the latest was asked for) the newest
    readable checkpoint up to it, as training resumes; returns the one read. An
    unreadable checkpoint is a ValueError naming it."""
    directory = checkpoint_dir(view)
    if fall_back:
        older = [p for p in list_checkpoints(directory).paths
                 if checkpoint_step(p) <= checkpoint_step(path)] or [path]
        try:
            return read_newest(older, lambda p: read_checkpoint(view, p), directory)[0]
        except RuntimeError as error:
            raise ValueError(str(error)) from None
    try:
        read_checkpoint(view, path)
    except UNREADABLE_ERRORS as error:
        if isinstance(error, CheckpointMismatchError):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(f"cannot read the checkpoint {path} ({type(error).__name__}: "
                         f"{first}): its files are damaged or truncated; evaluate another "
                         "step (--step)") from None
    return path


def _evaluate_read(view: RunView, path: str, record: EvalRecord) -> Metrics:
    """Evaluates the weights just read (summaries at their step) and records them."""
    logs = view.evaluate_weights()
    record.add(checkpoint_step(path), logs)
    return logs


def _evaluate_if_readable(view: RunView, path: str, record: EvalRecord) -> Metrics | None:
    """Evaluates `path`; a checkpoint gone or unreadable is skipped (warned, recorded
    with its files' stamp, taken before reading: a write after it is read again)."""
    stamp = checkpoint_stamp(path)
    try:
        read_checkpoint(view, path)
    except CheckpointMismatchError:
        raise
    except (tf.errors.OpError, ValueError, IndexError) as error:  # as restore_latest
        if path not in list_checkpoints(checkpoint_dir(view)).paths:
            why = ("no longer listed when read: deleted by keep-N rotation "
                   "(Trainer.keep_checkpoints) or moved aside as damaged")
        else:
            why = f"unreadable ({type(error).__name__}: {str(error).strip().splitlines()[0]})"
        logging.warning("tputrain: skipped checkpoint %s: %s", path, why)
        record.add(checkpoint_step(path), skipped=why, stamp=stamp)
        return None
    return _evaluate_read(view, path, record)


def _follow(view: RunView, record: EvalRecord, poll_seconds: float,
            timeout: float | None, until_step: int,
            on_result: Callable[[int, Metrics], None] | None = None) -> dict[int, Metrics]:
    """Continuous mode: each new listed checkpoint once, in step order, to `until_step`."""
    directory, results = checkpoint_dir(view), {}
    logging.info("tputrain: evaluating each new checkpoint in %s until step %d", directory,
                 until_step)
    if record.done():  # an earlier side-car's, or a one-off `tputrain eval`'s
        logging.info("tputrain: already evaluated or skipped, not again: %s (in %s; delete "
                     "it to evaluate them again)", _steps(record.done()), record.path)
    last_new = time.monotonic()
    while True:  # a skipped step saved again (other files) is read again
        pending = [p for p in list_checkpoints(directory).paths if not record.handled(p)]
        if not pending and max(record.done(), default=-1) >= until_step:
            break
        for path in sorted(pending, key=checkpoint_step):
            logs = _evaluate_if_readable(view, path, record)
            if logs is not None:
                results[checkpoint_step(path)] = logs
                if on_result is not None:
                    on_result(checkpoint_step(path), logs)
        if pending:
            last_new = time.monotonic()
        elif timeout is not None and time.monotonic() - last_new > timeout:
            _say_skipped(record)
            raise NoNewCheckpointError(_timeout_message(directory, record, timeout, until_step),
                                       results)
        else:
            time.sleep(poll_seconds)
    _say_skipped(record)
    return results


def _say_skipped(record: EvalRecord) -> None:
    """The end of a side-car: the steps it could not evaluate, and why."""
    if not record.skipped:
        return
    reasons: dict[str, set[int]] = {}
    for step, why in record.skipped.items():
        reasons.setdefault(why, set()).add(step)
    logging.warning("tputrain: not evaluated: %s (recorded in %s; a checkpoint saved again at "
                    "such a step is evaluated when this command runs again)",
                    "; ".join(f"{_steps(steps)} ({why})" for why, steps in reasons.items()),
                    record.path)


def _steps(steps: set[int]) -> str:
    ordered = [str(step) for step in sorted(steps)]
    if len(ordered) > 8:  # a long run's record: its ends and how many
        return f"{len(ordered)} steps ({', '.join(ordered[:3])}, ..., {', '.join(ordered[-2:])})"
    return ("step " if len(ordered) == 1 else "steps ") + ", ".join(ordered)


def _timeout_message(directory: str, record: EvalRecord, timeout: float, until: int) -> str:
    last = max(record.done(), default=None)
    seen = f"the last was step {last}" if last is not None else "none appeared"
    return (f"no new checkpoint in {directory} for {timeout:g} s ({seen}; waiting for step "
            f"{until}): the training process has stopped or saves less often than the "
            "timeout; rerun to carry on (evaluated steps are not evaluated again)")
