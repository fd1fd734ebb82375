"""LoRA enabled (or layers frozen or unfrozen) on `trainer.model` after the Trainer built it.

The Trainer built its optimizer slots, EMA averages and checkpoint for the trainable
variables the model had then. `Trainer.train()` and `evaluate()` adopt a changed set
before they restore: a new optimizer from `Task.build_optimizer()` built for the new
trainable variables only, a new EMA of them, a checkpoint that holds the new
variables, and the train and eval steps traced again (`TrainableSet`, which the
Trainer is). What cannot be made right is refused
in one line that names the fix:

* new variables made outside `trainer.strategy.scope()` (not mirrored on the replicas);
* a checkpoint in model_dir written before the change (its optimizer slots are the
  old trainable set's): train in a new model_dir, starting from it with
  `tputrain.InitCheckpoint`;
* a LoRA checkpoint read by a model without LoRA (a rerun that forgot
  `enable_lora`): enable it before `train()`, as the run that wrote it did.

See docs/keras_hub.md.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.integrity import CheckpointMismatchError, object_graph
from tputrain.checkpointing.recovery import UNREADABLE_ERRORS
from tputrain.optim.ema import build_average
from tputrain.runtime.keras_clone import has_lora
from tputrain.loop.eval_sets import EvalSets
from tputrain.runtime.model_state import _BUILT_FOR, ModelState
from tputrain.runtime.validate import reading_input
from tputrain.precision import wrap_optimizer_for_policy
from tputrain.precision.policy import run_policy
from tputrain.task import Task

LORA_FACTOR = "lora_kernel_a"  # the attribute Keras gives a LoRA layer's first factor


def trainable_changed(model: keras.Model) -> bool:
    """Whether `model`'s trainable variables differ from those its optimizer was built for."""
    built = _BUILT_FOR.get(model)
    return built is not None and built != tuple(id(v) for v in model.trainable_variables)


def rebuilt_optimizer(task: Task, strategy: tf.distribute.Strategy,
                      model: keras.Model) -> keras.optimizers.Optimizer:
    """A new optimizer from `task`, built for `model`'s trainable variables only; a
    ValueError naming the fix for variables made outside the strategy's scope."""
    outside = [v.path for v in model.trainable_variables  # a Keras variable holds a TF one
               if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))]
    if outside:
        raise ValueError(
            f"{len(outside)} trainable variable(s), e.g. {outside[0]}, were made outside the "
            "Trainer's strategy: enable LoRA within `with trainer.strategy.scope():` "
            "(e.g. trainer.model.backbone.enable_lora(rank))")
    with strategy.scope():
        optimizer = wrap_optimizer_for_policy(task.build_optimizer())
        if getattr(optimizer, "built", False):
            raise ValueError(f"{type(task).__name__}.build_optimizer returned an optimizer "
                             "that is already built: return a new one each call")
        optimizer.build(model.trainable_variables)
    _BUILT_FOR[model] = tuple(id(v) for v in model.trainable_variables)
    return optimizer


def checkpoint_has_lora(path: str) -> bool:
    """Whether the checkpoint at `path` holds LoRA factors (its object graph names them)."""
    try:
        graph = object_graph(tf.train.load_checkpoint(path))
    except UNREADABLE_ERRORS + (KeyError,):  # a damaged one is recovery's to handle
        return False
    return any(child.local_name == LORA_FACTOR for node in graph.nodes for child in node.children)


def lora_mismatch(error: CheckpointMismatchError, model: keras.Model, adopted: bool,
                  path: str | None, model_dir: str) -> CheckpointMismatchError:
    """`error` (a checkpoint that does not fit the model) with the LoRA fix when LoRA
    explains it: a checkpoint written before LoRA was enabled on the built model, or a
    LoRA checkpoint and a model without LoRA."""
    if path is None:
        return error
    if adopted and has_lora(model) and not checkpoint_has_lora(path):
        return CheckpointMismatchError(
            f"checkpoint {path} was written before LoRA was enabled on the model (its "
            "optimizer slots are the whole model's): train the LoRA model in a new model_dir, "
            f"starting from this one with actions=[tputrain.InitCheckpoint({model_dir!r})]")
    if not has_lora(model) and checkpoint_has_lora(path):
        return CheckpointMismatchError(
            f"checkpoint {path} holds LoRA factors and the model has no LoRA: enable LoRA "
            "on trainer.model before train() (within trainer.strategy.scope(), e.g. "
            "trainer.model.backbone.enable_lora(rank)) as the run that wrote it did")
    return error


def lora_checkpoint_awaits_lora(model: keras.Model, latest: str | None) -> bool:
    """Whether the latest checkpoint holds LoRA factors the model does not have yet: the
    Trainer's pre-flight leaves the check to `train()`, after the user's `enable_lora`."""
    return latest is not None and not has_lora(model) and checkpoint_has_lora(latest)



class TrainableSet:
    """The Trainer's part that depends on the model's trainable set: its train and eval
    steps, and their rebuild (with the optimizer, EMA and checkpoint) when the set
    changed since (LoRA enabled on `trainer.model`), before any restore."""

    _adopted = False  # a changed set was adopted: a pre-change checkpoint cannot be read
    _evaluator: Any
    def _build_evaluator(self) -> None:
        """The eval sets, traced for the model as it is."""
        self._evaluator = EvalSets(self.task, self.model, self.eval_metrics, self.inputs,
                                   self.eval_steps, self.agree, self.eval_splits)

    def _count_eval_sets(self) -> None:
        """Reads each eval set not counted yet to its end now, for the step count its
        first evaluation needs (kept by its evaluator): called when `train()` is about
        to take its first step, so a corrupt record past the first batch (which
        `check_splits` reads) fails then, not at the first evaluation with the steps
        since the last checkpoint lost; a Trainer built and never trained (diagnose,
        predict, export) reads no eval set to its end. With `eval_steps` nothing more
        is read."""
        for split, evaluator in self._evaluator.evaluators.items():
            with reading_input(split, "before training"):
                evaluator.count()

    def _adopt_trainable_change(self) -> bool:
        """LoRA enabled (or layers frozen) on self.model since the optimizer was built: a
        new optimizer, EMA, checkpoint and steps for the new trainable set, before any
        restore; whether a changed set was ever adopted."""
        if not trainable_changed(self.model):
            return self._adopted
        self.checkpointer.sync()
        with run_policy(self.precision):  # mixed_float16's loss scaling, as at the build
            self.optimizer = rebuilt_optimizer(self.task, self.strategy, self.model)
        self.ema = build_average(self.strategy, self.model, self.options.ema_decay)
        self.checkpointer = self._new_checkpointer(self.inputs.saved_state(self.train_iterator))
        context = self.context
        context.optimizer, context.ema, context.checkpointer = (
            self.optimizer, self.ema, self.checkpointer)
        self._evaluator.close()
        self._build_evaluator()
        self._build_step(ModelState(self.model, self.optimizer, self.train_metrics,
                                    self.eval_metrics, self.step, self.guard))
        self._train_loop_fn, self._replica_stats, self._adopted = None, None, True
        logging.info("tputrain: the model's trainable variables changed after the Trainer was "
                     "built: %d trainable now; optimizer, EMA and checkpoint rebuilt for them",
                     len(self.model.trainable_variables))
        return True

    def _restore_latest(self) -> str | None:
        """The latest checkpoint restored after adopting a changed trainable set; a
        mismatch that LoRA explains names the LoRA fix."""
        adopted = self._adopt_trainable_change()
        try:
            return self.checkpointer.restore_latest()
        except CheckpointMismatchError as error:
            raise lora_mismatch(error, self.model, adopted, self.checkpointer.latest,
                                self.model_dir) from error

