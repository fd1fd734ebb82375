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
checkpoint (`owns_learning_rate`: any callback but Keras's rate-neutral ones,
`_RATE_NEUTRAL`, whose list leaves a rerun's rate to the config).

The callbacks carry on over a resume (a kill -9 included): their state
(`keras_callback_state`), the last evaluation they were given and whether they
stopped the run are saved inside every checkpoint and set back after
`on_train_begin`. An evaluation the restored state has not seen (the final one
comes after the last save; a kill can fall between an evaluation and its save) is
given to them again by the Controller (`eval_recorded`); one it has seen is not.
A rerun of a finished run replays the end (`on_train_end`) from that state, so
e.g. EarlyStopping's best weights come back into the model again. A call continuing
the run in the same process (`tputrain.fit` again) takes the state the callbacks
ended with instead, and the learning rate they set at the final evaluation.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import keras
import numpy as np
from absl import logging

from tputrain.actions import Action
from tputrain.runtime.context import ActionContext
from tputrain.actions.keras_callback_state import (CheckpointedState, after_train_begin,
                                           before_train_begin, state_of)


# Keras's callbacks that never set the learning rate: with only these, a rerun's rate
# (the config's) wins over the checkpoint's, as without callbacks.
_RATE_NEUTRAL = tuple(getattr(keras.callbacks, name) for name in (
    "CSVLogger", "TensorBoard", "ModelCheckpoint", "EarlyStopping", "TerminateOnNaN",
    "ProgbarLogger", "History", "RemoteMonitor", "SwapEMAWeights", "BackupAndRestore")
    if hasattr(keras.callbacks, name))
_LOOP_ONLY = ("learning_rate",)  # fit's epoch logs hold only what the metrics say


class _CallbackModel:
    """What callbacks see as `self.model`: the Trainer's optimizer, a `stop_training`
    flag, and what Keras's built-in callbacks read of a model (weights, saving,
    layers, metrics), from the trained model (`model`, not compiled). What a
    callback sets on it (`History` sets `history`) stays here: the user's model is
    left as it is."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.stop_training = False
        self.history: Any = None
        self.train_function = None  # no compiled Keras train function (TensorBoard asks)

    @property
    def layers(self) -> list[keras.layers.Layer]:
        return self.model.layers

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        return self.model.metrics

    @property
    def trainable_variables(self) -> list[keras.Variable]:
        return self.model.trainable_variables

    @property
    def built(self) -> bool:
        return self.model.built

    def get_weights(self) -> list[Any]:
        return self.model.get_weights()

    def set_weights(self, weights: Sequence[Any]) -> None:
        self.model.set_weights(weights)

    def save(self, filepath: str, **kwargs: Any) -> None:
        self.model.save(filepath, **kwargs)

    def save_weights(self, filepath: str, **kwargs: Any) -> None:
        self.model.save_weights(filepath, **kwargs)

    def load_weights(self, filepath: str, **kwargs: Any) -> None:
        self.model.load_weights(filepath, **kwargs)


class KerasCallbacks(Action):
    """Runs `keras.callbacks.Callback`s at the Trainer's loop and eval boundaries
    (the mapping is in this module's docstring and docs/tasks.md)."""

    @property
    def owns_learning_rate(self) -> bool:  # type: ignore[override]
        """Whether a callback may set the rate (ReduceLROnPlateau...): a resume then
        takes the checkpoint's; with only rate-neutral ones the config's wins."""
        return bool(self.learning_rate_setters)

    @property
    def learning_rate_setters(self) -> list[str]:
        """The classes of the callbacks that may set the learning rate: all but Keras's
        own that never do (`_RATE_NEUTRAL`, exactly those classes: a subclass may)."""
        return [type(c).__name__ for c in self.callbacks if type(c) not in _RATE_NEUTRAL]

    def __init__(self, callbacks: Sequence[keras.callbacks.Callback]):
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, keras.callbacks.Callback):
                raise TypeError(f"KerasCallbacks takes keras.callbacks.Callback instances, "
                                f"got {type(callback).__name__}")
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                raise ValueError(
                    "keras.callbacks.BackupAndRestore is not needed and is refused: tputrain's "
                    "checkpoints already resume a run exactly (weights, optimizer, data "
                    "position, the callbacks' state), and the callback would load its older "
                    "backup over the checkpoint a rerun resumes from: remove it")
        self.stops_on_nonfinite = any(isinstance(c, keras.callbacks.TerminateOnNaN)
                                      for c in self.callbacks)
        self._list: keras.callbacks.CallbackList | None = None
        self._model: _CallbackModel | None = None
        self._train_logs: dict[str, float] = {}
        self._metric_names: set[str] = set()
        self._last_eval: int | None = None  # the step of the last evaluation given to them
        self._stopped_at: int | None = None  # the step at which one stopped the run
        self._state = CheckpointedState(self._gather)
        self.weights_changed = False  # by the callbacks' on_train_end (see on_train_end)
        # (step, state, learning rate) at the last end: newer than that step's checkpoint
        self._ended: tuple[int, dict[str, Any], float | None] | None = None

    def checkpoint_state(self) -> CheckpointedState:
        return self._state

    def _gather(self) -> dict[str, Any]:
        """What a checkpoint saves of the callbacks (at the save, on the training thread)."""
        return {"last_eval": self._last_eval, "stopped_at": self._stopped_at,
                "train_logs": self._train_logs,  # the epoch's, for an evaluation given again
                "callbacks": [[type(c).__name__, state_of(c)] for c in self.callbacks]}

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        self._start(context, step)
        every = context.plan.eval_every
        pending = every and step and step % every == 0 and not self._recorded(step)
        if not (pending or self._model.stop_training):  # else the Controller gives them
            self._list.on_epoch_begin(step // (every or context.plan.train_steps))  # its eval
        self._stop_if_asked(context)

    def _start(self, context: ActionContext, step: int) -> None:
        """The callback list, `on_train_begin`, and the restored state set back after it."""
        self._model = _CallbackModel(context.model, context.optimizer)
        every = context.plan.eval_every or context.plan.train_steps
        self._list = keras.callbacks.CallbackList(
            self.callbacks, model=self._model, verbose=0, steps=every,
            epochs=-(-context.plan.train_steps // every))
        self._metric_names = {"loss", *(m.name for m in context.train_metrics)}
        ended_rate = self._ended[2] if self._ended is not None and self._ended[0] == step \
            else None
        states = self._restored(step)
        if ended_rate is not None and self.owns_learning_rate:
            _set_rate(context.optimizer, ended_rate, step)
        kept = [before_train_begin(c, s) for c, s in zip(self.callbacks, states)]
        self._list.on_train_begin()
        for callback, state, keep in zip(self.callbacks, states, kept):
            if state is not None:
                after_train_begin(callback, state, keep)
        if self._stopped_at is not None and self._stopped_at <= step:
            self._model.stop_training = True  # the run had stopped there: it stays stopped
            if step < context.plan.train_steps:
                logging.warning(
                    "tputrain: a Keras callback stopped this run at step %d; it stays stopped "
                    "(a rerun ends as the run did), so no step is trained: to train on, "
                    "train in a new model_dir, from these weights with "
                    "actions=[tputrain.InitCheckpoint(<this model_dir>)]", self._stopped_at)

    def _restored(self, step: int) -> list[Any]:
        """Each callback's state from the restored checkpoint (None where there is none).
        A call continuing this run in this process (`tputrain.fit` again) takes the state
        the callbacks ended the last call with: the checkpoint at its last step was
        written before they were given its final evaluation."""
        restored = self._state.take()
        if self._ended is not None and self._ended[0] == step:
            restored = self._ended[1]
        self._ended = None
        self._last_eval, self._stopped_at = None, None
        if restored is None:
            return [None] * len(self.callbacks)
        self._last_eval, self._stopped_at = restored["last_eval"], restored["stopped_at"]
        self._train_logs = dict(restored["train_logs"])
        saved = restored["callbacks"]
        states = []
        for n, callback in enumerate(self.callbacks):
            name, state = saved[n] if n < len(saved) else (None, None)
            if name != type(callback).__name__:
                logging.warning("tputrain: the checkpoint at step %d holds no state for Keras "
                                "callback %d (%s): it starts over", step, n,
                                type(callback).__name__)
                state = None
            states.append(state)
        return states

    def _recorded(self, step: int) -> bool:
        return self._last_eval is not None and self._last_eval >= step

    def eval_recorded(self, context: ActionContext, step: int) -> bool:
        """Whether the callbacks were given the evaluation at `step` (as restored).
        Asked first at a rerun of a finished run, which calls no `on_train_begin`:
        the callbacks start here then, to replay the run's end."""
        if self._list is None:
            self._start(context, step)
        return self._recorded(step)

    def end_done(self, context: ActionContext, step: int) -> bool:
        """Started callbacks are ended (`on_train_end`: files closed, best weights back)."""
        return self._list is None

    def on_loop_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        self._train_logs = {k: v for k, v in logs.items()
                            if k in self._metric_names and k not in _LOOP_ONLY}
        # fit's batch logs: the loss and the metrics, not tputrain's own loop keys.
        self._list.on_train_batch_end(step - 1, dict(self._train_logs))
        self._stop_if_asked(context)

    def on_eval_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        if self._list is None or self._recorded(step):
            return  # Trainer.evaluate() outside train(), or one they were given already
        every = context.plan.eval_every or context.plan.train_steps
        self._list.on_test_begin()  # no hook runs before an evaluation: both after it
        self._list.on_test_end(dict(logs))
        epoch_logs = dict(self._train_logs)
        epoch_logs.update({f"val_{k}": v for k, v in logs.items()})
        self._list.on_epoch_end(max(step - 1, 0) // every, epoch_logs)
        self._last_eval = step
        if step < context.plan.train_steps and not self._model.stop_training:
            self._list.on_epoch_begin(step // every)
        self._stop_if_asked(context)

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        """Ends the callbacks; `weights_changed` says whether one set the model's weights
        (EarlyStopping's `restore_best_weights`): they then differ from the last step's."""
        if self._list is None:
            return
        self._ended = (step, self._gather(), _rate(context.optimizer))  # see _restored
        before = context.model.get_weights()
        self._list.on_train_end(dict(logs))
        self._list = None
        self.weights_changed = any(not np.array_equal(a, b) for a, b in
                                   zip(before, context.model.get_weights()))

    def _stop_if_asked(self, context: ActionContext) -> None:
        if self._model.stop_training:
            if self._stopped_at is None:
                self._stopped_at = context.step
            context.stop()


def _rate_variable(optimizer: Any) -> Any:
    """The optimizer's learning-rate variable (None for a schedule, which no callback sets)."""
    return next((v for v in optimizer.variables if v.name == "learning_rate"), None)


def _rate(optimizer: Any) -> float | None:
    variable = _rate_variable(optimizer)
    return None if variable is None else float(np.asarray(variable.numpy()))


def _set_rate(optimizer: Any, rate: float, step: int) -> None:
    """A call continuing this run in this process: the rate the callbacks ended the last
    call with (a cut made at its final evaluation), not the rate of the checkpoint at
    `step`, which was written before that evaluation."""
    variable = _rate_variable(optimizer)
    if variable is not None and float(np.asarray(variable.numpy())) != rate:
        variable.assign(rate)
        logging.info("tputrain: Keras callbacks: the learning rate is %g, as the callbacks "
                     "set it at the evaluation of step %d (after its checkpoint)", rate, step)
