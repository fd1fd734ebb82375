"""Bring a Keras model as it is: `tputrain.fit(model, train, eval, ...)` on a compiled
model (two inputs, sample weights) reaches `model.fit`'s eval metrics on 1 and 2
replicas, and Keras callbacks (CSVLogger, ReduceLROnPlateau) act as under `fit`."""

from __future__ import annotations

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import strategy_for

BATCH, EPOCH_STEPS, LR = 8, 6, 0.2


def data(examples: int, seed: int, weighted: bool) -> tuple:
    """Two inputs, 3 classes, uneven sample weights (some 0)."""
    rng = np.random.default_rng(seed)
    x = {"signal": rng.normal(size=(examples, 5)).astype(np.float32),
         "bias": rng.normal(size=(examples, 1)).astype(np.float32)}
    y = (np.argmax(x["signal"][:, :3], -1) + (x["bias"][:, 0] > 1)) % 3
    weights = rng.uniform(0.0, 3.0, size=examples).astype(np.float32)
    weights[::5] = 0.0
    return (x, y.astype(np.int64), weights) if weighted else (x, y.astype(np.int64))


def compiled_model(seed: int = 0, compile: bool = True) -> keras.Model:
    keras.utils.set_random_seed(seed)
    signal, bias = keras.Input((5,), name="signal"), keras.Input((1,), name="bias")
    hidden = keras.layers.Dense(8, activation="tanh",
                                kernel_regularizer=keras.regularizers.L2(1e-3))(
        keras.layers.Concatenate()([signal, bias]))
    model = keras.Model({"signal": signal, "bias": bias},
                        keras.layers.Dense(3, activation="softmax")(hidden))
    if not compile:
        return model
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.5),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    return model


def train_dataset() -> tf.data.Dataset:
    """One epoch of weighted batches, as `fit` takes them."""
    return tf.data.Dataset.from_tensor_slices(data(BATCH * EPOCH_STEPS, 1, True)).batch(BATCH)


EVAL = data(20, 2, False)  # 20 examples: a padded last batch on 2 replicas


def keras_fit(epochs: int, callbacks=()) -> tuple[keras.Model, dict[str, list[float]]]:
    model = compiled_model()
    history = model.fit(train_dataset(), epochs=epochs, steps_per_epoch=EPOCH_STEPS,
                        validation_data=EVAL, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history.history


def close(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_fit_reaches_keras_fit_eval_metrics(tmp_path, replicas):
    model = compiled_model()
    initial = model.get_weights()
    logs = tputrain.fit(model, train_dataset(), EVAL, model_dir=str(tmp_path / "run"),
                        steps=2 * EPOCH_STEPS, eval_every=EPOCH_STEPS,
                        strategy=strategy_for(replicas), report_mfu=False, jit_compile=False)
    expected_model, history = keras_fit(epochs=2)
    print(f"replicas={replicas}  tputrain.fit: loss {logs['loss']:.7f} accuracy "
          f"{logs['accuracy']:.7f} | model.fit: val_loss {history['val_loss'][-1]:.7f} "
          f"val_accuracy {history['val_accuracy'][-1]:.7f}")
    assert abs(logs["loss"] - history["val_loss"][-1]) < 1e-5
    assert abs(logs["accuracy"] - history["val_accuracy"][-1]) < 1e-6
    assert close(model.get_weights(), initial) > 1e-2  # the user's model is trained, as by fit
    assert close(model.get_weights(), expected_model.get_weights()) < 1e-5


def test_numpy_arrays_and_an_unbatched_dataset_train_alike(tmp_path):
    """Arrays (with `batch_size`, unshuffled) and a dataset of single examples with
    `batch_size` are the same global batches as the batched dataset."""
    arrays = data(BATCH * EPOCH_STEPS, 1, True)
    results = []
    for name, train in (("arrays", arrays),
                        ("examples", tf.data.Dataset.from_tensor_slices(arrays))):
        model = compiled_model()
        tputrain.fit(model, train, EVAL, model_dir=str(tmp_path / name), steps=EPOCH_STEPS,
                     batch_size=BATCH, shuffle=False, strategy=strategy_for(1),
                     report_mfu=False, jit_compile=False)
        results.append(model.get_weights())
    expected, _ = keras_fit(epochs=1)
    for weights in results:
        assert close(weights, expected.get_weights()) < 1e-5


def test_a_model_that_is_not_compiled_is_refused(tmp_path):
    with pytest.raises(ValueError, match="compile"):
        tputrain.fit(compiled_model(compile=False), train_dataset(), EVAL,
                     model_dir=str(tmp_path / "run"), steps=2)


def read_csv(path) -> tuple[list[str], list[dict[str, float]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, [{k: float(v) for k, v in row.items()} for row in reader]


def plateau() -> keras.callbacks.ReduceLROnPlateau:
    """Reduces whenever val_loss improved by less than 0.03 on the best."""
    return keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                             min_delta=0.03, verbose=0)


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_csv_logger_and_reduce_lr_on_plateau_act_as_under_fit(tmp_path, replicas):
    epochs = 5
    expected_model, history = keras_fit(
        epochs, [plateau(), keras.callbacks.CSVLogger(str(tmp_path / "fit.csv"))])
    model = compiled_model()
    tputrain.fit(model, train_dataset(), EVAL, model_dir=str(tmp_path / "run"),
                 steps=epochs * EPOCH_STEPS, eval_every=EPOCH_STEPS,
                 steps_per_loop=EPOCH_STEPS, strategy=strategy_for(replicas),
                 callbacks=[plateau(),  # first: it adds the rate to the logs CSVLogger writes
                            keras.callbacks.CSVLogger(str(tmp_path / "tputrain.csv"))],
                 report_mfu=False, jit_compile=False)
    columns, rows = read_csv(tmp_path / "tputrain.csv")
    expected_columns, expected_rows = read_csv(tmp_path / "fit.csv")
    assert columns == expected_columns
    rates = [row["learning_rate"] for row in rows]
    print("learning rate per epoch: tputrain", rates, "fit",
          [row["learning_rate"] for row in expected_rows])
    assert len(set(rates)) > 1, "the plateau reduced the learning rate"
    assert len(rows) == len(expected_rows) == epochs
    for row, expected in zip(rows, expected_rows):
        for column in columns:
            assert row[column] == pytest.approx(expected[column], abs=1e-5), column
    assert close(model.get_weights(), expected_model.get_weights()) < 1e-5


def test_stop_training_from_a_callback_ends_the_run(tmp_path):
    class StopAtSecondEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.stop_training = True

    model = compiled_model()
    run = tmp_path / "run"
    tputrain.fit(model, train_dataset(), EVAL, model_dir=str(run), steps=5 * EPOCH_STEPS,
                 eval_every=EPOCH_STEPS, strategy=strategy_for(1),
                 callbacks=[StopAtSecondEpoch()], report_mfu=False, jit_compile=False)
    assert tf.train.latest_checkpoint(str(run / "checkpoints")).endswith(
        f"ckpt-{2 * EPOCH_STEPS}")


@pytest.mark.slow
def test_a_learning_rate_set_by_a_callback_is_restored_on_resume(tmp_path):
    """The rate ReduceLROnPlateau set is saved with the checkpoint and restored by the
    next `fit` on the same model_dir (not reset to the compiled one)."""
    class Rate(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.rate = float(self.model.optimizer.learning_rate.numpy())

    always = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                               min_delta=100.0)  # after epochs 1, 2...
    run, rates = str(tmp_path / "run"), []
    # The checkpoint at step 18 is saved before the final evaluation (it holds LR / 2,
    # set after epoch 1; the one set after the last epoch comes after the last save).
    for steps in (3 * EPOCH_STEPS, 4 * EPOCH_STEPS):
        rate = Rate()
        tputrain.fit(compiled_model(), train_dataset(), EVAL, model_dir=run, steps=steps,
                     eval_every=EPOCH_STEPS, checkpoint_every=EPOCH_STEPS,
                     strategy=strategy_for(1), callbacks=[always, rate], report_mfu=False,
                     jit_compile=False)
        rates.append(rate.rate)
    assert rates == pytest.approx([LR, LR / 2])


@pytest.mark.slow
def test_sigkill_midway_resumes_bitwise(tmp_path):
    """`tputrain.fit` killed with -9 after step 10's loop, run again: the final checkpoint is
    bitwise an uninterrupted run's (2 replicas, dropout, shuffled arrays)."""
    import sys

    from faults import Process, child_env, copy_at_pause, pausable_env, same_final_weights

    def child(model_dir, pause_at=None):
        call = f"faults.keras_fit_run({str(model_dir)!r}, {pause_at!r})"
        env = pausable_env(child_env(cpus=2)) if pause_at else child_env(cpus=2)
        return Process([sys.executable, "-c", f"import faults; {call}"], env,
                       stdin=bool(pause_at))

    # The uninterrupted run pauses after step 10's loop: "interrupted" is its model_dir
    # as a SIGKILL there leaves it (one process less than a second run killed there).
    reference = child(tmp_path / "reference", pause_at=10)
    copy_at_pause(reference, tmp_path / "reference", tmp_path / "interrupted",
                  r"tputrain-test: paused at step 10")
    assert reference.finish() == 0, reference.log()
    resumed = child(tmp_path / "interrupted")
    assert resumed.finish() == 0, resumed.log()
    # Killed before step 10's save: steps 9 and 10 are trained again, from ckpt-8.
    assert "training from step 8 to 24" in resumed.text(), resumed.log()
    weights = same_final_weights(tmp_path)
    assert any(k.startswith("seeds/") for k in weights)


def test_a_model_building_function_is_called_in_the_scope(tmp_path):
    """A function that builds and compiles the model (the way for subclassed models)
    trains as the compiled model does."""
    logs = tputrain.fit(compiled_model, train_dataset(), EVAL, model_dir=str(tmp_path / "run"),
                        steps=EPOCH_STEPS, strategy=strategy_for(2), report_mfu=False,
                        jit_compile=False)
    _, history = keras_fit(epochs=1)
    assert abs(logs["loss"] - history["val_loss"][-1]) < 1e-5


def shuffled_dataset() -> tf.data.Dataset:
    """fit's usual input: reshuffled each pass (tf.data's default), seeded."""
    return (tf.data.Dataset.from_tensor_slices(data(BATCH * EPOCH_STEPS, 1, True))
            .shuffle(512, seed=0).batch(BATCH))


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_reshuffling_dataset_gives_fits_batches(tmp_path, replicas):
    """`fit` opens one iterator of the dataset per epoch and no other: tputrain.fit
    opens the same ones in the same order, so each epoch's shuffle is fit's."""
    epochs = 3
    expected = compiled_model()
    expected.fit(shuffled_dataset(), epochs=epochs, verbose=0)
    model = compiled_model()
    tputrain.fit(model, shuffled_dataset(), EVAL, model_dir=str(tmp_path / "run"),
                 steps=epochs * EPOCH_STEPS, eval_every=EPOCH_STEPS,
                 strategy=strategy_for(replicas), report_mfu=False, jit_compile=False)
    gap = close(model.get_weights(), expected.get_weights())
    print(f"replicas={replicas}: largest weight difference to model.fit {gap:.2e}")
    assert gap < 1e-5


# ------------------------------------------------------------ callbacks over a kill

class Crash(Exception):
    """Ends a run at one instant, leaving model_dir as a kill there would."""


class CrashAt(tputrain.Action):
    """Raises `Crash` after the evaluation at `step` (the callbacks before it have run:
    the CSV row is written, the rate cut) and before its checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_eval_end(self, context, step, logs):
        if step == self.step:
            raise Crash(step)


def callbacks_fit(model_dir, replicas: int = 1, actions=(), restore_best_weights=False,
                  extra=()):
    """`faults.keras_callbacks_run` in this process (`extra` callbacks after its three):
    (model, returned logs)."""
    import faults

    model = faults.callbacks_model()  # first: it sets the global seed the shuffle's derives from
    train = tf.data.Dataset.from_tensor_slices(
        faults.callbacks_data(8 * faults.CALLBACKS_EPOCH_STEPS, 1)).shuffle(512, seed=0).batch(8)
    logs = tputrain.fit(model, train, faults.callbacks_data(40, 2), model_dir=str(model_dir),
                        steps=faults.CALLBACKS_EPOCHS * faults.CALLBACKS_EPOCH_STEPS,
                        eval_every=faults.CALLBACKS_EPOCH_STEPS,
                        steps_per_loop=faults.CALLBACKS_EPOCH_STEPS,
                        checkpoint_every=faults.CALLBACKS_EPOCH_STEPS,
                        strategy=strategy_for(replicas),
                        callbacks=[*faults.keras_callbacks(str(model_dir), restore_best_weights),
                                   *extra],
                        actions=list(actions), report_mfu=False, jit_compile=False)
    return model, logs


def assert_same_rows(actual_csv, expected_csv) -> list[dict[str, float]]:
    columns, rows = read_csv(actual_csv)
    expected_columns, expected_rows = read_csv(expected_csv)
    assert columns == expected_columns
    assert [r["epoch"] for r in rows] == [r["epoch"] for r in expected_rows]
    for row, expected in zip(rows, expected_rows):
        assert row == pytest.approx(expected, abs=1e-6), row["epoch"]
    return rows


def test_callbacks_resume_after_a_crash_between_an_evaluation_and_its_checkpoint(tmp_path):
    """The fast case of the kill -9 matrix below (in this process, 1 replica): the
    CSV row and the rate cut of step 30's evaluation are on disk, its checkpoint is
    not. The resumed run's rows, rates, stop step and weights are the uninterrupted one's."""
    expected_model, expected_logs = callbacks_fit(tmp_path / "reference")
    with pytest.raises(Crash):
        callbacks_fit(tmp_path / "crashed", actions=[CrashAt(30)])
    model, logs = callbacks_fit(tmp_path / "crashed")
    rows = assert_same_rows(tmp_path / "crashed" / "epochs.csv",
                            tmp_path / "reference" / "epochs.csv")
    rates = [row["learning_rate"] for row in rows]
    print("rates per epoch", rates, "stopped after epoch", rows[-1]["epoch"])
    assert len(set(rates)) > 2 and len(rows) < 16  # two cuts and an early stop
    assert (tf.train.latest_checkpoint(str(tmp_path / "crashed" / "checkpoints"))
            .endswith(f"ckpt-{len(rows) * 6}"))
    assert close(model.get_weights(), expected_model.get_weights()) < 1e-6
    assert logs == pytest.approx(expected_logs, abs=1e-6)


class FinalRate(keras.callbacks.Callback):
    def on_train_end(self, logs=None):
        self.rate = float(self.model.optimizer.learning_rate.numpy())


def test_restore_best_weights_leaves_one_final_model(tmp_path):
    """EarlyStopping(restore_best_weights=True) with ReduceLROnPlateau: the model fit
    returns holds the best epoch's weights, the returned metrics are theirs (the best
    epoch's val_*), model_dir/final.weights.h5 holds them, a rerun returns the same,
    and the model's optimizer has the rate the callbacks left."""
    final = FinalRate()
    model, logs = callbacks_fit(tmp_path / "run", restore_best_weights=True, extra=[final])
    _, rows = read_csv(tmp_path / "run" / "epochs.csv")
    best = min(rows, key=lambda row: row["val_loss"])
    print(f"best epoch {best['epoch']:.0f} of {len(rows)}; returned {logs}; final rate "
          f"{final.rate}, the model's optimizer "
          f"{float(model.optimizer.learning_rate.numpy())}")
    assert best["epoch"] < len(rows) - 1  # the stop came after it: weights went back
    assert logs["loss"] == pytest.approx(best["val_loss"], abs=1e-6)
    assert logs["accuracy"] == pytest.approx(best["val_accuracy"], abs=1e-6)
    assert final.rate < 0.3
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(final.rate)
    saved = compiled_callbacks_model()
    saved.load_weights(tmp_path / "run" / "final.weights.h5")
    assert close(saved.get_weights(), model.get_weights()) == 0.0
    again, again_logs = callbacks_fit(tmp_path / "run", restore_best_weights=True)
    assert close(again.get_weights(), model.get_weights()) == 0.0
    assert again_logs == pytest.approx(logs, abs=1e-6)
    assert float(again.optimizer.learning_rate.numpy()) == pytest.approx(final.rate)


def compiled_callbacks_model() -> keras.Model:
    import faults

    return faults.callbacks_model()


KILL_INSTANTS = ("loop:18", "eval:30", "stop")  # before an eval; between eval and save; the end


def callbacks_child(model_dir, replicas: int, instants=()):
    import sys

    from faults import Process, child_env, pausable_env

    call = f"faults.keras_callbacks_run({str(model_dir)!r}, {replicas}, {list(instants)!r})"
    env = pausable_env(child_env(cpus=2)) if instants else child_env(cpus=2)
    return Process([sys.executable, "-c", f"import faults; {call}"], env, stdin=bool(instants))


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_callbacks_resume_after_a_kill_at_three_instants(tmp_path, replicas):
    """ReduceLROnPlateau + EarlyStopping + CSVLogger through `tputrain.fit`: model_dir as
    a kill -9 leaves it before an evaluation, between an evaluation and its checkpoint,
    and after the early stop's checkpoint, each run again: the CSV rows, learning
    rates, stop step, final checkpoint and the model `fit` returns are bitwise the
    uninterrupted run's."""
    import re

    import numpy as np
    from faults import copy_at_pause, final_weights

    reference = callbacks_child(tmp_path / "reference", replicas, KILL_INSTANTS)
    for n, instant in enumerate(KILL_INSTANTS):
        copy_at_pause(reference, tmp_path / "reference", tmp_path / f"killed-{n}",
                      rf"tputrain-test: paused at {re.escape(instant)}$")
    assert reference.finish() == 0, reference.log()
    expected = dict(np.load(tmp_path / "reference.result.npz"))
    expected_weights = final_weights(str(tmp_path / "reference"))
    expected_csv = (tmp_path / "reference" / "epochs.csv").read_text()
    for n, instant in enumerate(KILL_INSTANTS):
        resumed = callbacks_child(tmp_path / f"killed-{n}", replicas)
        assert resumed.finish() == 0, resumed.log()
        assert (tmp_path / f"killed-{n}" / "epochs.csv").read_text() == expected_csv, instant
        weights = final_weights(str(tmp_path / f"killed-{n}"))
        assert weights.keys() == expected_weights.keys()
        for key in weights:
            np.testing.assert_array_equal(weights[key], expected_weights[key], err_msg=key)
        result = dict(np.load(tmp_path / f"killed-{n}.result.npz"))
        assert result.keys() == expected.keys()
        for key in result:
            np.testing.assert_array_equal(result[key], expected[key], err_msg=f"{instant}: {key}")


@pytest.mark.slow
def test_callbacks_state_is_optional_in_a_checkpoint(tmp_path):
    """A checkpoint holding callbacks' state resumes a run without callbacks, and one
    without it (a run without callbacks) resumes a run with them: they start over."""
    with_state, without = tmp_path / "with_state", tmp_path / "without"
    for steps, callbacks in ((EPOCH_STEPS, [plateau()]), (2 * EPOCH_STEPS, [])):
        tputrain.fit(compiled_model(), train_dataset(), EVAL, model_dir=str(with_state),
                     steps=steps, eval_every=EPOCH_STEPS, strategy=strategy_for(1),
                     callbacks=callbacks, report_mfu=False, jit_compile=False)
    for steps, callbacks in ((EPOCH_STEPS, []), (2 * EPOCH_STEPS, [plateau()])):
        tputrain.fit(compiled_model(), train_dataset(), EVAL, model_dir=str(without),
                     steps=steps, eval_every=EPOCH_STEPS, strategy=strategy_for(1),
                     callbacks=callbacks, report_mfu=False, jit_compile=False)
    for run in (with_state, without):
        assert tf.train.latest_checkpoint(str(run / "checkpoints")).endswith(
            f"ckpt-{2 * EPOCH_STEPS}")


# ------------------------------------------------------------ a second call on the same model

def counting_task() -> type:
    """A KerasTask whose train loss counts its Python calls: one per trace of the step."""
    class Counting(tputrain.KerasTask):
        traces = 0

        def total_loss(self, *args, **kwargs):
            Counting.traces += 1
            return super().total_loss(*args, **kwargs)

    return Counting


def test_a_longer_second_call_reuses_the_first_calls_compiled_loop(tmp_path):
    """fit(steps=4) then fit(steps=8) on the same model, data, callbacks and model_dir
    traces the train step once in all, and ends bitwise as one fit(steps=8): weights,
    metrics and the rate ReduceLROnPlateau cut."""
    task, strategy, train = counting_task(), strategy_for(1), train_dataset()
    callbacks = [plateau()]
    options = dict(eval_every=2, strategy=strategy, task=task, report_mfu=False,
                   jit_compile=False)
    model = compiled_model()
    tputrain.fit(model, train, EVAL, model_dir=str(tmp_path / "twice"), steps=4,
                 callbacks=callbacks, **options)
    traces = task.traces
    logs = tputrain.fit(model, train, EVAL, model_dir=str(tmp_path / "twice"), steps=8,
                        callbacks=callbacks, **options)
    assert traces > 0 and task.traces == traces
    once = compiled_model()
    once_logs = tputrain.fit(once, train_dataset(), EVAL, model_dir=str(tmp_path / "once"),
                             steps=8, callbacks=[plateau()], **options)
    assert close(model.get_weights(), once.get_weights()) == 0.0
    assert logs == once_logs
    rate = float(model.optimizer.learning_rate.numpy())
    assert rate == float(once.optimizer.learning_rate.numpy()) and rate < LR  # cut, as once
    assert int(model.optimizer.iterations.numpy()) == 8


def test_other_data_or_a_recompile_builds_a_new_trainer(tmp_path):
    """Another train dataset, or the model compiled again, is not the same run: the
    step is traced again and the kept Trainer is closed."""
    from tputrain.keras_fit import kept_trainer, release

    task, strategy, train = counting_task(), strategy_for(1), train_dataset()
    options = dict(model_dir=str(tmp_path / "run"), strategy=strategy, task=task,
                   report_mfu=False, jit_compile=False)
    model = compiled_model()
    tputrain.fit(model, train, EVAL, steps=2, **options)
    first, traces = kept_trainer(model), task.traces
    tputrain.fit(model, train_dataset(), EVAL, steps=4, **options)
    second = kept_trainer(model)
    assert task.traces > traces and first.closed and second is not first
    traces = task.traces
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.5),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    tputrain.fit(model, train_dataset(), EVAL, steps=6, **options)
    assert task.traces > traces and second.closed
    third = kept_trainer(model)
    assert not third.closed
    release(model)  # the kept Trainer's memory freed while the model lives on
    assert third.closed and kept_trainer(model) is None


def test_weights_set_between_calls_give_way_to_the_checkpoint(tmp_path):
    """As for a rerun in a new process: the next call resumes model_dir's checkpoint,
    not the weights the user set on the model in between."""
    strategy = strategy_for(1)
    options = dict(strategy=strategy, report_mfu=False, jit_compile=False)
    model, train = compiled_model(), train_dataset()
    tputrain.fit(model, train, EVAL, model_dir=str(tmp_path / "twice"), steps=4, **options)
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    tputrain.fit(model, train, EVAL, model_dir=str(tmp_path / "twice"), steps=8, **options)
    once = compiled_model()
    tputrain.fit(once, train_dataset(), EVAL, model_dir=str(tmp_path / "once"), steps=8,
                 **options)
    assert close(model.get_weights(), once.get_weights()) == 0.0


def test_a_dropped_model_frees_the_trainer_kept_on_it(tmp_path):
    """The Trainer kept for a next call lives no longer than the model it trains."""
    import gc
    import weakref

    def fitted() -> weakref.ref:  # in a frame of its own: the caller's may hold locals
        model = compiled_model()
        tputrain.fit(model, train_dataset(), EVAL, model_dir=str(tmp_path / "run"), steps=2,
                     strategy=strategy_for(1), report_mfu=False, jit_compile=False)
        return weakref.ref(model)

    dropped = fitted()
    gc.collect()
    assert dropped() is None


def dropout_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def small_fit(model, arrays, model_dir, steps: int, strategy) -> dict[str, float]:
    return tputrain.fit(model, arrays, arrays, model_dir=str(model_dir), steps=steps,
                        batch_size=BATCH, shuffle=False, steps_per_loop=2,
                        strategy=strategy, report_mfu=False, jit_compile=False)


def test_arrays_changed_in_place_between_calls_are_read_again(tmp_path):
    """Labels changed in place (the same array object) between two calls: the second
    trains and evaluates on the new ones, as `model.fit` would (a new Trainer)."""
    from tputrain.keras_fit import kept_trainer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 5)).astype(np.float32)
    y = (np.argmax(x[:, :3], -1)).astype(np.int64)
    model, strategy = dropout_model(), strategy_for(1)
    small_fit(model, (x, y), tmp_path, 2, strategy)
    first = kept_trainer(model)
    small_fit(model, (x, y), tmp_path, 3, strategy)  # the same contents: continued
    assert kept_trainer(model) is first and not first.closed
    y[:] = (y + 1) % 3  # new labels, the same object
    logs = small_fit(model, (x, y), tmp_path, 4, strategy)
    assert first.closed and kept_trainer(model) is not first
    expected = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(expected["loss"], abs=1e-5)


def test_a_layer_config_changed_between_calls_builds_a_new_trainer(tmp_path):
    """A Dropout's rate set on the model between calls is the next call's, as a new
    Trainer (a new process) would read it."""
    from tputrain.keras_fit import kept_trainer

    rng = np.random.default_rng(0)
    arrays = (rng.normal(size=(4 * BATCH, 5)).astype(np.float32),
              rng.integers(0, 3, size=4 * BATCH).astype(np.int64))
    model, strategy = dropout_model(), strategy_for(1)
    small_fit(model, arrays, tmp_path, 2, strategy)
    first = kept_trainer(model)
    model.layers[1].rate = 0.5
    small_fit(model, arrays, tmp_path, 4, strategy)
    assert first.closed
    rates = [layer.rate for layer in kept_trainer(model).model.layers
             if isinstance(layer, keras.layers.Dropout)]
    assert rates == [0.5]


def test_gradient_accumulation_steps_leave_the_optimizer_as_fit_does(tmp_path):
    """A compiled optimizer with `gradient_accumulation_steps=2`: fit returns its
    metrics, and the user's optimizer counts steps as `model.fit` leaves it (its own
    variable counts batches; `iterations`, updates)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)

    def accumulating() -> keras.Model:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(LR, gradient_accumulation_steps=2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    expected = accumulating()
    expected.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model = accumulating()
    logs = tputrain.fit(model, (x, y), (x, y), model_dir=str(tmp_path), steps=8,
                        batch_size=BATCH, shuffle=False, strategy=strategy_for(1),
                        report_mfu=False, jit_compile=False)
    assert set(logs) == {"loss"}
    assert close(model.get_weights(), expected.get_weights()) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == int(expected.optimizer.iterations.numpy()) == 4
    counts = [[int(v.numpy()) for v in m.optimizer.variables if v.name == "iteration"]
              for m in (model, expected)]
    assert counts[0] == counts[1] == [8]


def _tagger(loss) -> keras.Model:
    """A sequence tagger: 6 steps a sequence, the last 3 padding (token 0)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, mask_zero=True)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, metrics=["accuracy"],
                  jit_compile=False)
    return model


@pytest.mark.parametrize("loss, padding_label", [
    ("sparse_categorical_crossentropy", 0),  # the Embedding's mask on the outputs
    (keras.losses.SparseCategoricalCrossentropy(ignore_class=2), 0),  # the loss's own mask
    (keras.losses.SparseCategoricalCrossentropy(ignore_class=-1), -1),  # no class id
    (keras.losses.SparseCategoricalCrossentropy(reduction="sum"), 0),
], ids=["output mask", "ignore_class", "ignore_class -1", "sum reduction"])
def test_masked_and_summed_losses_train_and_evaluate_as_keras_fit(tmp_path, loss, padding_label):
    """The per-example loss ignored the output's Keras mask and a loss's ignore_class
    (padded steps trained; the loss read half of Keras's) and averaged a loss whose
    reduction is "sum" (32x weaker steps): each now trains as `model.fit`, and the
    eval loss and accuracy are `model.evaluate`'s (a (batch,) eval weight beside a
    (batch, steps) mask failed in Keras's metric). An ignored label of -1 is not refused by the
    start-up label check (no class id, but the loss ignores it)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 9, size=(64, 6))
    tokens[:, 3:] = 0
    labels = (tokens % 3).astype(np.int64)
    labels[:, 3:] = padding_label
    model = _tagger(loss)
    logs = tputrain.fit(model, (tokens, labels), (tokens, labels), model_dir=str(tmp_path / "run"),
                        steps=4, batch_size=32, shuffle=False, strategy=strategy_for(1),
                        report_mfu=False, jit_compile=False)
    expected = _tagger(keras.losses.deserialize(keras.losses.serialize(loss))
                       if isinstance(loss, keras.losses.Loss) else loss)
    expected.fit(tokens, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert close(model.get_weights(), expected.get_weights()) < 1e-5
    evaluated = model.evaluate(tokens, labels, verbose=0, return_dict=True)
    assert abs(logs["loss"] - evaluated["loss"]) < 1e-5
    assert abs(logs["accuracy"] - evaluated["accuracy"]) < 1e-6  # the mask weighs it too


def test_backup_and_restore_is_refused_before_training(tmp_path):
    """BackupAndRestore loaded its epoch backup over the checkpoint tputrain resumed
    from, so a crashed and rerun job trained on older weights than an uninterrupted
    one (0.048 apart). tputrain's checkpoints already resume exactly: the callback is
    refused, naming why, before a step is trained."""
    model = compiled_model()
    before = model.get_weights()
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(ValueError, match="BackupAndRestore.*resume"):
        tputrain.fit(model, train_dataset(), EVAL, model_dir=str(tmp_path / "run"),
                     steps=EPOCH_STEPS, callbacks=[backup], strategy=strategy_for(1),
                     report_mfu=False, jit_compile=False)
    assert close(model.get_weights(), before) == 0.0
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("by", ["names", "variables"])
def test_weight_decay_exclusions_are_carried_over(tmp_path, by):
    """`AdamW.exclude_from_weight_decay` lives outside the optimizer's config: the
    optimizer rebuilt from its config decayed the excluded bias. The names' pattern, or
    the variables (as the model's in the same places), are carried over: fit's weights."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(2, bias_initializer="ones")(inputs))
        optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
        if by == "names":
            optimizer.exclude_from_weight_decay(var_names=["bias"])
        else:
            optimizer.exclude_from_weight_decay(var_list=[model.layers[1].bias])
        model.compile(optimizer=optimizer, jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    model, expected = build(), build()
    tputrain.fit(model, (x, y), None, model_dir=str(tmp_path / "run"), steps=4, batch_size=32,
                 shuffle=False, strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert close(model.get_weights(), expected.get_weights()) < 1e-6


def test_an_unbuilt_sequential_model_is_built_from_the_data_as_fit_builds_it(tmp_path):
    """A Sequential model without an Input (fit builds it on the first batch) trained
    every step and then failed handing the weights back to the unbuilt model, on every
    rerun too. It is built from the data's shapes first, and gets the trained weights."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    tputrain.fit(model, (x, y), None, model_dir=str(tmp_path / "run"), steps=4, batch_size=32,
                 strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    assert model.built and [w.shape for w in model.get_weights()] == [(4, 8), (8,), (8, 2), (2,)]
    trained = model.get_weights()
    tputrain.fit(model, (x, y), None, model_dir=str(tmp_path / "run"), steps=8, batch_size=32,
                 strategy=strategy_for(1), report_mfu=False, jit_compile=False)  # resumed
    assert close(model.get_weights(), trained) > 0


@pytest.mark.parametrize("layer", ["StringLookup", "TextVectorization"])
def test_an_adapted_lookup_layer_keeps_its_vocabulary(tmp_path, layer):
    """A vocabulary learned by `adapt` is no weight and not in the layer's config: the
    rebuilt model's table was empty ("Table not initialized" at the first step). It is
    set on the rebuilt layer too, and the model trains to `fit`'s weights."""
    words = np.array(["good", "bad", "movie", "film"] * 16, dtype=object)
    labels = (words == "good").astype(np.int64)

    def build():
        keras.utils.set_random_seed(0)
        if layer == "StringLookup":
            lookup = keras.layers.StringLookup()
        else:
            lookup = keras.layers.TextVectorization(output_mode="int", output_sequence_length=1)
        lookup.adapt(words)
        inputs = keras.Input((), dtype="string")
        ids = lookup(inputs)
        ids = ids if layer == "StringLookup" else keras.layers.Flatten()(ids)
        encoded = keras.layers.CategoryEncoding(8, output_mode="one_hot")(ids)
        model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(encoded))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                      jit_compile=False)
        return model

    model, expected = build(), build()
    tputrain.fit(model, (words, labels), None, model_dir=str(tmp_path / "run"), steps=4,
                 batch_size=32, shuffle=False, strategy=strategy_for(1), report_mfu=False,
                 jit_compile=False)
    expected.fit(words, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert close(model.get_weights(), expected.get_weights()) < 1e-6


class CountAbove(keras.metrics.Metric):
    """A metric class of the user's, not registered with Keras."""

    def __init__(self, name="count_above", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(keras.ops.sum(keras.ops.cast(y_pred[:, 1] > 0.5, "float32")))

    def result(self):
        return self.count


def hit_rate(y_true, y_pred):
    """A metric function of the user's, not registered with Keras."""
    hits = keras.ops.equal(keras.ops.argmax(y_pred, -1), keras.ops.cast(y_true, "int64"))
    return keras.ops.cast(hits, "float32")


def test_a_users_own_metrics_are_computed_and_named_as_by_evaluate(tmp_path):
    """Metrics were rebuilt from the compile config's serialization: a function or a
    Metric class not registered with Keras failed, and a registered function logged
    under its serialized config instead of its name."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 2, 64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=[hit_rate, CountAbove()], jit_compile=False)
    logs = tputrain.fit(model, (x, y), (x, y), model_dir=str(tmp_path / "run"), steps=4,
                        batch_size=32, shuffle=False, strategy=strategy_for(1),
                        report_mfu=False, jit_compile=False)
    expected = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    for name in ("hit_rate", "count_above"):
        assert abs(logs[name] - expected[name]) < 1e-5, (name, logs, expected)


def test_a_run_a_callback_stopped_says_why_a_longer_call_trains_nothing(tmp_path, caplog):
    """After EarlyStopping stopped a run, a call with more steps (on the same model_dir)
    logged "training from step N to 200" and returned at step N: a stopped run stays
    stopped (a rerun must end as the first run did), but now it says so, and how to
    train on."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 4)).astype(np.float32), (rng.normal(size=256) > 0).astype(np.int64)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                  jit_compile=False)
    common = dict(model_dir=str(tmp_path / "run"), batch_size=32, eval_every=8,
                  strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    tputrain.fit(model, (x, y), (x, y), steps=80, callbacks=[
        keras.callbacks.EarlyStopping(patience=0, min_delta=10.0)], **common)
    stopped = int(model.optimizer.iterations)
    assert stopped < 80
    with caplog.at_level("WARNING"):
        tputrain.fit(model, (x, y), (x, y), steps=200, callbacks=[
            keras.callbacks.EarlyStopping(patience=20)], **common)
    said = [r.getMessage() for r in caplog.records if "stopped this run" in r.getMessage()]
    assert len(said) == 1 and f"step {stopped}" in said[0] and "new model_dir" in said[0], said


def test_accuracy_of_a_label_per_time_step_is_sparse_as_keras_resolves_it(tmp_path):
    """Labels (N, T) beside outputs (N, T, C): Keras's compile makes "accuracy" sparse
    (the labels' rank is lower); tputrain took CategoricalAccuracy, whose step failed
    to trace."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 9, size=(64, 6))
    labels = (tokens % 3).astype(np.int64)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    logs = tputrain.fit(model, (tokens, labels), (tokens, labels), model_dir=str(tmp_path / "run"),
                        steps=4, batch_size=32, shuffle=False, strategy=strategy_for(1),
                        report_mfu=False, jit_compile=False)
    expected = model.evaluate(tokens, labels, batch_size=32, verbose=0, return_dict=True)
    assert abs(logs["accuracy"] - expected["accuracy"]) < 1e-6


def test_a_dataset_of_single_examples_without_a_batch_size_names_the_fix(tmp_path):
    """A dataset of single examples needs `batch_size` (fit takes batches): it failed
    with tf.data's "Cannot unbatch an input with scalar components"."""
    x, y = data(32, 1, False)
    with pytest.raises(ValueError, match=r"single examples.*\.batch\(.*batch_size"):
        tputrain.fit(compiled_model(), tf.data.Dataset.from_tensor_slices((x, y)), EVAL,
                     model_dir=str(tmp_path / "run"), steps=2, strategy=strategy_for(1))
    assert not (tmp_path / "run").exists()


class BatchLogKeys(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.keys = set()

    def on_train_batch_end(self, batch, logs=None):
        self.keys |= set(logs or {})


def test_batch_logs_hold_the_loss_and_metrics_as_under_fit(tmp_path):
    """The batch logs carried tputrain's own loop keys (`mfu`, `examples_per_second`,
    `input/stall_fraction`...), which a TensorBoard callback wrote as `batch_mfu` and
    such: they hold the loss and the compiled metrics, as under `fit`."""
    recorder = BatchLogKeys()
    tputrain.fit(compiled_model(), train_dataset(), EVAL, model_dir=str(tmp_path / "run"),
                 steps=EPOCH_STEPS, callbacks=[recorder], strategy=strategy_for(1),
                 jit_compile=False)
    assert recorder.keys == {"loss", "accuracy"}, recorder.keys


def batch_mean_loss(y_true, y_pred):
    """A custom loss that reduces over the batch itself: one value, as Keras takes it."""
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred))


def test_a_custom_loss_that_returns_one_value_trains_as_under_fit(tmp_path):
    """A loss function returning the batch's mean (a scalar) failed deep in the traced
    step ("Invalid value passed for `per_example_loss`"); Keras takes it as the batch's
    loss: so does tputrain.fit, to `fit`'s weights."""
    x, y = data(BATCH * EPOCH_STEPS, 1, False)

    def build():
        model = compiled_model(compile=False)
        model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.5), loss=batch_mean_loss,
                      jit_compile=False)
        return model

    model, expected = build(), build()
    tputrain.fit(model, (x, y), None, model_dir=str(tmp_path / "run"), steps=EPOCH_STEPS,
                 batch_size=BATCH, shuffle=False, strategy=strategy_for(1), report_mfu=False,
                 jit_compile=False)
    expected.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert close(model.get_weights(), expected.get_weights()) < 1e-5


@pytest.mark.parametrize("replicas", [1, 2])
def test_terminate_on_nan_ends_the_run_at_the_last_finite_weights(tmp_path, replicas, caplog):
    """`keras.callbacks.TerminateOnNaN` stops `fit` without an error. tputrain's guard
    raised NonFiniteError before the callback saw the loss; now the callback's ask is
    kept: the run stops at that loop's end, the weights are those before the NaN step
    (finite, as the guard keeps them; fit's would be NaN) and they are checkpointed."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    x[3 * 8 + 1] = np.nan  # the fourth batch of 8

    def model() -> keras.Model:
        keras.utils.set_random_seed(0)
        built = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
        built.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=False,
                      loss="sparse_categorical_crossentropy")
        return built

    common = dict(batch_size=8, shuffle=False, strategy=strategy_for(replicas),
                  report_mfu=False, jit_compile=False, steps_per_loop=2)
    expected = model()
    tputrain.fit(expected, (x, y), model_dir=str(tmp_path / "three"), steps=3, **common)
    stopped = model()
    with caplog.at_level("WARNING"):
        tputrain.fit(stopped, (x, y), model_dir=str(tmp_path / "run"), steps=10,
                     callbacks=[keras.callbacks.TerminateOnNaN()], **common)
    assert close(stopped.get_weights(), expected.get_weights()) == 0.0
    assert tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints")).endswith("ckpt-4")
    said = [r.getMessage() for r in caplog.records if "TerminateOnNaN" in r.getMessage()]
    assert len(said) == 1 and "step 4" in said[0], said

    with pytest.raises(tputrain.NonFiniteError, match="step 4"):  # without it: the guard's error
        tputrain.fit(model(), (x, y), model_dir=str(tmp_path / "plain"), steps=10, **common)


def test_an_adapted_normalization_and_a_frozen_kernel_train_as_under_fit(tmp_path):
    """Two things no layer config holds (an adapted `Normalization`'s mean and variance,
    one weight's `trainable = False`) were lost in tputrain's copy: it trained on raw
    features and moved the frozen kernel, and the user's model came back worse."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(128, 4)) * 50 + 200).astype(np.float32)
    y = (x[:, 0] > 200).astype(np.int64)

    def model() -> keras.Model:
        keras.utils.set_random_seed(0)
        norm, hidden = keras.layers.Normalization(), keras.layers.Dense(8, activation="relu")
        norm.adapt(x)
        inputs = keras.Input((4,))
        built = keras.Model(inputs, keras.layers.Dense(2)(hidden(norm(inputs))))
        hidden.kernel.trainable = False
        built.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return built

    expected = model()
    expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    trained = model()
    frozen = trained.layers[2].kernel.numpy()
    tputrain.fit(trained, (x, y), model_dir=str(tmp_path / "run"), steps=8, batch_size=32,
                 shuffle=False, strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    np.testing.assert_array_equal(trained.layers[2].kernel.numpy(), frozen)
    assert close(trained.get_weights(), expected.get_weights()) < 1e-5


@pytest.mark.parametrize("reduction, replicas", [
    ("mean_with_sample_weight", 1), ("mean_with_sample_weight", 2), (None, 1)])
def test_a_loss_reduction_trains_as_under_fit(tmp_path, reduction, replicas):
    """"mean_with_sample_weight" divides by the batch's weight sum, not its size, and a
    loss without reduction is summed by Keras's compile: both were trained as the
    default mean (weights 0.08 and 2.1 apart from fit's)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    weights = rng.uniform(0.0, 0.5, size=128).astype(np.float32)

    def model() -> keras.Model:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        built = keras.Model(inputs, keras.layers.Dense(2)(
            keras.layers.Dense(8, activation="relu")(inputs)))
        built.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                      reduction=reduction))
        return built

    expected = model()
    expected.fit(x, y, sample_weight=weights, batch_size=32, epochs=2, shuffle=False,
                 verbose=0)
    trained = model()
    tputrain.fit(trained, (x, y, weights), model_dir=str(tmp_path / "run"), steps=8,
                 batch_size=32, shuffle=False, strategy=strategy_for(replicas),
                 report_mfu=False, jit_compile=False)
    assert close(trained.get_weights(), expected.get_weights()) < 1e-5


def _two_layer(x_shape: int, init: float | None = None) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((x_shape,))
    hidden = keras.layers.Dense(8)(inputs)
    kernel = keras.initializers.Constant(init) if init is not None else "glorot_uniform"
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32",
                                                   kernel_initializer=kernel)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    return model


def test_a_model_built_under_mixed_float16_keeps_its_loss_scaling(tmp_path):
    """The GPU recipe (policy mixed_float16, then build and compile: a LossScaleOptimizer):
    the run's precision stayed float32, so the optimizer lost its loss scaling while
    the layers still computed in float16, and tiny gradients underflowed to 0 (the
    hidden kernel never moved; under fit it does). The run now takes the model's policy."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype(np.float32), np.zeros((128, 1), np.float32)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        expected, trained = _two_layer(4, 1e-4), _two_layer(4, 1e-4)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    before = trained.get_weights()[0].copy()
    expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    tputrain.fit(trained, (x, y), model_dir=str(tmp_path / "run"), steps=8, batch_size=32,
                 shuffle=False, strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    assert np.abs(trained.get_weights()[0] - before).max() > 0
    np.testing.assert_allclose(trained.get_weights()[0], expected.get_weights()[0],
                               rtol=1e-2, atol=1e-9)


def test_a_precision_a_built_model_cannot_take_is_said(tmp_path, caplog):
    """precision="mixed_bfloat16" with a model passed built: its layers keep the float32
    policies they were built with (the run logged bf16 and computed in float32)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), np.zeros((64, 1), np.float32)
    with caplog.at_level("WARNING"):
        tputrain.fit(_two_layer(4), (x, y), model_dir=str(tmp_path / "run"), steps=2,
                     batch_size=32, strategy=strategy_for(1), report_mfu=False,
                     jit_compile=False, precision="mixed_bfloat16")
    said = [r.getMessage() for r in caplog.records if "mixed_bfloat16" in r.getMessage()
            and "float32" in r.getMessage()]
    assert len(said) == 1 and "tputrain.fit(build" in said[0], said


def test_fit_leaves_the_users_numpy_and_python_generators_as_they_were(tmp_path):
    """The Trainer seeds the process's generators as it builds (documented on
    `Trainer.seed`); through `tputrain.fit`, as through `model.fit`, a notebook that
    draws data between calls kept getting the same "random" numbers after each call."""
    import random

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), np.zeros((64, 1), np.float32)
    model = _two_layer(4)
    np.random.seed(5)
    random.seed(5)
    expected = (np.random.rand(3), random.random())
    np.random.seed(5)
    random.seed(5)
    tputrain.fit(model, (x, y), model_dir=str(tmp_path / "run"), steps=2,
                 batch_size=32, strategy=strategy_for(1), report_mfu=False, jit_compile=False)
    np.testing.assert_array_equal(np.random.rand(3), expected[0])
    assert random.random() == expected[1]


def test_a_continued_fit_gives_the_callbacks_each_epoch_end_once(tmp_path):
    """A second `tputrain.fit` call continuing a run gave its last epoch's
    `on_epoch_end` again (ModelCheckpoint saved twice, an epoch counter counted one
    more): the checkpoint the call resumes from predates the final evaluation the
    callbacks were given, and the state restored from it was older than their own."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype(np.float32), (rng.normal(size=128) > 0).astype(np.int64)

    class Events(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.events = []

        def on_epoch_begin(self, epoch, logs=None):
            self.events.append(f"begin{epoch}")

        def on_epoch_end(self, epoch, logs=None):
            self.events.append(f"end{epoch}")

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=False)
    events, strategy = Events(), strategy_for(1)  # the same arguments: the run continues
    for steps in (8, 16):
        tputrain.fit(model, (x, y), (x, y), model_dir=str(tmp_path / "run"), steps=steps,
                     batch_size=32, eval_every=4, steps_per_loop=4, callbacks=[events],
                     strategy=strategy, report_mfu=False, jit_compile=False)
    ends = [e for e in events.events if e.startswith("end")]
    assert ends == ["end0", "end1", "end2", "end3"], events.events


def test_a_continued_fit_keeps_the_rate_a_callback_set_at_the_last_evaluation(tmp_path):
    """ReduceLROnPlateau halves the rate at each evaluation after the first (evaluations
    at 10, 20, 30). A second call continuing the run restored the rate of the checkpoint
    at step 20, written before the evaluation there: the cut made at 20 was lost, and
    steps 21-30 trained at 0.1 (the run ended at 0.05, not 0.025)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 4)).astype(np.float32), (rng.normal(size=128) > 0).astype(np.int64)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    cut = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0,
                                            min_delta=10.0)  # no evaluation improves enough
    strategy = strategy_for(1)  # the same arguments: the run continues
    rates = []
    for steps in (20, 30):
        tputrain.fit(model, (x, y), (x, y), model_dir=str(tmp_path / "run"), steps=steps,
                     batch_size=32, eval_every=10, callbacks=[cut], strategy=strategy,
                     report_mfu=False, jit_compile=False)
        rates.append(float(model.optimizer.learning_rate.numpy()))
    assert rates == pytest.approx([0.05, 0.025]), rates


def test_a_mixed_float16_run_saved_without_loss_scaling_still_resumes(tmp_path, caplog):
    """A run saved before tputrain.fit took a built model's mixed_float16 (no loss
    scaling in its checkpoints, as with precision="float32") was refused on resume as
    another model's checkpoint: the loss-scale optimizer's variables were missing. It
    resumes as it was saved, and a warning says how to get loss scaling."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), np.zeros((64, 1), np.float32)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        first, second = _two_layer(4), _two_layer(4)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    common = dict(model_dir=str(tmp_path / "run"), batch_size=32, strategy=strategy_for(1),
                  report_mfu=False, jit_compile=False)
    tputrain.fit(first, (x, y), steps=2, precision="float32", **common)
    with caplog.at_level("WARNING"):
        tputrain.fit(second, (x, y), steps=4, **common)
    assert int(second.optimizer.iterations.numpy()) == 4
    said = [r.getMessage() for r in caplog.records if "loss scaling" in r.getMessage()]
    assert len(said) == 1 and "new model_dir" in said[0], said


@pytest.mark.parametrize("keyword, equivalent", [
    ("epochs", "steps="), ("steps_per_epoch", "eval_every="), ("initial_epoch", "model_dir"),
    ("validation_split", "eval_data="), ("validation_data", "eval_data="),
    ("validation_freq", "eval_every="), ("validation_steps", "eval_steps="),
    ("verbose", "progress_bar="), ("sample_weight", "(x, y, sample_weight)"),
    ("y", "(x, y)")])
def test_a_model_fit_keyword_names_tputrain_fits_equivalent(tmp_path, keyword, equivalent):
    """`tputrain.fit(..., validation_split=0.2)` said `Trainer.__init__() got an unexpected
    keyword argument`: it names tputrain.fit, model.fit and the argument to use instead."""
    with pytest.raises(TypeError) as caught:
        tputrain.fit(compiled_model(), (EVAL[0], EVAL[1]), model_dir=str(tmp_path / "run"),
                     steps=1, **{keyword: 1})
    message = str(caught.value)
    assert message.startswith(f"tputrain.fit() takes no {keyword}=")
    assert "model.fit" in message and equivalent in message and "\n" not in message, message
    assert not (tmp_path / "run").exists()  # refused before anything is built


@pytest.mark.parametrize("callback, wins", [("csv_logger", "config"),
                                            ("reduce_lr", "checkpoint")])
def test_a_rerun_with_another_rate_says_which_one_wins(tmp_path, caplog, callback, wins):
    """With any callback (a CSVLogger alone) a rerun with a lower rate trained silently at
    the checkpoint's: a callback that never sets the rate leaves it to the config, as
    without callbacks; with one that sets it the checkpoint's wins; the log says which."""
    def run(rate: float, steps: int) -> keras.Model:
        model = compiled_model()
        model.optimizer.learning_rate = rate
        made = {"csv_logger": lambda: keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                "reduce_lr": lambda: keras.callbacks.ReduceLROnPlateau(patience=100)}
        tputrain.fit(model, train_dataset(), EVAL, model_dir=str(tmp_path / "run"),
                     steps=steps, eval_every=EPOCH_STEPS, callbacks=[made[callback]()],
                     strategy=strategy_for(1), report_mfu=False, jit_compile=False)
        return model

    run(0.5, EPOCH_STEPS)
    with caplog.at_level("WARNING"):
        rerun = run(0.001, 2 * EPOCH_STEPS)
    said = [r.getMessage() for r in caplog.records if "in the checkpoint: using" in r.getMessage()]
    assert len(said) == 1 and f"using the {wins}'s" in said[0], said
    expected = {"config": 0.001, "checkpoint": 0.5}[wins]
    assert float(keras.ops.convert_to_numpy(rerun.optimizer.learning_rate)) == \
        pytest.approx(expected)
    if wins == "checkpoint":
        assert "ReduceLROnPlateau" in said[0]
