"""Tests for tputrain/precision/policy.py: policies, dtypes of variables/compute, helpers."""

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from tputrain import precision


@pytest.fixture(autouse=True)
def restore_float32():
    """The policy is process-global: leave it as other tests expect."""
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("name", precision.VALID_POLICIES)
def test_sets_and_returns_the_keras_policy(name):
    assert precision.set_precision_policy(name) == name
    assert keras.mixed_precision.global_policy().name == name


def test_default_is_float32_off_tpu():
    keras.mixed_precision.set_global_policy("mixed_float16")
    assert precision.set_precision_policy() == "float32"
    cpu = tf.distribute.OneDeviceStrategy("/cpu:0")
    assert precision.set_precision_policy(strategy=cpu) == "float32"
    assert keras.mixed_precision.global_policy().name == "float32"


def test_unknown_policy_lists_the_choices():
    with pytest.raises(ValueError, match="Unknown precision policy 'bf16'") as info:
        precision.set_precision_policy("bf16")
    for name in precision.VALID_POLICIES:
        assert name in str(info.value)


def test_mixed_bfloat16_dense_keeps_float32_variables_and_computes_in_bf16():
    precision.set_precision_policy("mixed_bfloat16")
    layer = keras.layers.Dense(4)

    out = layer(tf.ones([2, 3]))

    assert layer.compute_dtype == "bfloat16"
    assert out.dtype == tf.bfloat16
    assert {v.dtype for v in layer.weights} == {"float32"}


def test_to_float32_casts_only_floating_leaves():
    nest = {
        "logits": tf.ones([2], tf.bfloat16),
        "half": tf.ones([2], tf.float16),
        "double": tf.ones([2], tf.float64),
        "labels": tf.ones([2], tf.int32),
        "numpy": np.ones([2], np.float64),
        "name": "kept",
    }

    out = precision.to_float32(nest)

    for key in ("logits", "half", "double"):
        assert out[key].dtype == tf.float32
    assert out["labels"].dtype == tf.int32
    assert out["numpy"].dtype == np.float32
    assert out["name"] == "kept"


def test_to_float32_lets_bf16_logits_meet_a_float32_loss():
    # The failure FINDINGS measured: raw TF cross-entropy on bf16 logits is bf16.
    precision.set_precision_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input([3]), keras.layers.Dense(5, kernel_regularizer="l2")])
    logits = model(tf.ones([2, 3]))
    assert logits.dtype == tf.bfloat16

    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant([1, 2]), logits=precision.to_float32(logits)
    )
    total = tf.reduce_mean(per_example) + tf.add_n(model.losses)

    assert total.dtype == tf.float32


def test_wrap_optimizer_only_for_float16():
    sgd = keras.optimizers.SGD(0.1)
    for name in ("float32", "mixed_bfloat16"):
        precision.set_precision_policy(name)
        assert precision.wrap_optimizer_for_policy(sgd) is sgd

    precision.set_precision_policy("mixed_float16")
    wrapped = precision.wrap_optimizer_for_policy(sgd)

    assert isinstance(wrapped, keras.optimizers.LossScaleOptimizer)
    assert precision.wrap_optimizer_for_policy(wrapped) is wrapped


def test_policy_is_gin_configurable():
    """The public (deprecated) name takes gin's binding (tputrain.config.registry)."""
    import tputrain
    import tputrain.config.registry  # noqa: F401  gin's configurables (docs/configuration.md)
    gin.clear_config()
    try:
        gin.parse_config("set_precision_policy.name = 'mixed_bfloat16'")
        assert tputrain.set_precision_policy() == "mixed_bfloat16"
    finally:
        gin.clear_config()


def test_trainer_precision_is_the_one_source(tmp_path, caplog):
    """Trainer.precision wins; a gin set_precision_policy.name still works, with a
    deprecation warning naming the replacement; nothing bound: the device default."""
    import tputrain
    from tiny import TinyTask, strategy_for

    def make(name, **kwargs):
        return tputrain.Trainer(TinyTask(), str(tmp_path / name), strategy=strategy_for(1),
                                train_steps=2, global_batch_size=16, **kwargs)

    gin.clear_config()
    try:
        assert make("default").precision == "float32"
        gin.parse_config("set_precision_policy.name = 'mixed_bfloat16'")
        assert make("explicit", precision="float32").precision == "float32"
        with caplog.at_level("WARNING"):
            assert make("gin").precision == "mixed_bfloat16"
        assert any("deprecated" in r.getMessage() and "Trainer.precision" in r.getMessage()
                   for r in caplog.records)
    finally:
        gin.clear_config()
        keras.mixed_precision.set_global_policy("float32")
