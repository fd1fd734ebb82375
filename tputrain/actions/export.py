"""`Export`: the action that exports a SavedModel at the end of training (and at each
new best, if asked), through `tputrain.serving.export`."""

from __future__ import annotations

from typing import Mapping

from absl import logging

from tputrain.actions.base import Action
from tputrain.actions.best import BestCheckpoint, best_record
from tputrain.checkpointing.run_directory import ModelDirError, RunDirectory
from tputrain.core.checks import check_bool
from tputrain.observe import goodput
from tputrain.runtime.context import ActionContext
from tputrain.serving.export import (checkpoint_to_export, export_checkpoint, export_complete,
                                     export_destination, export_folder_message,
                                     signature_inputs)

# How a `tputrain run` (which has no --export_dir flag) chooses the export folder.
EXPORT_DIR_BINDING = "--gin_param=\"Export.export_dir='DIR'\""


class Export(Action):
    """At the end of training, exports a SavedModel (`export_checkpoint`): the best
    checkpoint if a `BestCheckpoint` action is set, else the last one. Chief only.

    Args:
      export_dir: the SavedModel's folder; None: $AIP_MODEL_DIR on Vertex AI, else
        model_dir/export/<step>.
      examples: also write the `serving_examples` signature (tf.Example strings)
        when the Task has a feature spec.
      every_best: also export after each eval that set a new best (needs a
        `BestCheckpoint` action listed before this one): a server watching
        model_dir/export/ serves the best model while training goes on, at the
        cost of one export per improvement.
    """

    def __init__(self, export_dir: str | None = None, examples: bool = True,
                 every_best: bool = False):
        self.export_dir = export_dir
        self.examples = examples
        self.every_best = check_bool("Export", "every_best", every_best)
        self.path: str | None = None  # where the last export went
        self.exported_step: int | None = None

    def preflight(self, context: ActionContext) -> None:
        """Features no signature can take fail now, not after the last step."""
        signature_inputs(context.model, context.inputs.micro_batch_spec()[0])

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        if self.every_best and self._best(context) is None:
            raise ValueError("Export(every_best=True) needs a BestCheckpoint action listed "
                             "before it in Trainer.actions")

    def _best(self, context: ActionContext) -> BestCheckpoint | None:
        actions = context.actions[:context.actions.index(self)] if self in context.actions else []
        return next((a for a in actions if isinstance(a, BestCheckpoint)), None)

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        best = self._best(context) if self.every_best else None
        if best is not None and best.step == step and self.exported_step != step:
            self._export(context)
            self.exported_step = step

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        best = self._best(context)
        if best is None or best.step is None or best.step != self.exported_step:
            self._export(context)  # (the best was exported when it was set)

    def _pending(self, context: ActionContext) -> str | None:
        """Where the export of the checkpoint to export goes, if it is not there whole."""
        try:
            _, step, _ = checkpoint_to_export(context)
        except ValueError:
            return None  # no checkpoint: export_checkpoint says so when called
        path = export_destination(context, step, self.export_dir)
        return None if _exported(context, path, step) else path

    def eval_recorded(self, context: ActionContext, step: int) -> bool:
        """every_best: the new best of `step` is exported (a kill can fall before it).
        Read from the files on every host: all must agree to evaluate again."""
        best = self._best(context) if self.every_best else None
        record = best_record(context.model_dir, best.directory_of(context)) if best else None
        if record is None or int(record["step"]) != step:
            return True
        return self._pending(context) is None

    def end_done(self, context: ActionContext, step: int) -> bool:
        return not context.is_chief or self._pending(context) is None

    def _export(self, context: ActionContext) -> None:
        """Exports unless that export is on disk whole already (a rerun, an earlier best)."""
        if not context.is_chief:
            return
        checkpoint, step, _ = checkpoint_to_export(context)
        path = export_destination(context, step, self.export_dir)
        if _exported(context, path, step):
            logging.info("tputrain: %s is exported already (%s)", checkpoint, path)
            self.path = path
            return
        with goodput.timed(context, "export"):
            try:
                self.path = export_checkpoint(context, export_dir=self.export_dir,
                                              examples=self.examples)
            except OSError as error:  # a full disk, a read-only folder: the run is trained
                raise ModelDirError(
                    f"{export_folder_message(error, EXPORT_DIR_BINDING)}; training is done "
                    f"(step {step} is saved): then rerun the same command, which trains "
                    "nothing and writes the export") from None


def _exported(context: ActionContext, path: str, step: int) -> bool:
    """Whether the export of `step` is whole at `path`; a folder not named by the step
    ($AIP_MODEL_DIR, an `export_dir`) cannot say which step it holds: written again."""
    return (path == RunDirectory(context.model_dir).export_version(step)
            and export_complete(path))
