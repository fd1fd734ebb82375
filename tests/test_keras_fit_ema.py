"""Keras's `use_ema` carried over: `tputrain.fit` on a model compiled with
`Optimizer(use_ema=True)` evaluates the raw weights during training and ends with the
user's model holding the optimizer's averages, as `model.fit` does (its
`finalize_variable_values`), on 1 and 2 replicas; a continued run resumes the averages
bitwise."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tputrain.keras_fit import kept_trainer
from tiny import strategy_for

BATCH, EPOCH_STEPS, EPOCHS = 8, 6, 2

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.2, momentum=0.5, use_ema=True,
                                                 ema_momentum=0.9),
    "adam_overwrite": lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9,
                                                    ema_overwrite_frequency=5),  # at steps 5, 10
    "adam_raw": lambda: keras.optimizers.Adam(0.05),  # no Keras averages: tputrain's own
}


def data(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 5)).astype(np.float32)
    return x, (np.argmax(x[:, :3], -1)).astype(np.int64)


TRAIN, EVAL = data(BATCH * EPOCH_STEPS, 1), data(20, 2)  # 20: a padded last batch on 2


def compiled_model(optimizer: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer=OPTIMIZERS[optimizer](), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class ValLosses(keras.callbacks.Callback):
    """Each epoch's val_loss, as the callbacks are given it."""

    def __init__(self):
        super().__init__()
        self.losses: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["val_loss"]))


def keras_fit(optimizer: str, epochs: int = EPOCHS) -> tuple[keras.Model, list[float]]:
    model = compiled_model(optimizer)
    history = model.fit(*TRAIN, batch_size=BATCH, epochs=epochs, validation_data=EVAL,
                        shuffle=False, verbose=0)
    return model, history.history["val_loss"]


def tputrain_fit(model: keras.Model, model_dir, steps: int, replicas: int = 1,
                 callbacks=(), jit_compile: bool | str = False) -> dict[str, float]:
    return tputrain.fit(model, TRAIN, EVAL, model_dir=str(model_dir), steps=steps,
                        batch_size=BATCH, shuffle=False, eval_every=EPOCH_STEPS,
                        callbacks=list(callbacks), strategy=strategy_for(replicas),
                        report_mfu=False, jit_compile=jit_compile)


def gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def slow(*values) -> pytest.param:
    """A variant whose promise a sibling in the default tier keeps (tests/conftest.py)."""
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize("optimizer, replicas, jit_compile", [
    # "auto" on 2 replicas: the update compiled on each device (tputrain/loop/update.py)
    slow("adam", 1, False), ("adam", 2, False), slow("adam", 2, "auto"),
    ("sgd_momentum", 1, False), slow("sgd_momentum", 2, False),
    slow("adam_overwrite", 1, False), ("adam_overwrite", 2, "auto")])
def test_fit_ends_on_model_fits_averaged_weights(tmp_path, optimizer, replicas, jit_compile):
    """The user's model ends with `model.fit`'s weights (the averages); each evaluation
    during training is of the raw weights, as fit's val_loss is; the returned metrics
    are those of the model returned (`model.evaluate` on fit's), not the last val_loss."""
    model, losses = compiled_model(optimizer), ValLosses()
    logs = tputrain_fit(model, tmp_path / "run", EPOCHS * EPOCH_STEPS, replicas, [losses],
                        jit_compile)
    expected, val_losses = keras_fit(optimizer)
    evaluated = expected.evaluate(*EVAL, batch_size=BATCH, verbose=0)
    print(f"{optimizer} replicas={replicas} jit_compile={jit_compile}: weights gap "
          f"{gap(model.get_weights(), expected.get_weights()):.2e}; val_loss {losses.losses} "
          f"vs fit's {val_losses}; returned {logs['loss']:.6f}, fit's model {evaluated:.6f}")
    assert gap(model.get_weights(), expected.get_weights()) < 1e-5
    assert losses.losses == pytest.approx(val_losses, abs=1e-5)
    assert logs["loss"] == pytest.approx(evaluated, abs=1e-5)
    assert abs(evaluated - val_losses[-1]) > 1e-3  # the averages are not the raw weights


def test_a_continued_run_resumes_the_averages_bitwise(tmp_path):
    """A second call continuing the run (the kept Trainer), and a new Trainer on the
    same model_dir (a new model: the checkpoint's raw weights and averages), end on the
    uninterrupted run's weights bit for bit; the checkpoint holds the averages."""
    once = compiled_model("adam")
    tputrain_fit(once, tmp_path / "once", 3 * EPOCH_STEPS)
    twice = compiled_model("adam")
    tputrain_fit(twice, tmp_path / "twice", EPOCH_STEPS)
    tputrain_fit(twice, tmp_path / "twice", 2 * EPOCH_STEPS)
    assert kept_trainer(twice) is not None  # continued on the first call's Trainer
    fresh = compiled_model("adam")
    tputrain_fit(fresh, tmp_path / "twice", 3 * EPOCH_STEPS)
    assert gap(twice.get_weights(), once.get_weights()) > 1e-4  # 2 epochs vs 3
    assert gap(fresh.get_weights(), once.get_weights()) == 0.0
    again = compiled_model("adam")  # a finished run's rerun: ends on the averages again
    tputrain_fit(again, tmp_path / "once", 3 * EPOCH_STEPS)
    assert gap(again.get_weights(), once.get_weights()) == 0.0
    saved = compiled_model("adam")  # final.weights.h5: the weights the model was given
    saved.load_weights(tmp_path / "once" / "final.weights.h5")
    assert gap(saved.get_weights(), once.get_weights()) == 0.0
    # The checkpoint holds the optimizer's averages: those the model was given.
    optimizer = kept_trainer(fresh).optimizer
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
        str(tmp_path / "twice" / "checkpoints")))
    averages = [reader.get_tensor(f"optimizer/_variables/{n}/.ATTRIBUTES/VARIABLE_VALUE")
                for n, v in enumerate(optimizer.variables) if v.path.endswith("_average")]
    assert len(averages) == 4
    assert gap(averages, fresh.get_weights()) == 0.0


def test_restore_best_weights_ends_on_the_best_raw_weights_as_fit_does(tmp_path):
    """`fit` puts the averages in before the callbacks' on_train_end, so EarlyStopping's
    `restore_best_weights` ends on the best epoch's raw weights: here the last epoch's
    (val_loss falls every epoch), which a finalization after the callbacks would miss."""
    def stopper():
        return keras.callbacks.EarlyStopping(patience=1, restore_best_weights=True)

    model = compiled_model("adam")
    tputrain_fit(model, tmp_path / "run", 3 * EPOCH_STEPS, callbacks=[stopper()])
    expected = compiled_model("adam")
    history = expected.fit(*TRAIN, batch_size=BATCH, epochs=3, validation_data=EVAL,
                           shuffle=False, verbose=0, callbacks=[stopper()]).history
    averaged, _ = keras_fit("adam", epochs=3)
    assert np.all(np.diff(history["val_loss"]) < 0)  # the best epoch is the last
    assert gap(model.get_weights(), expected.get_weights()) < 1e-5
    assert gap(expected.get_weights(), averaged.get_weights()) > 1e-3


def test_overwrite_without_the_per_device_update_on_two_replicas_is_refused(tmp_path):
    """Keras's own update cannot overwrite the weights inside a replica (model.fit under
    a MirroredStrategy fails alike): refused in one line naming the fix, untrained."""
    with pytest.raises(ValueError, match=r"ema_overwrite_frequency=5.*jit_compile") as caught:
        tputrain.fit(compiled_model("adam_overwrite"), TRAIN, EVAL,
                     model_dir=str(tmp_path / "run"), steps=EPOCH_STEPS, batch_size=BATCH,
                     strategy=strategy_for(2), report_mfu=False, jit_compile=False)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("replicas", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_ema_decay_evaluates_the_averages_as_swap_ema_weights_does(tmp_path, replicas):
    """To evaluate the averages during training (Keras's `SwapEMAWeights` callback),
    `ema_decay=ema_momentum`: tputrain's own average has Keras's first-step rule and
    order (set to the weights after the first update, then averaged after each), so
    each val_loss is fit's under SwapEMAWeights, and the model ends on the same."""
    model, losses = compiled_model("adam"), ValLosses()
    tputrain.fit(model, TRAIN, EVAL, model_dir=str(tmp_path / "run"),
                 steps=EPOCHS * EPOCH_STEPS, batch_size=BATCH, shuffle=False,
                 eval_every=EPOCH_STEPS, callbacks=[losses], ema_decay=0.9,
                 strategy=strategy_for(replicas), report_mfu=False, jit_compile=False)
    expected = compiled_model("adam")
    history = expected.fit(*TRAIN, batch_size=BATCH, epochs=EPOCHS, validation_data=EVAL,
                           shuffle=False, verbose=0,
                           callbacks=[keras.callbacks.SwapEMAWeights()]).history
    _, raw_losses = keras_fit("adam")
    print(f"replicas={replicas}: {losses.losses} vs SwapEMAWeights {history['val_loss']}, "
          f"raw {raw_losses}")
    assert losses.losses == pytest.approx(history["val_loss"], abs=1e-5)
    assert abs(history["val_loss"][-1] - raw_losses[-1]) > 1e-3
    assert gap(model.get_weights(), expected.get_weights()) < 1e-5


def test_ema_decay_hands_back_the_averages_it_evaluated(tmp_path):
    """`ema_decay` without Keras's `use_ema`: the returned metrics were the averages'
    while the model handed back held the raw weights (model.evaluate gave other numbers).
    The model gets the averages, as every evaluation, predict and export use them, and
    model_dir/final.weights.h5 holds them (the last checkpoint keeps the raw ones)."""
    model, raw = compiled_model("adam_raw"), compiled_model("adam_raw")
    logs = tputrain.fit(model, TRAIN, EVAL, model_dir=str(tmp_path / "run"),
                        steps=EPOCHS * EPOCH_STEPS, batch_size=BATCH, shuffle=False,
                        eval_every=EPOCH_STEPS, ema_decay=0.9, strategy=strategy_for(1),
                        report_mfu=False, jit_compile=False)
    tputrain_fit(raw, tmp_path / "raw", EPOCHS * EPOCH_STEPS)
    evaluated = model.evaluate(*EVAL, batch_size=BATCH, verbose=0)
    assert logs["loss"] == pytest.approx(evaluated, abs=1e-5)
    assert gap(model.get_weights(), raw.get_weights()) > 1e-3  # not the raw weights
    saved = compiled_model("adam_raw")
    saved.load_weights(str(tmp_path / "run" / "final.weights.h5"))
    assert gap(saved.get_weights(), model.get_weights()) == 0.0
