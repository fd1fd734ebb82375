"""What the chief checks before a run's first write to model_dir.

A run that cannot finish should fail before it writes anything: each eval set's
features must be what the model takes, the checkpoint already there must be this
model's, each action's own sources must be there
(`Action.preflight`), and model_dir must be writable with room for the kept
checkpoints (the iterator state included) and a best copy (not for a finished
run's rerun, which saves none), and the kept
best checkpoint must be whole (copied again from checkpoints/ if not). Then the directory is
locked: one run per model_dir.
"""

from __future__ import annotations

from tputrain.actions.best import BestCheckpoint, tidy_best
from tputrain.checkpointing.files import step_of
from tputrain.runtime.context import ActionContext
from tputrain.fault_tolerance.lock import lock_model_dir
from tputrain.task import overrides
from tputrain.runtime.trainable_change import lora_checkpoint_awaits_lora
from tputrain.runtime.validate import (check_eval_features, check_model_dir, iterator_state_bytes,
                               variable_bytes)


def preflight(context: ActionContext) -> None:
    """Runs the checks above on the chief (inputs were checked before), then locks."""
    if not overrides(context.task, "eval_step"):  # the default eval feeds the model them
        inputs = context.inputs
        check_eval_features(context.model, inputs.micro_batch_spec()[0], {
            split: inputs.dataset(split).element_spec[0] for split in context.options.eval_splits})
    if not lora_checkpoint_awaits_lora(context.model, context.checkpointer.latest):
        context.checkpointer.check_compatible()  # else at train(), after enable_lora
    for action in context.actions:  # e.g. InitCheckpoint: its source and shapes
        action.preflight(context)
    size = 0 if finished(context) else checkpoint_bytes(context)
    kept_best = [a for a in context.actions if isinstance(a, BestCheckpoint)]
    for action in kept_best:  # a copy a kill or a full disk cut short takes no room
        tidy_best(action.directory_of(context))
        action.repair(context)  # a lost or damaged best: copied again, or the run stops
    check_model_dir(context.model_dir, size, keep=context.checkpointer.keep,
                    best_copy=bool(kept_best))
    lock_model_dir(context.model_dir)  # one run per model_dir, until this process ends


def finished(context: ActionContext) -> bool:
    """The latest checkpoint is at `train_steps` or past it: a rerun (a scheduler's retry
    of a job that succeeded) trains and saves nothing, so it needs no room for
    checkpoints (each save checks the room again, should one come)."""
    latest = context.checkpointer.latest
    return latest is not None and step_of(latest) >= context.options.train_steps


def checkpoint_bytes(context: ActionContext) -> int:
    """The size of one checkpoint: the variables, and where a checkpoint holds it (host
    mode, an input that is not positional) the data iterator's state (shuffle buffers
    and all), measured, unless the Task's train data must not be read before training
    (`Task.probe_train_inputs`)."""
    size = variable_bytes(context.model.variables) + variable_bytes(context.optimizer.variables)
    inputs = context.inputs
    if inputs.saved_state(None) and inputs.task.probe_train_inputs:
        size += iterator_state_bytes(inputs.fetch_groups(inputs.train_dataset))
    return size
