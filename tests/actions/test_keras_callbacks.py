"""`KerasCallbacks`: which callbacks own the learning rate. Only a callback that can
set it does (then a resume takes the checkpoint's rate); with Keras's callbacks that
never touch it, a rerun's lower rate wins, as without callbacks."""

from __future__ import annotations

import keras
import pytest

from tputrain.actions.keras_callbacks import KerasCallbacks


class Logger(keras.callbacks.CSVLogger):
    """A subclass of a rate-neutral callback: it may set the rate, so it owns it."""


class Own(keras.callbacks.Callback):
    """A user's callback: tputrain cannot know what it does to the rate."""


def neutral(tmp_path) -> list[keras.callbacks.Callback]:
    return [keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
            keras.callbacks.TensorBoard(str(tmp_path / "tb")),
            keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
            keras.callbacks.EarlyStopping(restore_best_weights=True),
            keras.callbacks.TerminateOnNaN(), keras.callbacks.ProgbarLogger(),
            keras.callbacks.History(), keras.callbacks.SwapEMAWeights()]


def test_rate_neutral_keras_callbacks_leave_the_rate_to_the_config(tmp_path):
    """A CSVLogger alone handed the rate to the checkpoint: a rerun with a lower rate
    trained silently at the old one."""
    callbacks = KerasCallbacks(neutral(tmp_path))
    assert not callbacks.owns_learning_rate and callbacks.learning_rate_setters == []


@pytest.mark.parametrize("setter", [
    lambda: keras.callbacks.ReduceLROnPlateau(),
    lambda: keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate),
    lambda: keras.callbacks.LambdaCallback(), lambda: Own(), lambda: Logger("x.csv")])
def test_a_callback_that_may_set_the_rate_owns_it(tmp_path, setter):
    callback = setter()
    callbacks = KerasCallbacks([*neutral(tmp_path), callback])
    assert callbacks.owns_learning_rate
    assert callbacks.learning_rate_setters == [type(callback).__name__]
