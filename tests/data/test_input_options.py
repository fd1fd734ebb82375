"""Tests for tputrain/data/options.py: `without_autotune` (the InputOptions: test_data.py)."""

import logging

import tensorflow as tf

from tputrain.data.options import without_autotune


def test_turning_autotuning_off_on_a_tuned_dataset_says_nothing(caplog):
    """The start-up probes read a copy without autotuning. A pipeline whose options turn
    it on (an InputOptions' `tf_options`) made tf.data log "Changing the value of
    option enabled from True to False" on every run's console."""
    options = tf.data.Options()
    options.autotune.enabled = True
    dataset = tf.data.Dataset.range(4).with_options(options)
    with caplog.at_level(logging.INFO):
        probed = without_autotune(dataset)
    assert probed.options().autotune.enabled is False
    assert dataset.options().autotune.enabled is True
    assert not [r for r in caplog.records if "Changing the value" in r.getMessage()], caplog.records


def test_an_input_options_pipeline_leaves_autotuning_at_tf_datas_default():
    """InputOptions(autotune=True) set the option explicitly, and each probe's copy
    (off) then made tf.data's C++ log "Changing the value of option field enabled from
    true to false", 6 lines on every digits run: on is left unset (tf.data's default)."""
    from tputrain.data.options import InputOptions
    assert InputOptions().tf_options().autotune.enabled is None
    assert InputOptions(autotune=False).tf_options().autotune.enabled is False
