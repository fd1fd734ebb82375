"""`EarlyStopping`: stops a run when one evaluation metric stops improving; its record
of every evaluation resumes with the checkpoint (`tputrain/actions/best.py` says how
both metric-watching actions survive a kill)."""

from __future__ import annotations

from typing import Any, Mapping

from absl import logging

from tputrain.actions.base import Action
from tputrain.actions.best import Watch, check_watched, read_record, write_json
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.core.checks import check_int
from tputrain.runtime.context import ActionContext

EARLY_STOPPING_FILE = RunDirectory.EARLY_STOPPING  # in model_dir/checkpoints/


def early_stopping_path(model_dir: str) -> str:
    return RunDirectory(model_dir).early_stopping


def read_early_stopping(model_dir: str) -> dict[str, Any] | None:
    """The record of evaluations, or None; a damaged one stops the run naming the fix
    (taken for none, an early-stopped run trained on to train_steps)."""
    return read_record(
        early_stopping_path(model_dir), _check_evals,
        "put it back from a copy of this model_dir, or delete it to count evaluations "
        "from the restored step on")


def _check_evals(record: Mapping[str, Any]) -> None:
    """The watch and {"<step>": value} (ValueError if not)."""
    check_watched(record)
    evals = record.get("evals")
    if not isinstance(evals, dict) or not all(
            step.isdigit() and isinstance(value, (int, float)) for step, value in evals.items()):
        raise ValueError("evals is not {\"<step>\": value}")


class EarlyStopping(Action):
    """Stops training once the eval `metric` has not improved (by more than
    `min_delta`) for `patience` evaluations in a row. The run then saves, evaluates
    no more and ends as at `train_steps` (actions' on_train_end, export).

    Args:
      metric: an eval metric, "loss" or "eval/loss" (the same), "accuracy", ...;
        with named eval sets (`Trainer.eval_splits`) "<set>/<metric>".
      mode: "min" (loss) or "max" (accuracy): which way is better.
      patience: evaluations without improvement before stopping.
      min_delta: a change smaller than this is no improvement.
    """

    def __init__(self, metric: str = "loss", mode: str = "min", patience: int = 3,
                 min_delta: float = 0.0):
        self.watch = Watch("EarlyStopping", metric, mode, min_delta)
        self.patience = check_int("EarlyStopping", "patience", patience, 1)
        self.evals: dict[int, float] = {}  # step -> value, every evaluation of this run
        self.stopped_at: int | None = None
        self.loaded = False

    def preflight(self, context: ActionContext) -> None:
        self.watch.check(context)
        read_early_stopping(context.model_dir)  # a damaged record stops before a step

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        self._load(context, step)
        if self.stopped_at is not None:
            logging.info("tputrain: early stopping: this run stopped at step %d (%s did not "
                         "improve for %d evaluations); not training further", self.stopped_at,
                         self.watch.key, self.patience)
            context.stop()

    def _load(self, context: ActionContext, step: int) -> None:
        """Reads back the evaluations up to the restored `step` and decides again."""
        record = read_early_stopping(context.model_dir) or {}
        self.evals, self.loaded = {}, True
        if (record.get("metric"), record.get("mode")) == (self.watch.key, self.watch.mode):
            self.evals = {int(s): float(v) for s, v in record.get("evals", {}).items()
                          if int(s) <= step}
        self.stopped_at = self.decide()

    def decide(self) -> int | None:
        """The step of the evaluation that ran out of patience, or None."""
        best, waited = None, 0
        for step in sorted(self.evals):
            if self.watch.improved(self.evals[step], best):
                best, waited = self.evals[step], 0
            else:
                waited += 1
                if waited >= self.patience:
                    return step
        return None

    def eval_recorded(self, context: ActionContext, step: int) -> bool:
        if not self.loaded:  # a rerun of a finished run calls no on_train_begin
            self._load(context, step)
        return step in self.evals

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if not self.loaded:  # Trainer.evaluate() outside train()
            self._load(context, step)
        self.evals[step] = self.watch.value(logs)
        if context.is_chief:
            write_json(early_stopping_path(context.model_dir),
                       {"metric": self.watch.key, "mode": self.watch.mode,
                        "evals": {str(s): v for s, v in sorted(self.evals.items())}})
        stopped_at = self.decide()
        if stopped_at is not None and self.stopped_at is None:
            self.stopped_at = stopped_at
            logging.warning("tputrain: early stopping at step %d: %s has not improved for %d "
                            "evaluations", step, self.watch.key, self.patience)
        if stopped_at is not None:
            context.stop()
