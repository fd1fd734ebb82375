"""A user training script: your own Keras model as a tputrain Task.

Runs on 2 replicas (the CPU split in two logical devices; on a TPU VM or a
multi-GPU machine, drop `split_cpu` and let `resolve_strategy()` pick) in
mixed_bfloat16:

    python examples/custom_task.py --model_dir=/tmp/tputrain-runs/custom --train_steps=300
"""

import tputrain  # first: TensorFlow's start-up noise is filtered when tputrain imports it

import numpy as np
import keras
import tensorflow as tf
from absl import app, flags

flags.DEFINE_string("model_dir", "/tmp/tputrain-runs/custom", "Where checkpoints and logs go.")
flags.DEFINE_integer("train_steps", 300, "Optimizer steps.")
FLAGS = flags.FLAGS


class ClusterTask(tputrain.Task):
    """Classify 2-D points into 4 Gaussian clusters, from sharded TFRecords."""

    def __init__(self, data_dir: str):
        rng = np.random.RandomState(0)
        centers = rng.randn(4, 2) * 3
        labels = rng.randint(0, 4, size=4096)
        points = (centers[labels] + rng.randn(4096, 2)).astype(np.float32)
        for split, rows in (("train", slice(0, 3584)), ("eval", slice(3584, None))):
            tputrain.data.write_tfrecords({"point": points[rows], "label": labels[rows]},
                                          f"{data_dir}/{split}", num_shards=4)
        self.data_dir = data_dir

    def build_model(self) -> keras.Model:
        point = keras.Input((2,), name="point")
        hidden = keras.layers.Dense(64, activation="relu")(point)
        hidden = keras.layers.Dropout(0.1)(hidden)
        return keras.Model({"point": point}, keras.layers.Dense(4)(hidden))

    def build_inputs(self, split, input_context):
        features = {"point": ([2], "float32"), "label": ([], "int64")}
        return tputrain.data.TFRecordInput(f"{self.data_dir}/{split}-*", features, label_key="label",
                                           repeat=split == "train")(input_context)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def main(argv):
    tputrain.split_cpu(2)  # before TensorFlow starts: 2 logical CPUs = 2 replicas
    strategy = tputrain.resolve_strategy(strategy="mirrored")
    trainer = tputrain.Trainer(ClusterTask(f"{FLAGS.model_dir}/data"), FLAGS.model_dir,
                               strategy=strategy, precision="mixed_bfloat16",
                               train_steps=FLAGS.train_steps, steps_per_loop=50,
                               global_batch_size=128, checkpoint_every=100)
    results = trainer.train()
    print(f"replicas={strategy.num_replicas_in_sync} precision={trainer.precision} "
          f"compute_dtype={trainer.model.layers[1].compute_dtype} "
          f"accuracy={results['accuracy']:.3f}")


if __name__ == "__main__":
    app.run(main)
