"""Keras callbacks run by the Trainer: an Action calling them at loop and eval ends.

A multi-step loop has no per-batch host call, so the hooks map as follows (an
*epoch* is the span between two evaluations, `eval_every` steps; the whole run
when `eval_every` is None):

- `on_train_begin`: once per `train()`, after the restore;
- `on_epoch_begin(step // eval_every)`: at the start and after each evaluation;
- `on_train_batch_end(last step, loop logs)`: after each compiled loop;
- `on_test_begin`, `on_test_end(eval logs)`: both after each evaluation;
- `on_epoch_end(epoch, logs)`: after each evaluation, the last loop's train
  metrics and the eval metrics as `val_*`, as `fit` gives them;
- `on_train_end(final eval logs)`: when `train()` ends.

Per-batch hooks (`on_train_batch_begin`, `on_test_batch_*`, `on_predict_*`) are
never called. Setting `model.stop_training` stops the run at the next loop end
(after its save). `model.optimizer` is the Trainer's optimizer: a learning rate
a callback sets is read by the compiled step and saved and restored with every
checkpoint (`owns_learning_rate`). A callback's own state (ReduceLROnPlateau's
wait count, CSVLogger's file) is not checkpointed.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import keras

from tputrain.actions import Action
from tputrain.context import ActionContext


_LOOP_ONLY = ("learning_rate",)  # fit's epoch logs hold only what the metrics say


class _CallbackModel:
    """What callbacks see as `self.model`: the trained model, with the Trainer's
    optimizer and a `stop_training` flag (the model itself is not compiled)."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "stop_training", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("optimizer", "stop_training"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._model, name, value)


class KerasCallbacks(Action):
    """Runs `keras.callbacks.Callback`s at the Trainer's loop and eval boundaries
    (the mapping is in this module's docstring and docs/tasks.md)."""

    owns_learning_rate = True  # e.g. ReduceLROnPlateau: its value is the checkpoint's

    def __init__(self, callbacks: Sequence[keras.callbacks.Callback]):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, keras.callbacks.Callback):
                raise TypeError(f"KerasCallbacks takes keras.callbacks.Callback instances, "
                                f"got {type(callback).__name__}")
        self._list: keras.callbacks.CallbackList | None = None
        self._model: _CallbackModel | None = None
        self._train_logs: dict[str, float] = {}
        self._metric_names: set[str] = set()

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        self._model = _CallbackModel(context.model, context.optimizer)
        every = context.plan.eval_every or context.plan.train_steps
        self._list = keras.callbacks.CallbackList(
            self.callbacks, model=self._model, verbose=0, steps=every,
            epochs=-(-context.plan.train_steps // every))
        self._metric_names = {"loss", *(m.name for m in context.train_metrics)}
        self._list.on_train_begin()
        self._list.on_epoch_begin(step // every)
        self._stop_if_asked(context)

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        self._train_logs = {k: v for k, v in logs.items()
                            if k in self._metric_names and k not in _LOOP_ONLY}
        self._list.on_train_batch_end(step - 1, dict(logs))
        self._stop_if_asked(context)

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self._list is None:  # Trainer.evaluate(), outside train()
            return
        every = context.plan.eval_every or context.plan.train_steps
        self._list.on_test_begin()  # no hook runs before an evaluation: both after it
        self._list.on_test_end(dict(logs))
        epoch_logs = dict(self._train_logs)
        epoch_logs.update({f"val_{k}": v for k, v in logs.items()})
        self._list.on_epoch_end(max(step - 1, 0) // every, epoch_logs)
        if step < context.plan.train_steps and not self._model.stop_training:
            self._list.on_epoch_begin(step // every)
        self._stop_if_asked(context)

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self._list is not None:
            self._list.on_train_end(dict(logs))

    def _stop_if_asked(self, context: ActionContext) -> None:
        if self._model.stop_training:
            context.stop()
