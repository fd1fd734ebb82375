"""Test setup: split the CPU into 4 logical devices before TensorFlow starts.

Multi-replica behaviour is tested for real: MirroredStrategy over 2 or 4 of
these logical CPUs runs the same collectives as over GPUs.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_CPU_DEVICES = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_DEVICES)


@pytest.fixture(autouse=True)
def _float32_policy():
    """Each test starts (and leaves) the global Keras precision policy at float32."""
    import keras

    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True)
def _clear_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()
