"""The digits MLP behind a deliberately expensive, serial preprocessing step.

A test bed for input-bound training: `tputrain diagnose` must call the input
pipeline the bottleneck here, and the stall fraction logged by training must
be high. The preprocessing is a real computation the model consumes (a small
data-dependent jitter computed by `work` rounds of a 64x64 matmul per batch),
so tf.data cannot skip it, and it runs with `num_parallel_calls=1`, as a
careless pipeline would.

An example, not part of the package: `configs/slow_input.gin` imports it as
`examples.slow_input`, so run that config from the repository root:

    python -m tputrain.run --gin_file=slow_input.gin --model_dir=/tmp/tputrain-runs/slow
    PYTHONPATH=. tputrain diagnose --gin_file=slow_input.gin
"""

from __future__ import annotations

from typing import Any

import gin

from tputrain.data import InputContext  # tputrain before TensorFlow: its start-up lines are filtered
import tensorflow as tf  # noqa: E402
from tputrain.tasks.digits import DigitsTask


def expensive_jitter(images: tf.Tensor, work: int) -> tf.Tensor:
    """Adds a tiny jitter that takes `work` matmul rounds to compute (per batch)."""
    mixing = tf.eye(images.shape[-1]) * 0.5 + 0.01
    x = images

    def body(i, x):
        return i + 1, tf.tanh(tf.matmul(x, mixing) + tf.cast(i, tf.float32) * 1e-3)

    _, x = tf.while_loop(lambda i, _: i < work, body, (tf.constant(0), x))
    return images + 1e-3 * x


@gin.configurable
class SlowInputTask(DigitsTask):
    """DigitsTask whose training batches pass through `expensive_jitter` serially."""

    def __init__(self, work: int = 400, **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(work, bool) or not isinstance(work, int) or work < 0:
            raise ValueError(f"SlowInputTask.work must be an int >= 0, got {work!r}")
        self.work = work

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        dataset = super().build_inputs(split, input_context)
        if split != "train" or not self.work:
            return dataset

        def slow(features, label):
            return {**features, "image": expensive_jitter(features["image"], self.work)}, label

        # Serial on purpose (the pitfall this task exists to show), and no prefetch after it.
        return dataset.map(slow, num_parallel_calls=None)
