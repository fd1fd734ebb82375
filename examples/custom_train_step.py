"""A Task with its own `train_step`: an auxiliary loss, per-replica noise and extra logs.

A denoising classifier: each step adds Gaussian noise to the inputs on the
device, and the model both classifies the point and reconstructs the clean
input. `train_step` runs in *replica context* (inside `strategy.run`, once per
replica), so it shows the three rules of a custom step (docs/tasks.md):

1. Divide every loss by the *global* batch (`tf.nn.compute_average_loss`), never
   `reduce_mean`: gradients are summed over replicas.
2. Every value returned is *summed* over replicas by the Trainer, so return
   per-replica shares of the global mean (as the losses here are).
3. Random ops must differ per replica: fold the replica id into the seed, or
   every replica draws the same noise.

    python examples/custom_train_step.py --model_dir=/tmp/tputrain-runs/denoise --train_steps=300
"""

import tputrain  # first: TensorFlow's start-up lines are then filtered

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

from tputrain.precision import to_float32

flags.DEFINE_string("model_dir", "/tmp/tputrain-runs/denoise", "Checkpoints and logs.")
flags.DEFINE_integer("train_steps", 300, "Optimizer steps.")
flags.DEFINE_integer("cpu_replicas", 2, "Split the CPU into N replicas (0: use the hardware as is).")
FLAGS = flags.FLAGS

DIM = 16


class DenoisingTask(tputrain.Task):
    """Classify noisy 16-D points into 4 clusters and reconstruct the clean point."""

    def __init__(self, noise: float = 0.5, reconstruction_weight: float = 0.5):
        rng = np.random.RandomState(0)
        centers = 2.0 * rng.randn(4, DIM)
        labels = rng.randint(0, 4, size=4096)
        self.points = (centers[labels] + 0.5 * rng.randn(4096, DIM)).astype(np.float32)
        self.labels = labels.astype(np.int64)
        self.noise = noise
        self.reconstruction_weight = reconstruction_weight

    def build_model(self) -> keras.Model:
        point = keras.Input((DIM,), name="point")
        code = keras.layers.Dense(64, activation="relu")(point)
        code = keras.layers.Dense(32, activation="relu")(code)
        return keras.Model({"point": point}, {
            "logits": keras.layers.Dense(4, name="logits")(code),
            "reconstruction": keras.layers.Dense(DIM, name="reconstruction")(code),
        })

    def build_inputs(self, split, input_context):
        # Per host: this host's shard, batched to the per-replica batch.
        rows = slice(0, 3584) if split == "train" else slice(3584, None)
        dataset = tf.data.Dataset.from_tensor_slices(
            ({"point": self.points[rows]}, self.labels[rows]))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if split == "train":
            dataset = dataset.shuffle(4096, seed=0).repeat()
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        return dataset.batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        # Used by the default eval_step: the classification loss, per example.
        return keras.losses.sparse_categorical_crossentropy(labels, outputs["logits"],
                                                            from_logits=True)

    def build_metrics(self):
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

    def update_metrics(self, metrics, labels, outputs):
        for metric in metrics:
            metric.update_state(labels, outputs["logits"])

    def flops_per_example(self):
        # A custom train_step is not traced for FLOPs: give the count (multiply-adds
        # x 2, forward x 3 for forward + backward) so the logs still show MFU.
        forward = 2 * (DIM * 64 + 64 * 32 + 32 * 4 + 32 * DIM)
        return 3 * forward

    def train_step(self, batch, model, optimizer, metrics, global_batch_size):
        """Replica context: one replica's share of the step."""
        features, labels = batch
        clean = features["point"]
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        seed = tf.stack([tf.cast(optimizer.iterations, tf.int32), tf.cast(replica, tf.int32)])
        noisy = clean + self.noise * tf.random.stateless_normal(tf.shape(clean), seed)
        with tf.GradientTape() as tape:
            outputs = to_float32(model({"point": noisy}, training=True))
            classification = tf.nn.compute_average_loss(
                self.compute_loss(labels, outputs), global_batch_size=global_batch_size)
            squared_error = tf.reduce_mean(tf.square(outputs["reconstruction"] - clean), axis=-1)
            reconstruction = tf.nn.compute_average_loss(squared_error,
                                                        global_batch_size=global_batch_size)
            loss = classification + self.reconstruction_weight * reconstruction
            scaled_loss = optimizer.scale_loss(loss)  # loss scaling under mixed_float16
        gradients = tape.gradient(scaled_loss, model.trainable_variables)
        # Keras sums the gradients over replicas inside apply_gradients.
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        self.update_metrics(metrics, labels, outputs)
        return {"loss": loss, "classification_loss": classification,
                "reconstruction_loss": reconstruction}


def main(argv):
    del argv
    strategy = None
    if FLAGS.cpu_replicas:
        tputrain.split_cpu(FLAGS.cpu_replicas)  # before TensorFlow runs any op
        strategy = tputrain.resolve_strategy(strategy="mirrored")
    trainer = tputrain.Trainer(DenoisingTask(), FLAGS.model_dir, strategy=strategy,
                               train_steps=FLAGS.train_steps, steps_per_loop=50,
                               global_batch_size=128, checkpoint_every=100)
    results = trainer.train()
    print(f"replicas={trainer.strategy.num_replicas_in_sync} "
          f"accuracy={results['accuracy']:.3f} eval_loss={results['loss']:.4f}")


if __name__ == "__main__":
    app.run(main)
