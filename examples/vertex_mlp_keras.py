"""The starting point of docs/migrating.md: a typical GPU training script, no tputrain.

Keras `fit` under MirroredStrategy, reading 512-feature TFRecords, the way a
Vertex AI custom training job is often written. `vertex_mlp.py` is the same job
on tputrain; the guide walks through the conversion line by line. It writes its
own synthetic TFRecords (10 Gaussian clusters in 512 dimensions) so it runs
anywhere:

    python examples/vertex_mlp_keras.py --model_dir=/tmp/tputrain-runs/vertex_mlp_keras
"""

import os

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

flags.DEFINE_string("model_dir", os.environ.get("AIP_MODEL_DIR", "/tmp/vertex_mlp_keras"),
                    "Where checkpoints go; Vertex AI sets $AIP_MODEL_DIR.")
flags.DEFINE_integer("num_examples", 16384, "Synthetic training examples to write.")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("batch_size", 256, "Global batch size.")
FLAGS = flags.FLAGS


def write_synthetic_data(data_dir, num_train, num_eval=2048):
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.RandomState(0)
    centers = 0.3 * rng.randn(10, 512)
    for split, count in (("train", num_train), ("eval", num_eval)):
        labels = rng.randint(0, 10, size=count)
        features = (centers[labels] + rng.randn(count, 512)).astype(np.float32)
        with tf.io.TFRecordWriter(f"{data_dir}/{split}.tfrecord") as writer:
            for x, y in zip(features, labels):
                example = tf.train.Example(features=tf.train.Features(feature={
                    "features": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[y])),
                }))
                writer.write(example.SerializeToString())


def parse(record):
    parsed = tf.io.parse_single_example(record, {
        "features": tf.io.FixedLenFeature([512], tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
    })
    return parsed["features"], parsed["label"]


def make_dataset(path, batch_size, training):
    dataset = tf.data.TFRecordDataset(path).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    if training:
        dataset = dataset.shuffle(10_000)
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def main(argv):
    del argv
    data_dir = f"{FLAGS.model_dir}/data"
    write_synthetic_data(data_dir, FLAGS.num_examples)
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((512,)),
            keras.layers.Dense(1024, use_bias=False), keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(512, use_bias=False), keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(256, use_bias=False), keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    train = make_dataset(f"{data_dir}/train.tfrecord", FLAGS.batch_size, training=True)
    evaluation = make_dataset(f"{data_dir}/eval.tfrecord", FLAGS.batch_size, training=False)
    model.fit(train, epochs=FLAGS.epochs, validation_data=evaluation, verbose=2, callbacks=[
        keras.callbacks.ModelCheckpoint(f"{FLAGS.model_dir}/model.keras"),
        keras.callbacks.TensorBoard(f"{FLAGS.model_dir}/logs"),
    ])
    loss, accuracy = model.evaluate(evaluation, verbose=0)
    print(f"replicas={strategy.num_replicas_in_sync} loss={loss:.4f} accuracy={accuracy:.3f}")


if __name__ == "__main__":
    app.run(main)
