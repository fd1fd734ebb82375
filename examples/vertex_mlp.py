"""A Vertex AI style training script, on tputrain: an MLP on 512 features from TFRecords.

The same job as `vertex_mlp_keras.py` (plain Keras `fit` under MirroredStrategy),
converted as docs/migrating.md describes: the model, data and loss move into a
`tputrain.Task`; the strategy, precision, compiled loop, checkpoints and logs
come from `tputrain.Trainer`. It writes its own small synthetic TFRecords first
(512 float features, 10 Gaussian clusters), so it runs
anywhere:

    python examples/vertex_mlp.py --model_dir=/tmp/tputrain-runs/vertex_mlp

On Vertex AI the model_dir defaults to $AIP_MODEL_DIR (a gs:// path), and
`--data_dir=gs://...` reads data written there. On a TPU VM nothing changes: the
strategy resolves to TPUStrategy and the precision to mixed_bfloat16.
"""

import os

import tputrain  # first: TensorFlow's start-up lines are then filtered

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

NUM_FEATURES = 512
NUM_CLASSES = 10
FEATURES = {"features": ([NUM_FEATURES], "float32"), "label": ([], "int64")}

flags.DEFINE_string("model_dir", os.environ.get("AIP_MODEL_DIR", "/tmp/tputrain-runs/vertex_mlp"),
                    "Checkpoints, TensorBoard events; Vertex AI sets $AIP_MODEL_DIR.")
flags.DEFINE_string("data_dir", None, "TFRecords; default MODEL_DIR/data, written if missing.")
flags.DEFINE_integer("num_examples", 16384, "Synthetic training examples to write.")
flags.DEFINE_integer("train_steps", 600, "Optimizer steps.")
flags.DEFINE_integer("global_batch_size", 256, "Examples per step over all replicas.")
flags.DEFINE_integer("steps_per_loop", 100, "Steps per compiled host call.")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
flags.DEFINE_string("precision", None, "float32 | mixed_bfloat16; default: bf16 on TPU only.")
flags.DEFINE_integer("cpu_replicas", 0, "Split the CPU into N replicas (try multi-replica "
                     "code on a laptop); 0 keeps the hardware as it is.")
FLAGS = flags.FLAGS


def write_synthetic_data(data_dir: str, num_train: int, num_eval: int = 2048) -> None:
    """Writes train/eval TFRecords: 10 Gaussian clusters in 512 dimensions (learnable)."""
    if tf.io.gfile.glob(f"{data_dir}/eval-*.tfrecord"):
        return
    rng = np.random.RandomState(0)
    centers = 0.3 * rng.randn(NUM_CLASSES, NUM_FEATURES)
    for split, count, shards in (("train", num_train, 8), ("eval", num_eval, 2)):
        labels = rng.randint(0, NUM_CLASSES, size=count)
        features = (centers[labels] + rng.randn(count, NUM_FEATURES)).astype(np.float32)
        tputrain.data.write_tfrecords({"features": features, "label": labels.astype(np.int64)},
                                      f"{data_dir}/{split}", num_shards=shards)


class MLPTask(tputrain.Task):
    """Dense 1024-512-256-10 with batch norm, on 512 features."""

    def __init__(self, data_dir: str, learning_rate: float):
        self.data_dir = data_dir
        self.learning_rate = learning_rate

    def build_model(self) -> keras.Model:
        # Called in strategy.scope() with the precision policy already set.
        features = keras.Input((NUM_FEATURES,), name="features")
        x = features
        for units in (1024, 512, 256):
            x = keras.layers.Dense(units, use_bias=False)(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
        # float32 logits: softmax cross-entropy in bfloat16 loses precision.
        logits = keras.layers.Dense(NUM_CLASSES, dtype="float32", name="logits")(x)
        return keras.Model({"features": features}, logits, name="mlp")

    def build_inputs(self, split, input_context):
        # Per host; TFRecordInput shards files across hosts, batches to the
        # per-replica batch with drop_remainder (static shapes) and parses whole
        # batches at once.
        training = split == "train"
        return tputrain.data.TFRecordInput(f"{self.data_dir}/{split}-*.tfrecord", FEATURES,
                                           label_key="label", shuffle=training,
                                           repeat=training)(input_context)

    def compute_loss(self, labels, outputs):
        # Per example, not averaged: the Trainer divides by the global batch.
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

    def build_optimizer(self):
        return tputrain.build_optimizer("adam", learning_rate=self.learning_rate)


def main(argv):
    del argv
    strategy = None  # tputrain.resolve_strategy(): TPU, multi-worker, GPUs or CPU
    if FLAGS.cpu_replicas:
        tputrain.split_cpu(FLAGS.cpu_replicas)
        strategy = tputrain.resolve_strategy(strategy="mirrored")
    data_dir = FLAGS.data_dir or f"{FLAGS.model_dir}/data"
    write_synthetic_data(data_dir, FLAGS.num_examples, num_eval=max(FLAGS.num_examples // 8, 256))
    trainer = tputrain.Trainer(MLPTask(data_dir, FLAGS.learning_rate), FLAGS.model_dir,
                               strategy=strategy, precision=FLAGS.precision,
                               train_steps=FLAGS.train_steps,
                               global_batch_size=FLAGS.global_batch_size,
                               steps_per_loop=FLAGS.steps_per_loop,
                               eval_every=max(FLAGS.train_steps // 2, 1))
    results = trainer.train()
    print(f"replicas={trainer.strategy.num_replicas_in_sync} precision={trainer.precision} "
          f"step={int(trainer.step.numpy())} loss={results['loss']:.4f} "
          f"accuracy={results['accuracy']:.3f}")


if __name__ == "__main__":
    app.run(main)
