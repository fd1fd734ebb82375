"""Tests for tputrain/core/checks.py: one rule and one wording for every argument check."""

import numpy as np
import pytest

from tputrain.core.checks import check_bool, check_int, nearest_multiple, per_replica_batch
from tputrain.data import InputContext, InputOptions, TFDSInput, TFRecordInput

FEATURES = {"x": ([2], "float32")}


@pytest.mark.parametrize("value", ["3", 2.0, 250.9, True, [1]])
def test_check_int_refuses_what_is_not_a_whole_number(value):
    with pytest.raises(TypeError, match=r"^Owner\.steps must be an int, got "):
        check_int("Owner", "steps", value, 1)


def test_check_int_minimum_none_and_numpy_ints():
    with pytest.raises(ValueError, match=r"^Owner\.steps must be >= 1, got 0$"):
        check_int("Owner", "steps", 0, 1)
    with pytest.raises(ValueError, match=r"must be >= 1 or None, got -2$"):
        check_int("Owner", "steps", -2, 1, allow_none=True)
    with pytest.raises(TypeError, match="must be an int, got None"):
        check_int("Owner", "steps", None, 1)
    assert check_int("Owner", "steps", None, 1, allow_none=True) is None
    checked = check_int("Owner", "steps", np.int64(5), 1)
    assert checked == 5 and type(checked) is int  # plain int: tf.data options refuse numpy


def test_check_bool():
    assert check_bool("Owner", "shuffle", False) is False
    assert check_bool("Owner", "deterministic", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"^Owner\.shuffle must be True or False, got 'no'$"):
        check_bool("Owner", "shuffle", "no")
    with pytest.raises(TypeError, match="True or False, got 1"):
        check_bool("Owner", "shuffle", 1)


@pytest.mark.parametrize("build, owner, name", [
    (lambda v: TFRecordInput("f-*", FEATURES, shuffle_buffer=v), "TFRecordInput", "shuffle_buffer"),
    (lambda v: TFDSInput("mnist", "train", shuffle_buffer=v), "TFDSInput", "shuffle_buffer"),
    (lambda v: InputContext(num_replicas_in_sync=v), "InputContext", "num_replicas_in_sync"),
    (lambda v: InputOptions(threadpool_size=v), "InputOptions", "threadpool_size"),
])
def test_every_builder_checks_ints_the_same_way(build, owner, name):
    """Before, TFDSInput raised ValueError for a str where the others raised TypeError."""
    with pytest.raises(TypeError, match=rf"{owner}\.{name} must be an int"):
        build("8")
    with pytest.raises(ValueError, match=rf"{owner}\.{name} must be >= 1"):
        build(0)


@pytest.mark.parametrize("build, owner", [
    (lambda v: TFRecordInput("f-*", FEATURES, repeat=v), "TFRecordInput"),
    (lambda v: TFDSInput("mnist", "train", repeat=v), "TFDSInput"),
])
def test_every_builder_checks_flags_the_same_way(build, owner):
    with pytest.raises(TypeError, match=rf"{owner}\.repeat must be True or False, got 'yes'"):
        build("yes")


def test_per_replica_batch_and_its_errors():
    assert per_replica_batch(64, 4) == 16
    assert per_replica_batch(64, 4, micro_batches=2) == 8
    with pytest.raises(ValueError, match=r"global batch 100 is not divisible by 8 replicas: "
                                         r"use a multiple of 8 \(e\.g\. 96\)"):
        per_replica_batch(100, 8)
    with pytest.raises(ValueError, match="global batch 12 does not split into 8 micro-batches "
                                         "over 2 replicas: use a multiple of 16"):
        per_replica_batch(12, 2, micro_batches=8)
    assert nearest_multiple(3, 8) == 8  # never suggests 0
    assert nearest_multiple(30, 8) == 32
