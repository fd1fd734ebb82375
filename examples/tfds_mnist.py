"""A TensorFlow Datasets input in a tputrain Task: MNIST with a small MLP.

`tputrain.data.TFDSInput` does the per-host work in `build_inputs`: each host
reads its own files of the split (or its own even sub-split), batches to the
per-replica batch with `drop_remainder=True` (static shapes), and runs the
vectorized `preprocess_batch` on whole batches.

    python examples/tfds_mnist.py --model_dir=/tmp/tputrain-runs/mnist

downloads MNIST on first use (into ~/tensorflow_datasets, or --tfds_data_dir,
which may be a gs:// path on a TPU VM). The test suite runs it offline under
`tfds.testing.mock_data`, which serves random images of the right shapes.
"""

import tputrain  # first: TensorFlow's start-up lines are then filtered

import keras
import tensorflow as tf
from absl import app, flags

flags.DEFINE_string("model_dir", "/tmp/tputrain-runs/mnist", "Checkpoints and logs.")
flags.DEFINE_string("tfds_data_dir", None, "TFDS data directory (default ~/tensorflow_datasets).")
flags.DEFINE_integer("train_steps", 1000, "Optimizer steps.")
flags.DEFINE_integer("global_batch_size", 128, "Examples per step over all replicas.")
flags.DEFINE_integer("steps_per_loop", 100, "Steps per compiled host call.")
FLAGS = flags.FLAGS


def to_float(batch):
    """Vectorized, on a whole batch: uint8 pixels to floats in [0, 1]."""
    return {"image": tf.cast(batch["image"], tf.float32) / 255.0, "label": batch["label"]}


class MnistTask(tputrain.Task):
    """A 2-layer MLP on 28x28 digits read with TFDSInput."""

    def __init__(self, data_dir: str | None = None, download: bool = True):
        self.data_dir = data_dir
        self.download = download

    def build_model(self) -> keras.Model:
        image = keras.Input((28, 28, 1), name="image")
        x = keras.layers.Flatten()(image)
        x = keras.layers.Dense(256, activation="relu")(x)
        return keras.Model({"image": image}, keras.layers.Dense(10, dtype="float32")(x))

    def build_inputs(self, split, input_context):
        training = split == "train"
        return tputrain.data.TFDSInput(
            "mnist", "train" if training else "test", data_dir=self.data_dir,
            download=self.download, label_key="label", shuffle=training, repeat=training,
            cache=True,  # 60k small images: decode once, keep them in RAM
            preprocess_batch=to_float)(input_context)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def main(argv):
    del argv
    trainer = tputrain.Trainer(MnistTask(FLAGS.tfds_data_dir), FLAGS.model_dir,
                               train_steps=FLAGS.train_steps,
                               global_batch_size=FLAGS.global_batch_size,
                               steps_per_loop=FLAGS.steps_per_loop)
    results = trainer.train()
    print(f"step={int(trainer.step.numpy())} loss={results['loss']:.4f} "
          f"accuracy={results['accuracy']:.3f}")


if __name__ == "__main__":
    app.run(main)
