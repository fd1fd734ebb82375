"""`tputrain.fit`: a compiled Keras model trained by the Trainer in one call.

The few-lines path: `tputrain.fit(model, train_data, eval_data, model_dir=...,
steps=...)` builds a `KerasTask` and a `Trainer` (strategy, compiled host loops,
exact-resume checkpoints, guard, progress) and runs Keras callbacks through
`KerasCallbacks`. Rerunning the same call resumes from model_dir's latest checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras

from tputrain.actions import Action
from tputrain.config import without_gin_notes
from tputrain.keras_callbacks import KerasCallbacks
from tputrain.keras_task import KerasTask
from tputrain.trainer import Trainer


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
    if isinstance(model, keras.Model):
        model.set_weights(trainer.model.get_weights())
    return logs
