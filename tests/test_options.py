"""TrainerOptions: the knobs validated once, before anything is built."""

import dataclasses

import pytest

from tputrain.options import TrainerOptions


def test_defaults_and_derived_values():
    options = TrainerOptions(eval_every=50)
    assert options.checkpoint_every == 50  # as eval_every when not given
    assert TrainerOptions().checkpoint_every == 1000
    assert options.jit_compile == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.train_steps = 5


@pytest.mark.parametrize("kwargs, message", [
    ({"train_steps": 0}, "train_steps"),
    ({"global_batch_size": "64"}, "global_batch_size"),
    ({"eval_every": 0}, "eval_every"),
    ({"jit_compile": "yes"}, "True, False or 'auto'"),
    ({"input_mode": "device"}, "input_mode must be one of"),
    ({"profile_steps": (5, 5)}, "0 <= start < stop"),
    ({"steps_per_fetch": 0}, "steps_per_fetch must be an int >= 1"),
])
def test_bad_values_name_the_knob(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        TrainerOptions(**kwargs)


def test_steps_per_fetch_shrinks_to_divide_every_boundary():
    assert TrainerOptions(steps_per_fetch=100, steps_per_loop=20, train_steps=1000).steps_per_fetch == 20
    assert TrainerOptions(steps_per_fetch=4, steps_per_loop=8, train_steps=10).steps_per_fetch == 2


def test_check_replicas_names_a_batch_that_works():
    options = TrainerOptions(global_batch_size=12, accumulation_steps=4)
    with pytest.raises(ValueError, match="use a multiple of 8"):
        options.check_replicas(2, custom_train_step=False, task_name="T")
    with pytest.raises(ValueError, match="override Task.compute_gradients"):
        TrainerOptions(accumulation_steps=2).check_replicas(1, True, "T")
    TrainerOptions(global_batch_size=16).check_replicas(4, custom_train_step=False, task_name="T")


@pytest.mark.parametrize("value, error, message", [
    (0, ValueError, "steps_per_program must be >= 1"),
    ("fast", ValueError, "steps_per_program must be an int >= 1 or 'auto'"),
    (2.5, TypeError, "steps_per_program must be an int"),
])
def test_steps_per_program_names_what_it_takes(value, error, message):
    with pytest.raises(error, match=message):
        TrainerOptions(steps_per_program=value)
