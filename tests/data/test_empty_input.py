"""Tests for tputrain/data/empty_input.py's probe of a pass (the errors: tests/data/test_positional.py)."""

import tensorflow as tf
from iterators import autotune_of_iterators

from tputrain.data.empty_input import yields


def test_a_pass_is_probed_without_autotuning_and_the_users_options_stay(monkeypatch):
    # The probe's iterator is freed after one element (see tputrain.data.options.without_autotune).
    dataset = tf.data.Dataset.range(4).map(lambda x: x + 1, num_parallel_calls=tf.data.AUTOTUNE)
    seen = autotune_of_iterators(monkeypatch)
    assert yields(dataset) and not yields(dataset.take(0))
    assert seen == [False, False]
    assert dataset.options().autotune.enabled is None
