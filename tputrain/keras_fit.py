"""`tputrain.fit`: a compiled Keras model trained by the Trainer in one call.

The few-lines path: `tputrain.fit(model, train_data, eval_data, model_dir=...,
steps=...)` builds a `KerasTask` and a `Trainer` (strategy, compiled host loops,
exact-resume checkpoints, guard, progress) and runs Keras callbacks through
`KerasCallbacks`. Rerunning the same call resumes from model_dir's latest checkpoint;
in the same process, a call continuing the same run on the same model resumes on
the Trainer the last call kept on the model, its loops compiled already. An optimizer
compiled with Keras's `use_ema=True` keeps its averages as under `fit` (updated in its
step, checkpointed with it); the run ends by putting them into the model, as `fit`
ends (`_KerasAverages`). With `ema_decay`, the model is handed back with tputrain's
own averages, the weights every evaluation used (`_trained`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import numbers
import os
import random
import tempfile
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.actions import Action
from tputrain.checkpointing.atomic import atomic_path
from tputrain.checkpointing.integrity import object_graph
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.runtime.context import ActionContext, learning_rate
from tputrain.config.parsing import without_gin_notes
from tputrain.actions.keras_callbacks import KerasCallbacks
from tputrain.keras_task import KerasTask, built_precision
from tputrain.optim.ema import (averaged_weights, check_overwrite_supported,
                                finalize_keras_averages, uses_keras_ema)
from tputrain.trainer import Trainer

FINAL_WEIGHTS = RunDirectory.FINAL_WEIGHTS  # the final weights, when not the last step's


def fit(model: keras.Model | Callable[[], keras.Model], train_data: Any, eval_data: Any = None,
        *, model_dir: str, steps: int, batch_size: int | None = None,
        eval_every: int | None = None, callbacks: Sequence[keras.callbacks.Callback] = (),
        shuffle: bool = True, actions: Sequence[Action] = (),
        task: Callable[..., KerasTask] = KerasTask, **trainer_options: Any) -> dict[str, float]:
    """Trains a compiled Keras model for `steps` optimizer steps; returns the final
    evaluation's metrics ({"loss": ..., metric names: ...}).

    An optimizer with Keras's `use_ema=True` ends the run as `fit` does: the model
    gets the optimizer's averages of its trainable weights (`finalize_variable_values`,
    before the callbacks' `on_train_end`), the evaluations during training are of the
    raw weights (the callbacks' `val_*`, as fit's history), and the returned metrics
    are an evaluation of the averages. The checkpoints hold the raw weights and the
    averages, so a resume continues both.

    A second call on the same `keras.Model` that continues the same run (the same
    model_dir, data, callbacks, actions and options; the model not compiled again;
    only `steps` differs) trains on the first call's Trainer: its compiled loops
    are not traced again (`kept_trainer`). Any other call builds a new one.

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
      **trainer_options: any other `Trainer` argument (strategy, steps_per_loop, ...),
        not `model.fit`'s own (`_FIT_KEYWORDS`).
    """
    _check_no_fit_keywords(trainer_options)
    trainer_options.update(_built_models_precision(model, model_dir, trainer_options))
    call = _Call(model_dir, train_data, eval_data, batch_size, shuffle, eval_every,
                 task, list(callbacks), list(actions), dict(trainer_options),
                 _contents((train_data, eval_data)))
    run = _continued(model, call)
    try:
        with _users_generators_kept():
            with _fit_errors():
                run = run or _new_run(model, call, steps)
                run.trainer.train_steps = steps
            for adapter in run.adapters:
                adapter.weights_changed = False  # set again by this call's on_train_end
            run.averages.finalized = False  # likewise
            logs, weights = _trained(run, model_dir)
    except BaseException:
        if isinstance(model, keras.Model):
            _forget(model, close=False)  # a failed call's Trainer is not continued
        raise
    if isinstance(model, keras.Model):
        model.set_weights(weights)
        carry_optimizer(model.optimizer, run.trainer.optimizer)
        _keep(model, dataclasses.replace(run, model_state=_model_state(model)))
    return logs


# model.fit's own keywords, which the Trainer does not take: what tputrain.fit has instead.
_FIT_KEYWORDS = {
    "epochs": "pass steps= (the total optimizer steps: epochs * steps per epoch)",
    "steps_per_epoch": "pass eval_every= (the steps between two evaluations, a Keras epoch "
                       "for the callbacks)",
    "initial_epoch": "drop it: a rerun with the same model_dir resumes from its latest "
                     "checkpoint",
    "validation_split": "pass eval_data= (split the arrays yourself: "
                        "eval_data=(x[-n:], y[-n:]))",
    "validation_data": "pass eval_data=",
    "validation_freq": "pass eval_every=",
    "validation_steps": "pass eval_steps=",
    "validation_batch_size": "pass eval_data= as a batched dataset (it keeps its batches)",
    "verbose": "pass progress_bar= ('auto', 'on' or 'off')",
    "sample_weight": "pass train_data=(x, y, sample_weight)",
    "x": "pass train_data=(x, y)",
    "y": "pass train_data=(x, y)",
}


def _check_no_fit_keywords(options: Mapping[str, Any]) -> None:
    """A model.fit keyword is named as such, with tputrain.fit's equivalent (the
    Trainer would say only that its own __init__ takes no such argument)."""
    for name in options:
        if name in _FIT_KEYWORDS:
            raise TypeError(f"tputrain.fit() takes no {name}= (a model.fit argument): "
                            f"{_FIT_KEYWORDS[name]}")


def kept_trainer(model: keras.Model) -> Trainer | None:
    """The Trainer `fit` kept on `model` for a next call of the same run, or None."""
    run = getattr(model, _KEPT, None)
    return run.trainer if run is not None else None


def release(model: keras.Model) -> None:
    """Closes and drops the Trainer `fit` kept on `model` (its copy of the model, the
    optimizer's state, its input iterators) while the model lives on, e.g. before
    building another large model; the next call builds a new one."""
    _forget(model, close=True)


_KEPT = "_tputrain_fit_run"  # on the user's model: freed with it (a weak-key map is not:
# the kept Trainer's task refers to the model)


class _Call(NamedTuple):
    """A fit call's arguments but `steps`: a call with the same ones continues the run."""
    model_dir: str
    train_data: Any
    eval_data: Any
    batch_size: Any
    shuffle: Any
    eval_every: Any
    task: Any
    callbacks: list
    actions: list
    trainer_options: dict
    contents: tuple  # the arrays' digests: one changed in place is other data


def _contents(data: Any) -> tuple:
    """A digest of each NumPy array in `data` (nested tuples, lists, dicts): its dtype,
    shape and bytes, hashed from its buffer (a copy only of a non-contiguous one). A
    new Trainer reads the arrays as they are now; the kept one read them as they were."""
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:  # its buffer holds pointers: never the same contents
            return (object(),)
        digest = hashlib.sha256(memoryview(np.ascontiguousarray(data)).cast("B"))
        return ((data.dtype.str, data.shape, digest.hexdigest()),)
    if isinstance(data, dict):
        return tuple(part for key in sorted(data, key=str) for part in _contents(data[key]))
    if isinstance(data, (list, tuple)):
        return tuple(part for item in data for part in _contents(item))
    return ()  # a dataset, a tensor...: compared as the same object (`_same`)


@dataclasses.dataclass(frozen=True)
class _Run:
    """A Trainer built by fit, its callbacks' adapter, and what it was built from."""
    trainer: Trainer
    adapters: list[KerasCallbacks]
    call: _Call
    averages: "_KerasAverages"
    model_state: tuple | None = None


def _model_state(model: keras.Model) -> tuple | None:
    """What a new Trainer would read of the model besides its weights (which the
    checkpoint overrides): its optimizer and settings, compile config, trainable set,
    layers' configs. None when the first three do not serialize: such a model's next
    call builds a new Trainer."""
    optimizer = model.optimizer
    try:
        return (optimizer, optimizer.get_config(), model.get_compile_config(),
                [w.path for w in model.trainable_weights],
                [w.path for w in model.non_trainable_weights], _layer_configs(model))
    except Exception:  # pylint: disable=broad-except  (a custom config: not compared)
        return None


def _layer_configs(model: keras.Model) -> list:
    """The model's and each of its layers' config (a Dropout's rate...), None where one
    does not serialize (a subclassed model's own): a new Trainer builds from them."""
    configs = []
    for layer in model._flatten_layers(include_self=True, recursive=True):  # pylint: disable=protected-access
        try:
            configs.append(layer.get_config())
        except Exception:  # pylint: disable=broad-except  (NotImplementedError, a custom one)
            configs.append(None)
    return configs


def _same(a: Any, b: Any) -> bool:
    """The same object, or equal plain values (numbers, strings, option dataclasses),
    containers item by item: arrays, datasets and callbacks must be the same objects."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, os.PathLike):
        return os.fspath(a) == os.fspath(b)
    if isinstance(a, (numbers.Number, str, bytes)) or dataclasses.is_dataclass(a):
        try:
            return bool(a == b)
        except (TypeError, ValueError):  # e.g. a dataclass holding arrays
            return False
    return False


def _continued(model: Any, call: _Call) -> _Run | None:
    """The run kept on `model` when this call continues it; otherwise None, the kept
    Trainer closed first (it holds tf.data iterators)."""
    run = getattr(model, _KEPT, None) if isinstance(model, keras.Model) else None
    if run is None:
        return None
    trainer = run.trainer
    if (not trainer.closed and trainer.num_hosts == 1  # several hosts: each would decide
            and trainer.checkpointer.latest is not None  # else a new run starts from the model
            and _same(run.call, call)
            and run.model_state is not None and _same(run.model_state, _model_state(model))):
        return run
    _forget(model, close=True)
    return None


def _new_run(model: Any, call: _Call, steps: int) -> _Run:
    """Today's path: a new KerasTask and Trainer for the call."""
    keras_task = call.task(model, call.train_data, call.eval_data, batch_size=call.batch_size,
                           shuffle=call.shuffle, seed=call.trainer_options.get("seed", 0),
                           epoch_steps=call.eval_every)
    adapters = [KerasCallbacks(call.callbacks)] if call.callbacks else []
    averages = _KerasAverages()  # first: the callbacks' on_train_end sees the averages
    trainer = Trainer(keras_task, call.model_dir, train_steps=steps, eval_every=call.eval_every,
                      actions=[averages, *adapters, *call.actions], **call.trainer_options)
    return _Run(trainer, adapters, call, averages)


def _built_models_precision(model: Any, model_dir: str,
                            options: Mapping[str, Any]) -> dict[str, str]:
    """{"precision": policy} for a model passed built under a mixed policy (under
    mixed_float16: its loss scaling too) unless `precision` is given; else {}."""
    policy = built_precision(model) if isinstance(model, keras.Model) else None
    if not policy or "precision" in options or _saved_without_loss_scaling(policy, model_dir):
        return {}
    return {"precision": policy}


def _saved_without_loss_scaling(policy: str, model_dir: str) -> bool:
    """Whether a mixed_float16 model's run was saved in float32 (before `fit` took a
    built model's policy): its checkpoints hold no loss-scale optimizer, so the run
    resumes as it was saved, which a warning says."""
    latest = tf.train.latest_checkpoint(RunDirectory(model_dir).checkpoints)
    if policy != "mixed_float16" or latest is None:
        return False
    try:
        graph = object_graph(tf.train.load_checkpoint(latest))
    except (tf.errors.OpError, ValueError):  # unreadable: the Trainer's restore says so
        return False
    if any(attribute.full_name.startswith("loss_scale_optimizer/")
           for node in graph.nodes for attribute in node.attributes):
        return False
    logging.warning("tputrain.fit: %s was saved without loss scaling (precision float32); the "
                    "run resumes so. For a mixed_float16 model's loss scaling, train it in a "
                    "new model_dir", model_dir)
    return True


@contextlib.contextmanager
def _users_generators_kept() -> Iterator[None]:
    """Python's and NumPy's global generators as the caller left them: the Trainer
    seeds them as it builds (`Trainer.seed`), and `model.fit` draws nothing from them."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


@contextlib.contextmanager
def _fit_errors() -> Iterator[None]:
    """fit takes no gin config: an error is raised without the gin note."""
    try:
        yield
    except Exception as error:  # pylint: disable=broad-except  (re-raised)
        original = without_gin_notes(error)
        if original is error:
            raise
        raise original from original.__cause__


def _trained(run: _Run, model_dir: str) -> tuple[dict[str, float], list[np.ndarray]]:
    """Trains to `train_steps`: the metrics of the weights the run ended on, and those
    weights (Keras's EMA averages, what the callbacks set, or with `ema_decay`
    tputrain's averages, which every evaluation uses)."""
    trainer, adapters = run.trainer, run.adapters
    logs = trainer.train()
    set_at_end = bool(adapters and adapters[0].weights_changed)
    # EarlyStopping(restore_best_weights) or use_ema: not the last evaluation's weights
    if run.averages.finalized or set_at_end:
        logs = trainer.evaluate_weights()  # the metrics of the model returned
    with averaged_weights(trainer.ema) as averaged:  # with ema_decay: as evaluated
        if averaged and set_at_end:
            logging.warning("tputrain.fit: with ema_decay the model gets the EMA weights, "
                            "which every evaluation used, not the weights a Keras callback "
                            "set at the end (EarlyStopping's restore_best_weights); for "
                            "those, train without ema_decay")
        if trainer.is_chief and (averaged or run.averages.finalized or set_at_end):
            save_final_weights(trainer.model, model_dir)
        return logs, trainer.model.get_weights()


def _keep(model: keras.Model, run: _Run) -> None:
    setattr(model, _KEPT, run)


def _forget(model: keras.Model, close: bool) -> None:
    """Drops the Trainer kept on `model`, if any; `close`: closes it too (not after a
    failure: its error, not one closing raises, is the one to see)."""
    run = getattr(model, _KEPT, None)
    if run is not None:
        delattr(model, _KEPT)
        if close:
            run.trainer.close()


def save_final_weights(model: keras.Model, model_dir: str) -> str:
    """`model_dir/final.weights.h5` (`model.load_weights` reads it): the weights the
    callbacks left at the end (or Keras's `use_ema` or tputrain's `ema_decay`
    averages) when they differ from the last checkpoint's. Written whole, then
    renamed into place (any `tf.io.gfile` path)."""
    path = RunDirectory(model_dir).final_weights
    with tempfile.TemporaryDirectory(prefix="tputrain-final-") as local, atomic_path(path) as temp:
        written = os.path.join(local, FINAL_WEIGHTS)
        model.save_weights(written)  # h5 needs a local file: copied beside `path`, renamed
        tf.io.gfile.copy(written, temp, overwrite=True)
    return path


class _KerasAverages(Action):
    """Keras's `use_ema` at the end of a run, as `fit` ends: the optimizer's moving
    averages put into the model's trainable weights (`finalize_keras_averages`). First
    among fit's actions, so the callbacks' `on_train_end` sees them, as under fit
    (EarlyStopping's `restore_best_weights` then sets the best epoch's raw weights over
    them, as under fit). The last checkpoint keeps the raw weights: the next `train()`
    restores them before it continues."""

    def __init__(self) -> None:
        self.finalized = False  # whether this run's end put averages into the model

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        check_overwrite_supported(context.optimizer, context.strategy, context.plan.xla_plan)

    def end_done(self, context: ActionContext, step: int) -> bool:
        return not uses_keras_ema(context.optimizer)  # a finished run's rerun: them again

    def on_train_end(self, context: ActionContext, step: int, logs: Mapping[str, float]) -> None:
        self.finalized = finalize_keras_averages(context.model, context.optimizer)


def carry_optimizer(user: keras.optimizers.Optimizer, trained: keras.optimizers.Optimizer
                    ) -> None:
    """The user's optimizer as `fit` leaves it: the learning rate the run ended with (a
    callback's cut included; a schedule stays as it is) and the step count."""
    user = getattr(user, "inner_optimizer", user)
    try:
        user.learning_rate = learning_rate(trained)
    except TypeError:  # built with a LearningRateSchedule: nothing to carry
        pass
    counted = _step_counter(getattr(trained, "inner_optimizer", trained))
    _step_counter(user).assign(int(keras.ops.convert_to_numpy(counted)))


def _step_counter(optimizer: keras.optimizers.Optimizer) -> Any:
    """The optimizer's own step variable: Keras 3 keeps `_iterations` (batches seen);
    with `gradient_accumulation_steps` its `iterations` is computed from it (updates)."""
    counter = getattr(optimizer, "_iterations", None)
    return counter if hasattr(counter, "assign") else optimizer.iterations
