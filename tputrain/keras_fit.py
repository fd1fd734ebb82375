"""`tputrain.fit`: a compiled Keras model trained by the Trainer in one call.

The few-lines path: `tputrain.fit(model, train_data, eval_data, model_dir=...,
steps=...)` builds a `KerasTask` and a `Trainer` (strategy, compiled host loops,
exact-resume checkpoints, guard, progress) and runs Keras callbacks through
`KerasCallbacks`. Rerunning the same call resumes from model_dir's latest checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tputrain.actions import Action
from tputrain.checkpointing.atomic import atomic_path
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.runtime.context import learning_rate
from tputrain.config.parsing import without_gin_notes
from tputrain.actions.keras_callbacks import KerasCallbacks
from tputrain.keras_task import KerasTask
from tputrain.trainer import Trainer

FINAL_WEIGHTS = RunDirectory.FINAL_WEIGHTS  # the callbacks' final weights, when not the last step's


def fit(model: keras.Model | Callable[[], keras.Model], train_data: Any, eval_data: Any = None,
        *, model_dir: str, steps: int, batch_size: int | None = None,
        eval_every: int | None = None, callbacks: Sequence[keras.callbacks.Callback] = (),
        shuffle: bool = True, actions: Sequence[Action] = (),
        task: Callable[..., KerasTask] = KerasTask, **trainer_options: Any) -> dict[str, float]:
    """Trains a compiled Keras model for `steps` optimizer steps; returns the final
    evaluation's metrics ({"loss": ..., metric names: ...}).

    Args:
      model: a compiled `keras.Model`, or a function building and compiling one
        (`KerasTask`). A model passed in gets the trained weights back, as `fit` does.
      train_data, eval_data, batch_size, shuffle: as `KerasTask` takes them; the global
        batch is `batch_size` or the dataset's own batch size.
      model_dir: checkpoints, logs and TensorBoard events; a rerun resumes from it.
      steps: total optimizer steps (`Trainer.train_steps`).
      eval_every: evaluate every N steps (a Keras "epoch" for the callbacks).
      callbacks: `keras.callbacks.Callback`s, run by `KerasCallbacks`.
      actions: tputrain actions (e.g. `tputrain.Export()`), after the callbacks.
      task: the Task's class: `KerasTask` or a subclass (one that overrides `train_step`
        ports a model's own `train_step`, docs/tasks.md); called with `KerasTask`'s
        arguments.
      **trainer_options: any other `Trainer` argument (strategy, steps_per_loop, ...).
    """
    keras_task = task(model, train_data, eval_data, batch_size=batch_size, shuffle=shuffle,
                      seed=trainer_options.get("seed", 0), epoch_steps=eval_every)
    adapters = [KerasCallbacks(callbacks)] if callbacks else []
    try:
        trainer = Trainer(keras_task, model_dir, train_steps=steps, eval_every=eval_every,
                          global_batch_size=keras_task.global_batch_size,
                          actions=[*adapters, *actions], **trainer_options)
    except Exception as error:  # pylint: disable=broad-except  (re-raised)
        original = without_gin_notes(error)  # fit takes no gin config: no gin note
        if original is error:
            raise
        raise original from original.__cause__
    logs = trainer.train()
    if adapters and adapters[0].weights_changed:  # e.g. EarlyStopping(restore_best_weights)
        logs = trainer.evaluate_weights()  # the metrics of the model returned
        if trainer.is_chief:
            save_final_weights(trainer.model, model_dir)
    if isinstance(model, keras.Model):
        model.set_weights(trainer.model.get_weights())
        carry_optimizer(model.optimizer, trainer.optimizer)
    return logs


def save_final_weights(model: keras.Model, model_dir: str) -> str:
    """`model_dir/final.weights.h5` (`model.load_weights` reads it): the weights the
    callbacks left at the end when they differ from the last checkpoint's. Written
    whole, then renamed into place (any `tf.io.gfile` path)."""
    path = RunDirectory(model_dir).final_weights
    with tempfile.TemporaryDirectory(prefix="tputrain-final-") as local, atomic_path(path) as temp:
        written = os.path.join(local, FINAL_WEIGHTS)
        model.save_weights(written)  # h5 needs a local file: copied beside `path`, renamed
        tf.io.gfile.copy(written, temp, overwrite=True)
    return path


def carry_optimizer(user: keras.optimizers.Optimizer, trained: keras.optimizers.Optimizer
                    ) -> None:
    """The user's optimizer as `fit` leaves it: the learning rate the run ended with (a
    callback's cut included; a schedule stays as it is) and the step count."""
    user = getattr(user, "inner_optimizer", user)
    try:
        user.learning_rate = learning_rate(trained)
    except TypeError:  # built with a LearningRateSchedule: nothing to carry
        pass
    user.iterations.assign(int(keras.ops.convert_to_numpy(trained.iterations)))
