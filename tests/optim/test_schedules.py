"""Schedules: warmup + cosine/linear/constant values at chosen steps, linear scaling rule."""

import math

import gin
import keras
import numpy as np
import pytest

import tputrain
import tputrain.config.registry  # noqa: F401  gin's configurables (docs/configuration.md)
from tputrain.optim.schedules import WarmupDecay, scale_learning_rate, warmup_schedule


def values(schedule, steps):
    return [float(schedule(step)) for step in steps]


def test_cosine_with_warmup_at_chosen_steps():
    schedule = WarmupDecay(2.0, total_steps=110, warmup_steps=10, decay="cosine",
                           end_learning_rate=0.2)
    steps = [0, 5, 10, 35, 60, 85, 110, 500]
    cosine = lambda p: 0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    expected = [0.0, 1.0, 2.0, cosine(0.25), 1.1, cosine(0.75), 0.2, 0.2]
    np.testing.assert_allclose(values(schedule, steps), expected, rtol=1e-6, atol=1e-7)


def test_linear_and_constant_decay():
    linear = WarmupDecay(1.0, total_steps=104, warmup_steps=4, decay="linear")
    np.testing.assert_allclose(values(linear, [1, 4, 54, 104, 200]), [0.25, 1.0, 0.5, 0.0, 0.0],
                               atol=1e-7)
    constant = WarmupDecay(0.3, total_steps=50, warmup_steps=3, decay="constant")
    np.testing.assert_allclose(values(constant, [0, 2, 3, 49, 1000]), [0.0, 0.2, 0.3, 0.3, 0.3],
                               rtol=1e-6)
    no_warmup = WarmupDecay(1.0, total_steps=10, decay="cosine")
    assert float(no_warmup(0)) == pytest.approx(1.0)


def test_linear_scaling_rule_through_gin():
    assert scale_learning_rate(0.1, 1024, 256) == pytest.approx(0.4)
    gin.parse_config("""
        GLOBAL_BATCH = 1024
        warmup_schedule.learning_rate = 0.1
        warmup_schedule.reference_batch_size = 256
        warmup_schedule.global_batch_size = %GLOBAL_BATCH
        warmup_schedule.total_steps = 100
        warmup_schedule.warmup_steps = 10
        build_optimizer.name = 'sgd'
        build_optimizer.learning_rate = @warmup_schedule()
    """)
    optimizer = tputrain.build_optimizer()
    schedule = keras.optimizers.schedules.deserialize(optimizer.get_config()["learning_rate"])
    assert isinstance(schedule, WarmupDecay)
    assert schedule.peak_learning_rate == pytest.approx(0.4)
    # The optimizer evaluates it at its iteration count: 5 of 10 warmup steps.
    optimizer.iterations.assign(5)
    assert float(keras.ops.convert_to_numpy(optimizer.learning_rate)) == pytest.approx(0.2)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="global_batch_size"):
        warmup_schedule(0.1, total_steps=10, reference_batch_size=256)
    with pytest.raises(ValueError, match="cosine, linear, constant"):
        WarmupDecay(0.1, total_steps=10, decay="exp")
    with pytest.raises(ValueError, match="lower warmup_steps"):
        WarmupDecay(0.1, total_steps=10, warmup_steps=20)


def test_serializes():
    schedule = WarmupDecay(0.5, total_steps=20, warmup_steps=2, decay="linear", end_learning_rate=0.1)
    restored = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(schedule))
    assert values(restored, [1, 5, 20]) == pytest.approx(values(schedule, [1, 5, 20]))
