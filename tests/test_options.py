"""TrainerOptions: the knobs validated once, before anything is built."""

import dataclasses

import numpy as np
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
    ({"remat": "everything"}, "Trainer.remat must be one of"),
])
def test_bad_values_name_the_knob(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        TrainerOptions(**kwargs)


@pytest.mark.parametrize("name", ["jit_compile", "plan_trial"])
@pytest.mark.parametrize("value, expected", [
    (1, True), (0, False), (np.True_, True), (np.False_, False), (True, True), ("auto", "auto")])
def test_a_true_or_false_of_another_type_is_read_as_the_bool(name, value, expected):
    """jit_compile=1 passed the check and then ran with XLA off (the plan asks `is True`)."""
    assert getattr(TrainerOptions(**{name: value}), name) is expected


@pytest.mark.parametrize("name", ["jit_compile", "plan_trial"])
@pytest.mark.parametrize("value", [2, None, "True", 1.0, np.int64(2)])
def test_neither_a_bool_nor_auto_is_refused(name, value):
    with pytest.raises(ValueError, match=f"Trainer.{name} must be True, False or 'auto'"):
        TrainerOptions(**{name: value})


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


def test_every_options_class_is_public_and_trainer_knobs_need_no_gin():
    import dataclasses

    import tputrain

    options = tputrain.TrainerOptions(
        precision=tputrain.PrecisionOptions("mixed_bfloat16", ["logits"]),
        checkpoint=tputrain.CheckpointOptions(async_save=True, check_finite=False),
        profiling=tputrain.ProfilingOptions(peak_flops_per_device=1e9))
    assert options.precision.keep_float32_layers == ("logits",)
    assert options.checkpoint.async_save and not options.checkpoint.check_finite
    assert options.profiling.peak_flops_per_device == 1e9
    assert tputrain.TrainerOptions(precision="float32").precision == tputrain.PrecisionOptions("float32")
    assert dataclasses.is_dataclass(tputrain.CommunicationOptions)
    with pytest.raises(TypeError, match="CheckpointOptions"):
        tputrain.TrainerOptions(checkpoint={"async_save": True})


def test_old_gin_names_fill_the_options_with_a_warning_naming_the_replacement(caplog):
    import gin

    import tputrain
    import tputrain.config.registry  # noqa: F401  before gin's own parse (docs/configuration.md)

    gin.clear_config()
    try:
        gin.parse_config("Checkpointer.async_save = True\n"
                         "peak_flops.device_kind = 'A100'\n"
                         "CheckpointOptions.check_finite = False")
        with caplog.at_level("WARNING"):
            options = tputrain.TrainerOptions()
        assert options.checkpoint == tputrain.CheckpointOptions(async_save=True, check_finite=False)
        assert options.profiling.device_kind == "A100"
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "Checkpointer.async_save = True is deprecated" in messages
        assert "CheckpointOptions.async_save = True" in messages
        assert "ProfilingOptions.device_kind" in messages
        # What the caller passes wins over both.
        assert not tputrain.CheckpointOptions(async_save=False).async_save
    finally:
        gin.clear_config()
