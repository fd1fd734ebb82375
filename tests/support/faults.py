"""A gin-configurable tiny task for end-to-end fault tests run through the CLI.

Imported by child processes with `--gin_import=faults` (tests/support/ on PYTHONPATH).
In a child with `TPUTRAIN_TEST_CPUS=N` it splits the CPU into N logical devices
at import, before TensorFlow starts, so `resolve_strategy.strategy='mirrored'`
gives real replicas. (pytest's own process keeps conftest's 4 devices.)
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import gin
import keras
import numpy as np
import tensorflow as tf

import tputrain
from tiny import TinyTask

if os.environ.get("TPUTRAIN_TEST_CPUS"):
    tputrain.split_cpu(int(os.environ["TPUTRAIN_TEST_CPUS"]))


class Ballast(keras.layers.Layer):
    """An identity layer owning a large frozen weight.

    It makes every checkpoint write take long enough (tens of ms) that a test
    can kill the process while the write is in progress.
    """

    def __init__(self, floats: int, **kwargs):
        super().__init__(**kwargs)
        self.floats = floats

    def build(self, input_shape):
        self.ballast = self.add_weight(shape=(self.floats,), initializer="ones",
                                       trainable=False, name="ballast")

    def call(self, inputs):
        return inputs


@gin.configurable
class FaultTask(TinyTask):
    """TinyTask with dropout, an optional ballast weight, and an optional NaN batch.

    `nan_at_batch`: the train batch with this index (0-based, per replica stream)
    has NaN features (or `poison`, e.g. a huge finite value), to exercise the
    non-finite guard.
    """

    def __init__(self, dropout: float = 0.3, ballast_floats: int = 0, hidden: int = 16,
                 nan_at_batch: int | None = None, learning_rate: float = 0.05,
                 poison: float = np.nan):
        super().__init__(dropout=dropout, learning_rate=learning_rate)
        self.ballast_floats = ballast_floats
        self.hidden = hidden
        self.nan_at_batch = nan_at_batch
        self.poison = poison

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        h = inputs
        if self.ballast_floats:
            h = Ballast(self.ballast_floats)(h)
        h = keras.layers.Dense(self.hidden, activation="relu",
                               kernel_regularizer=keras.regularizers.L2(self.l2))(h)
        if self.dropout:
            h = keras.layers.Dropout(self.dropout, seed=1)(h)
        logits = keras.layers.Dense(2, dtype="float32")(h)
        return keras.Model({"x": inputs}, logits)

    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split == "train":
            # A shuffle buffer makes the iterator state non-trivial to restore.
            dataset = dataset.unbatch().shuffle(64, seed=3).batch(
                input_context.get_per_replica_batch_size(input_context.global_batch_size),
                drop_remainder=True)
        if split == "train" and self.nan_at_batch is not None:
            bad, value = self.nan_at_batch, self.poison

            def poison(index, batch):
                features, labels = batch
                x = tf.where(index == bad, tf.fill(tf.shape(features["x"]), value),
                             features["x"])
                return {"x": x}, labels

            dataset = dataset.enumerate().map(poison)
        return dataset


# A side-car's config of FaultTask (tests/test_tensorboard.py, tests/cli/test_eval.py):
# 8 steps in loops of 2, a checkpoint and an evaluation of 2 batches every 2 steps.
TINY_GIN = """
Trainer.task = @FaultTask()
FaultTask.dropout = 0.0
Trainer.train_steps = 8
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.eval_every = 2
Trainer.eval_steps = 2
Trainer.checkpoint_every = 2
Trainer.keep_checkpoints = 10
Trainer.report_mfu = False
"""


@gin.configurable
class StallingTask(FaultTask):
    """Prints a marker in `build_model`, then waits for a signal: a test can signal a
    process that is still building its Trainer (before `train()`)."""

    def build_model(self) -> keras.Model:
        print("tputrain-test: building the model", flush=True)
        signal.pause()
        return super().build_model()


@gin.configurable
class PauseAtStep(tputrain.Action):
    """After the first loop ending at or past `step`, prints a marker and waits for a
    signal: a test can kill a run at a known step, after the built-in actions (the
    goodput record) have seen that loop and before a save or evaluation due there.
    With TPUTRAIN_TEST_FIFO it waits for a line there instead, then trains on: a test
    can copy model_dir as a kill there leaves it (`copy_at_pause`)."""

    def __init__(self, step: int):
        self.step = step
        self.paused = False

    def on_loop_end(self, trainer, step, logs):
        if step >= self.step and not self.paused:
            self.paused = True
            print(f"tputrain-test: paused at step {step}", flush=True)
            _wait_for_fifo()


@gin.configurable
class BlockingInputTask(TinyTask):
    """TinyTask whose train input, once read, prints "tputrain-test: reading input" and
    never yields: the main thread then waits inside TensorFlow (the Trainer's first read
    of the train split), where Python signal handlers do not run."""

    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split != "train":
            return dataset

        def block(x):
            print("tputrain-test: reading input", flush=True)
            threading.Event().wait()
            return x
        return dataset.map(lambda features, labels: (
            {"x": tf.ensure_shape(tf.py_function(block, [features["x"]], tf.float32),
                                  features["x"].shape)}, labels))


@gin.configurable
class RecordsTask(TinyTask):
    """TinyTask read back from TFRecord files: `pattern` (train) and `eval_pattern`."""

    def __init__(self, pattern: str, eval_pattern: str | None = None, pad_eval: bool = False,
                 eval_patterns: dict[str, str] | None = None, shuffle: bool = False):
        super().__init__()
        # `eval_patterns`: named eval sets (Trainer.eval_splits), each its own files.
        self.patterns = {"train": pattern, "eval": eval_pattern or pattern, **(eval_patterns or {})}
        self.pad_eval, self.shuffle = pad_eval, shuffle  # shuffle: the train split's (seeded)

    def build_inputs(self, split, input_context):
        return tputrain.data.TFRecordInput(
            self.patterns[split], {"x": ([8], "float32"), "label": ([], "int64")},
            label_key="label", shuffle=self.shuffle and split == "train",
            repeat=split == "train",
            pad_remainder=self.pad_eval and split != "train")(input_context)


def flip_and_noise(features, labels, seed):
    """Augmentation drawn from `seed` alone: each 8-float example as a 2x4 image,
    flipped left-right at random, plus uniform noise (tputrain.data.stateless_augment)."""
    flip_seed, noise_seed = tf.unstack(tf.random.split(seed, 2))
    images = tf.reshape(features["x"], [-1, 2, 4, 1])
    images = tf.image.stateless_random_flip_left_right(images, flip_seed)
    x = tf.reshape(images, [-1, 8])
    return {"x": x + tf.random.stateless_uniform(tf.shape(x), noise_seed, -0.5, 0.5)}, labels


@gin.configurable
class AugmentTask(FaultTask):
    """FaultTask whose train batches go through `flip_and_noise` under
    `tputrain.data.stateless_augment`: augmentation that resumes exactly."""

    def __init__(self, augment_seed: int = 7, **kwargs):
        super().__init__(**kwargs)
        self.augment_seed = augment_seed

    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split != "train":
            return dataset
        return dataset.apply(tputrain.data.stateless_augment(
            flip_and_noise, seed=self.augment_seed, input_context=input_context))


_RECORD_LOCK = threading.Lock()


@gin.configurable
class IndexedTask(TinyTask):
    """Examples that carry their index: element i of one deterministic order, each
    host reading every n-th (`Dataset.shard` of examples, before batching). Every
    index a train step computes its loss on is appended to `record_dir/seen-<pid>.txt`
    (eval examples are index -1), so a test sees which examples were trained on."""

    def __init__(self, record_dir: str):
        super().__init__()
        self.record_dir = record_dir
        os.makedirs(record_dir, exist_ok=True)

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        train = split == "train"
        dataset = tf.data.Dataset.range(1 << 20 if train else 64)
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

        def example(i):
            x = tf.one_hot(i % 8, 8, dtype=tf.float32)
            return {"x": x}, {"label": i % 2, "index": i if train else tf.constant(-1, tf.int64)}
        return dataset.map(example).batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        done = tf.py_function(self._record, [labels["index"]], Tout=tf.bool)
        with tf.control_dependencies([done]):
            return keras.losses.sparse_categorical_crossentropy(labels["label"], outputs,
                                                                from_logits=True)

    def build_metrics(self):
        return []

    def _record(self, index: tf.Tensor) -> bool:
        trained = [str(i) for i in index.numpy().tolist() if i >= 0]
        if trained:
            with _RECORD_LOCK, open(os.path.join(self.record_dir, f"seen-{os.getpid()}.txt"),
                                    "a") as f:
                f.write("\n".join(trained) + "\n")
        return True


@gin.configurable
class PositionalIndexedTask(IndexedTask):
    """IndexedTask read from `write_tfrecords` shards (`manifest`: features "x" and
    "index") with `TFRecordInput(positional=True)`: each train step records the
    indices it trained on (`trained_indices`)."""

    def __init__(self, record_dir: str, manifest: str, window_blocks: int = 1):
        super().__init__(record_dir)
        self.manifest, self.window_blocks = manifest, window_blocks

    def build_inputs(self, split, input_context):
        train = split == "train"  # eval: one pass in file order, recorded as index -1
        dataset = tputrain.data.TFRecordInput(
            manifest=self.manifest, positional=train, seed=5, shuffle=train, repeat=train,
            window_blocks=self.window_blocks)(input_context)
        return dataset.map(lambda batch: ({"x": batch["x"]}, {
            "label": batch["index"] % 2,
            "index": batch["index"] if train else -tf.ones_like(batch["index"])}))


@gin.configurable
class PositionalRecordsTask(FaultTask):
    """FaultTask (dropout, no shuffle buffer on top) whose train split is
    `TFRecordInput(positional=True)` of a `write_tfrecords` manifest of "x" and
    "label": a resume builds it at its position, in either input mode."""

    def __init__(self, manifest: str, window_blocks: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.manifest, self.window_blocks = manifest, window_blocks

    def build_inputs(self, split, input_context):
        if split != "train":
            return TinyTask.build_inputs(self, split, input_context)
        return tputrain.data.TFRecordInput(
            manifest=self.manifest, label_key="label", positional=True, seed=5,
            window_blocks=self.window_blocks)(input_context)


def write_labelled_records(directory: Path, records: int, shards: int = 2) -> str:
    """`records` examples of "x" (8 floats) and "label" (int64) in `shards` shards
    (`write_tfrecords`): the manifest's path."""
    x = np.random.RandomState(0).randn(records, 8).astype(np.float32)
    prefix = str(Path(directory) / "labelled")
    tputrain.data.write_tfrecords({"x": x, "label": (x[:, 0] > 0).astype(np.int64)}, prefix,
                                  num_shards=shards)
    return prefix + ".manifest.json"


def trained_indices(record_dir: str | Path) -> list[int]:
    """Every index an `IndexedTask` trained on (in any process), sorted."""
    return sorted(int(line) for path in Path(record_dir).glob("seen-*.txt")
                  for line in path.read_text().split())


INPUT_NORM_MOMENTUM = 0.5


def input_norm_model() -> keras.Model:
    """TinyTask's classifier with batch norm ("bn") straight on the inputs: its batch
    means are the data's whatever the weights, so its moving mean is known from the
    data alone (tests/loop/test_replica_stats.py)."""
    inputs = keras.Input((8,), name="x")
    h = keras.layers.BatchNormalization(momentum=INPUT_NORM_MOMENTUM, name="bn")(inputs)
    h = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model({"x": inputs}, keras.layers.Dense(2, dtype="float32")(h))


@gin.configurable
class InputNormRecordsTask(RecordsTask):
    """RecordsTask with `input_norm_model`."""

    def build_model(self) -> keras.Model:
        return input_norm_model()


class _Untracked:
    """Holds a variable out of Keras's and TensorFlow's tracking: not model state, so
    neither checkpointed nor synchronised across replicas."""

    def __init__(self, variable: tf.Variable):
        self.variable = variable


class MaskProbe(keras.layers.Dropout):
    """Dropout (seed 1) on inputs that are never 0, keeping each replica's last `steps`
    masks (1 where a unit was dropped, `size` units a step) in a per-replica variable."""

    def __init__(self, rate: float, steps: int, size: int, **kwargs):
        super().__init__(rate, seed=1, **kwargs)
        self.steps, self.size = steps, size

    def build(self, input_shape):
        super().build(input_shape)
        self._masks = _Untracked(tf.Variable(tf.zeros([self.steps, self.size]), trainable=False,
                                             aggregation=tf.VariableAggregation.NONE))

    def call(self, inputs, training=False):
        outputs = super().call(inputs, training=training)
        if training:
            dropped = tf.reshape(tf.cast(tf.equal(outputs, 0), tf.float32), [1, self.size])
            masks = self._masks.variable
            masks.assign(tf.concat([masks[1:], dropped], 0))
        return outputs

    def local_masks(self) -> list[np.ndarray]:
        """This process's replicas' masks, oldest step first."""
        value = self._masks.variable
        return [np.asarray(v.numpy()) for v in getattr(value, "values", [value])]


def mask_probe_model(steps: int, per_replica_batch: int) -> keras.Model:
    """TinyTask's classifier behind a `MaskProbe` ("probe") on its inputs."""
    inputs = keras.Input((8,), name="x")
    h = MaskProbe(0.5, steps, per_replica_batch * 8, name="probe")(inputs)
    h = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model({"x": inputs}, keras.layers.Dense(2, dtype="float32")(h))


@gin.configurable
class MaskProbeRecordsTask(RecordsTask):
    """RecordsTask with `mask_probe_model`."""

    def __init__(self, pattern: str, steps: int, per_replica_batch: int):
        super().__init__(pattern)
        self.steps, self.per_replica_batch = steps, per_replica_batch

    def build_model(self) -> keras.Model:
        return mask_probe_model(self.steps, self.per_replica_batch)


@gin.configurable
class SaveProbe(tputrain.Action):
    """At the end of training, each worker saves its replicas' masks of the "probe"
    layer to `<directory>/worker<host>.npy`."""

    def __init__(self, directory: str):
        self.directory = directory

    def on_train_end(self, trainer, step, logs):
        masks = trainer.model.get_layer("probe").local_masks()
        np.save(os.path.join(self.directory, f"worker{trainer.host_id}.npy"), np.stack(masks))


# ------------------------------------------------------------ file events
#
# With TPUTRAIN_TEST_EVENTS=1 a child numbers and prints every file event of model_dir
# that tputrain's Python code makes (gfile copy, rename, remove, rmtree; a checkpoint
# save; a SavedModel write) as "tputrain-test: file event <n> <op> <parent>/<name>".
# With TPUTRAIN_TEST_PAUSE_AT=<n> (or "<op> <parent>/<name>": the first such event,
# whose number varies with the goodput record's timed writes) it stops *before* event n (after printing
# "tputrain-test: paused before file event <n>") until a line is written to the FIFO
# TPUTRAIN_TEST_FIFO (or, without one, until killed): the files on disk are then
# exactly those of a kill at that instant. TPUTRAIN_TEST_TORN=1 makes a paused copy
# write the first half of its file first (a copy cut short).
# With TPUTRAIN_TEST_PAUSE_AT=every (and a FIFO) it stops before *every* event, so one
# run gives the files of a kill at each (tests/support/file_events.py snapshots them). The line
# read from the FIFO says what next: "go" runs the event; "torn" (a copy) writes the
# first half of its file, prints "tputrain-test: torn before file event <n>" and waits
# for another line, then removes the half file and runs the event.

_EVENT_COUNT = [0]
_PAUSED_AT = [0]  # the event a TPUTRAIN_TEST_PAUSE_AT=<op> <name> paused before


def _label(path: str) -> str:
    parts = re.sub(r"\.tmp-[^/]+", ".tmp", str(path)).rstrip("/").split("/")
    return "/".join(parts[-2:])


def _wait_for_fifo() -> str:
    """The next line a test writes to TPUTRAIN_TEST_FIFO; without one, waits to be killed."""
    fifo = os.environ.get("TPUTRAIN_TEST_FIFO")
    if not fifo:
        signal.pause()
        return "go"
    with open(fifo) as f:
        return f.readline().strip()


def _event(op: str, path: str, torn: Callable[[], None] | None = None) -> None:
    if ".tputrain-write-test" in str(path):
        return  # pre-flight's probe files
    _EVENT_COUNT[0] += 1
    number = _EVENT_COUNT[0]
    print(f"tputrain-test: file event {number} {op} {_label(path)}", flush=True)
    pause_at = os.environ.get("TPUTRAIN_TEST_PAUSE_AT", "0")
    if pause_at == "every":
        print(f"tputrain-test: paused before file event {number}", flush=True)
        if _wait_for_fifo() == "torn" and torn is not None:
            torn()
            print(f"tputrain-test: torn before file event {number}", flush=True)
            _wait_for_fifo()
            os.remove(path)
        return
    if pause_at.isdigit() and number != int(pause_at):
        return
    if not pause_at.isdigit() and (f"{op} {_label(path)}" != pause_at or _PAUSED_AT[0]):
        return  # "<op> <parent>/<name>": the first such event, whatever its number
    _PAUSED_AT[0] = number
    if torn is not None and os.environ.get("TPUTRAIN_TEST_TORN") == "1":
        torn()
    print(f"tputrain-test: paused before file event {number}", flush=True)
    _wait_for_fifo()


def _install_file_events() -> None:
    gfile = tf.io.gfile
    copy, rename, remove, rmtree = gfile.copy, gfile.rename, gfile.remove, gfile.rmtree

    def torn_copy(source: str, target: str) -> None:
        data = Path(source).read_bytes()
        Path(target).write_bytes(data[: len(data) // 2])

    def copy_(source, target, overwrite=False):
        _event("copy", target, lambda: torn_copy(source, target))
        return copy(source, target, overwrite)

    def rename_(source, target, overwrite=False):
        _event("rename", target)
        return rename(source, target, overwrite)

    gfile.copy, gfile.rename = copy_, rename_
    gfile.remove = lambda path: (_event("remove", path), remove(path))[1]
    gfile.rmtree = lambda path: (_event("rmtree", path), rmtree(path))[1]
    manager_save = tf.train.CheckpointManager.save

    def save(self, checkpoint_number=None, **kwargs):
        _event("save", f"{self.directory}/ckpt-{checkpoint_number}")
        return manager_save(self, checkpoint_number=checkpoint_number, **kwargs)

    tf.train.CheckpointManager.save = save
    import tputrain.serving.export as export

    write = export.save_serving_model
    export.save_serving_model = lambda model, inputs, path, *a, **k: (
        _event("savedmodel", path), write(model, inputs, path, *a, **k))[1]


if os.environ.get("TPUTRAIN_TEST_EVENTS") == "1":
    _install_file_events()


def file_events(text: str) -> list[tuple[int, str]]:
    """(number, "op parent/name") of every file event a child printed."""
    return [(int(n), what) for n, what in
            re.findall(r"tputrain-test: file event (\d+) (.+)", text)]


RUNNING_MOMENTUM = INPUT_NORM_MOMENTUM  # tests/loop/test_replica_stats.py: moving_mean


class RunningStats(keras.layers.Layer):
    """Identity on its inputs that keeps statistics of them in non-trainable weights
    updated in the forward pass: the examples seen (`count`, int64), their feature sums
    (`total`) and an exponential moving mean (`mean`). `declared`: the weights say how
    replicas combine them ("sum", "sum", "mean"); else Keras's default, "none"."""

    def __init__(self, declared: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.declared = declared

    def build(self, input_shape):
        summed, averaged = ("sum", "mean") if self.declared else ("none", "none")
        self.count = self.add_weight(shape=(), dtype="int64", initializer="zeros",
                                     trainable=False, aggregation=summed, name="count")
        self.total = self.add_weight(shape=(8,), initializer="zeros", trainable=False,
                                     aggregation=summed, name="total")
        self.mean = self.add_weight(shape=(8,), initializer="zeros", trainable=False,
                                    aggregation=averaged, name="mean")

    def call(self, inputs, training=False):
        if training:
            self.count.assign_add(tf.cast(tf.shape(inputs)[0], "int64"))
            self.total.assign(self.total + tf.reduce_sum(inputs, 0))
            self.mean.assign(self.mean * RUNNING_MOMENTUM
                             + tf.reduce_mean(inputs, 0) * (1 - RUNNING_MOMENTUM))
        return inputs


def running_stats_model(declared: bool = True) -> keras.Model:
    """TinyTask's classifier behind a `RunningStats` ("stats") on its inputs."""
    inputs = keras.Input((8,), name="x")
    h = RunningStats(declared, name="stats")(inputs)
    h = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model({"x": inputs}, keras.layers.Dense(2, dtype="float32")(h))


@gin.configurable
class RunningStatsRecordsTask(RecordsTask):
    """RecordsTask with `running_stats_model`."""

    def build_model(self) -> keras.Model:
        return running_stats_model()


@gin.configurable
class SaveRunningStats(tputrain.Action):
    """At the end of training, each worker saves its copies of the "stats" layer's
    weights to `<directory>/worker<host>.npz`."""

    def __init__(self, directory: str):
        self.directory = directory

    def on_train_end(self, trainer, step, logs):
        layer = trainer.model.get_layer("stats")
        copies = {}
        for name in ("count", "total", "mean"):
            value = getattr(layer, name).value
            copies[name] = np.stack([v.numpy() for v in getattr(value, "values", [value])])
        np.savez(os.path.join(self.directory, f"worker{trainer.host_id}.npz"), **copies)


# ------------------------------------------------------------ per-token loss

TOKEN_LENGTH, TOKEN_VOCAB, TOKEN_BATCH = 6, 11, 8


def _token_rows(count: int, seed: int):
    """Rows whose real lengths differ a lot (1 .. TOKEN_LENGTH tokens)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, TOKEN_VOCAB, size=(count, TOKEN_LENGTH)).astype(np.int32)
    targets = rng.randint(1, TOKEN_VOCAB, size=(count, TOKEN_LENGTH)).astype(np.int32)
    real = np.array([1 + (i * 5) % TOKEN_LENGTH for i in range(count)])
    weights = (np.arange(TOKEN_LENGTH)[None, :] < real[:, None]).astype(np.float32)
    return tokens, targets, weights


@gin.configurable
class TokenTask(tputrain.Task):
    """A per-token classifier over (tokens, targets, loss weights) rows whose real
    lengths differ a lot (tests/test_token_loss.py)."""

    def __init__(self, normalise_by_tokens: bool = True):
        self.data = _token_rows(64, seed=0)
        self.normalise_by_tokens = normalise_by_tokens

    def build_model(self):
        tokens = keras.Input((TOKEN_LENGTH,), dtype="int32", name="tokens")
        init = keras.initializers
        h = keras.layers.Embedding(TOKEN_VOCAB, 8,
                                   embeddings_initializer=init.RandomNormal(seed=1))(tokens)
        h = keras.layers.Dense(8, activation="tanh",
                               kernel_initializer=init.GlorotUniform(seed=2))(h)
        logits = keras.layers.Dense(TOKEN_VOCAB, kernel_initializer=init.GlorotUniform(seed=3))(h)
        return keras.Model({"tokens": tokens}, logits)

    def build_inputs(self, split, input_context):
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        tokens, targets, weights = self.data
        dataset = tf.data.Dataset.from_tensor_slices(({"tokens": tokens}, targets, weights))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.repeat().batch(batch, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def loss_denominator(self, batch):
        if not self.normalise_by_tokens:
            return None
        return tf.reduce_sum(batch[2])

    def build_optimizer(self):
        return keras.optimizers.SGD(0.5)


def final_weights(model_dir: str) -> dict[str, np.ndarray]:
    """The model weights of the latest checkpoint in model_dir, by checkpoint key."""
    path = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
    assert path, f"no checkpoint in {model_dir}"
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)
            if name.startswith("optimizer/") or name.startswith("model/")
            or name.startswith("seeds/")}


# ------------------------------------------------------------ child processes

TESTS = Path(__file__).resolve().parent  # tests/support: the modules children import


class FullDiskWriter:
    """A TFRecordWriter on a disk that fills up after 100 records: later writes fail, and
    so does its close (the flush of what it buffered), as TensorFlow's do on ENOSPC."""

    real = tf.io.TFRecordWriter

    def __init__(self, path, options=None):
        self.path, self.written, self.full = path, 0, False
        self.writer = self.real(path, options)

    def _raise(self):
        self.full = True
        raise tf.errors.ResourceExhaustedError(None, None,
                                               f"{self.path}; No space left on device")

    def write(self, record):
        if self.written >= 100:
            self._raise()
        self.written += 1
        self.writer.write(record)

    def close(self):
        self.writer.close()
        if self.full:
            self._raise()


def child_env(cpus: int | None = None) -> dict[str, str]:
    """Environment of a child: tests/support/ importable, quiet TF, `cpus` logical CPUs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.pop("TPUTRAIN_TEST_CPUS", None)
    if cpus:
        env["TPUTRAIN_TEST_CPUS"] = str(cpus)
    return env


def cli_refusal(tmp_path, config: str) -> str:
    """Runs `tputrain.run` on a gin `config` that must be refused: exit 2, one
    `tputrain: error:` line, no traceback, no model_dir written; returns its stderr."""
    path = tmp_path / "refused.gin"
    path.write_text(config)
    model_dir = tmp_path / "model"
    result = subprocess.run([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                             f"--gin_file={path}", f"--model_dir={model_dir}"],
                            capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("tputrain: error:") == 1 and "Traceback" not in result.stderr
    assert not model_dir.exists()
    return result.stderr


class ProcessEnded(AssertionError):
    """The process ended before the awaited line."""


class Process:
    """A subprocess whose output lines (stdout and stderr merged) can be awaited;
    `stdin=True`: lines can be sent to it (`send`)."""

    def __init__(self, command: list[str], env: dict[str, str], stdin: bool = False):
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1,
                                        stdin=subprocess.PIPE if stdin else None)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        """Returns the match in the first new output line matching `pattern` (re.search)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                self._queue.put(None)
                raise ProcessEnded(f"process ended (code {self.process.wait()}) before "
                                   f"{pattern!r}:\n{self.log()}")
            self.lines.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.log()}")

    def next_match(self, pattern: str, timeout: float = 180) -> re.Match | None:
        """`wait_for`, or None once the process has ended without such a line."""
        try:
            return self.wait_for(pattern, timeout)
        except ProcessEnded:
            return None

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def finish(self, timeout: float = 180) -> int:
        """Waits for the exit; returns the code after collecting all output."""
        code = self.process.wait(timeout=timeout)
        if self.process.stdin:
            self.process.stdin.close()
        while True:
            line = self._queue.get(timeout=30)
            if line is None:
                self._queue.put(None)
                return code
            self.lines.append(line)

    def kill(self, signum: int = signal.SIGKILL) -> int:
        self.process.send_signal(signum)
        return self.finish()

    def text(self) -> str:
        return "".join(self.lines)

    def log(self) -> str:
        return "".join(self.lines[-40:])


def wait_for_file_line(path: Path, pattern: str, timeout: float = 300) -> re.Match:
    """The first line of the file at `path` (written by another process: a trial's log)
    matching `pattern` (re.search), once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            match = re.search(pattern, path.read_text(errors="replace"), re.M)
            if match:
                return match
        time.sleep(0.2)
    text = path.read_text(errors="replace")[-3000:] if path.is_file() else "(no file)"
    raise AssertionError(f"no {pattern!r} in {path} within {timeout} s:\n{text}")


def pausable_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child whose pauses (PauseAtStep, file events) wait for a line on its
    stdin: a `Process(..., stdin=True)` that `copy_at_pause` can let go on."""
    return dict(env, TPUTRAIN_TEST_FIFO="/dev/stdin")


def copy_at_pause(process: Process, model_dir: Path, target: Path,
                  pattern: str = r"tputrain-test: paused at step (\d+)") -> re.Match:
    """Waits for `process` to pause, copies its `model_dir` to `target` (the files a
    kill there leaves: its flock dies with it) and lets it run on."""
    match = process.wait_for(pattern)
    shutil.copytree(model_dir, target, symlinks=True)
    process.send("go")
    return match


# ------------------------------------------------------------ tputrain.fit in a child

KERAS_FIT_STEPS = 24


def keras_fit_run(model_dir: str, pause_at: int | None = None) -> None:
    """`tputrain.fit` of a compiled two-input Keras model with dropout on shuffled
    arrays with sample weights, on 2 replicas (a child with TPUTRAIN_TEST_CPUS=2),
    op determinism on; `pause_at`: waits for a signal after that step's loop."""
    from tiny import strategy_for

    tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x = {"signal": rng.normal(size=(40, 5)).astype(np.float32),
         "bias": rng.normal(size=(40, 1)).astype(np.float32)}
    y = (x["signal"][:, 0] > x["bias"][:, 0]).astype(np.int64)
    weights = rng.uniform(0.0, 2.0, size=40).astype(np.float32)
    signal, bias = keras.Input((5,), name="signal"), keras.Input((1,), name="bias")
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([signal, bias]))
    hidden = keras.layers.Dropout(0.3, seed=1)(hidden)
    model = keras.Model({"signal": signal, "bias": bias}, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    tputrain.fit(model, (x, y, weights), (x, y), model_dir=model_dir, steps=KERAS_FIT_STEPS,
                 batch_size=8, eval_every=8, steps_per_loop=2, checkpoint_every=2,
                 strategy=strategy_for(2), report_mfu=False,
                 actions=[PauseAtStep(pause_at)] if pause_at else [])


def write_records(directory: Path) -> list[str]:
    x = np.random.RandomState(0).randn(64, 8).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return tputrain.data.write_tfrecords({"x": x, "label": y}, str(directory / "train"),
                                         num_shards=2)


def same_final_weights(tmp_path: Path) -> dict[str, np.ndarray]:
    """Asserts the latest checkpoints of tmp_path/reference and tmp_path/interrupted
    (`killed_and_rerun`) hold the same keys and bitwise-equal values; returns them."""
    expected = final_weights(str(tmp_path / "reference"))
    actual = final_weights(str(tmp_path / "interrupted"))
    assert expected.keys() == actual.keys()
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)
    return expected


def killed_and_rerun(tmp_path: Path, config: Path, step: int) -> tuple[Process, Process]:
    """The uninterrupted CLI run of `config` (in tmp_path/reference) and the rerun of
    its model_dir as a SIGKILL after `step` leaves it (tmp_path/interrupted): the
    reference pauses there and its model_dir is copied, one process less than a
    second run killed there. Both have finished; compare their `final_weights`."""
    def child(model_dir: str, *params: str, pausable: bool = False) -> Process:
        env = pausable_env(child_env()) if pausable else child_env()
        return Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                        f"--gin_file={config}", f"--model_dir={tmp_path / model_dir}",
                        "--deterministic", *params], env, stdin=pausable)
    reference = child("reference", "--gin_param=Trainer.actions=[@PauseAtStep()]",
                      f"--gin_param=PauseAtStep.step={step}", pausable=True)
    copy_at_pause(reference, tmp_path / "reference", tmp_path / "interrupted",
                  rf"tputrain-test: paused at step {step}")
    resumed = child("interrupted")
    assert resumed.finish() == 0, resumed.log()
    assert reference.finish() == 0, reference.log()
    return reference, resumed


MIXTURE_LENGTH, MIXTURE_VOCAB = 16, 32


@gin.configurable
class MixtureTask(tputrain.Task):
    """Next-token rows packed from a shuffled 2-source weighted mixture of
    variable-length records (`sources`: the manifests; tests/data/test_mixture.py).
    `positional`: the train split is `MixtureInput(positional=True)`, windows of 256."""

    def __init__(self, sources: tuple[str, ...] = (), features: dict | None = None,
                 positional: bool = False):
        self.sources = list(sources)
        self.features = features  # the spec of glob sources
        self.positional = positional

    def build_model(self):
        inputs = {name: keras.Input((MIXTURE_LENGTH,), dtype="int64", name=name)
                  for name in ("tokens", "positions", "segment_ids")}
        init = keras.initializers
        hidden = keras.layers.Embedding(MIXTURE_VOCAB, 8, embeddings_initializer=init.RandomNormal(
            seed=1))(inputs["tokens"]) + keras.layers.Embedding(
                MIXTURE_LENGTH, 8, embeddings_initializer=init.RandomNormal(seed=4))(
                    inputs["positions"])
        real = keras.ops.expand_dims(keras.ops.cast(inputs["segment_ids"] > 0, "float32"), -1)
        hidden = keras.layers.Dropout(0.2, seed=2)(hidden * real)
        logits = keras.layers.Dense(MIXTURE_VOCAB, kernel_initializer=init.GlorotUniform(seed=3))
        return keras.Model(inputs, logits(hidden))

    def build_inputs(self, split, input_context):
        from tputrain.data.mixture import MixtureInput
        from tputrain.data.packing import PackSequences

        def targets(row):
            tokens = row["tokens"]
            return {**row, "targets": tf.concat([tokens[1:], tf.zeros_like(tokens[:1])], 0)}

        train = split == "train"
        return MixtureInput(self.sources, [0.7, 0.3], seed=5, shuffle=train, repeat=train,
                            label_key="targets", features=self.features,
                            positional=train and self.positional, window_blocks=1,
                            to_static=lambda d: PackSequences(MIXTURE_LENGTH)(d).map(targets)
                            )(input_context)

    def compute_loss(self, labels, outputs):
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            labels, outputs, from_logits=True), axis=-1)

    def build_optimizer(self):
        return keras.optimizers.SGD(0.1)


@gin.configurable
class PackedRowsTask(MixtureTask):
    """MixtureTask's model on one token source (`manifest`) read by
    `TFRecordInput(positional=True)` (train), packed first-fit over 4 rows within each
    window: a resume builds each host's rows at its place (`tputrain.data.packed_rows`)."""

    def __init__(self, manifest: str = "", window_blocks: int = 1):
        super().__init__()
        self.manifest, self.window_blocks = manifest, window_blocks

    def build_inputs(self, split, input_context):
        from tputrain.data.packing import PackSequences

        def targets(row):
            tokens = row["tokens"]
            return {**row, "targets": tf.concat([tokens[1:], tf.zeros_like(tokens[:1])], 0)}
        train = split == "train"
        rows = tputrain.data.TFRecordInput(
            manifest=self.manifest, positional=train, window_blocks=self.window_blocks, seed=3,
            shuffle=train, repeat=train,
            to_static=lambda d: PackSequences(MIXTURE_LENGTH, bins=4)(d).map(targets)
        )(input_context)
        return rows.map(lambda row: ({k: v for k, v in row.items() if k != "targets"},
                                     row["targets"]))


def write_token_sources(directory, counts: dict[str, int], lengths: tuple[int, int],
                        seed: int, vocab: int = MIXTURE_VOCAB) -> list[str]:
    """One variable-length token source a name (`counts[name]` records of lengths in
    [lengths[0], lengths[1]), tokens in [1, vocab)), 2 shards each: the manifests."""
    from tputrain.data import write_tfrecords

    rng = np.random.default_rng(seed)
    sources = []
    for name, count in counts.items():
        write_tfrecords({"tokens": [rng.integers(1, vocab, size=n) for n in
                                    rng.integers(*lengths, size=count)]},
                        os.path.join(str(directory), name), num_shards=2)
        sources.append(os.path.join(str(directory), f"{name}.manifest.json"))
    return sources


@gin.configurable
class F1RecordsTask(RecordsTask):
    """RecordsTask whose eval is also summarised by a host-side F1 (Task.aggregate_eval):
    it gathers the features too (Task.eval_outputs) and each host writes what it got
    to `dump_dir/aggregated-<host pid>.npz`, so a test sees every gathered row."""

    def __init__(self, pattern: str, eval_pattern: str | None = None, pad_eval: bool = False,
                 dump_dir: str = ""):
        super().__init__(pattern, eval_pattern, pad_eval)
        self.dump_dir = dump_dir

    def eval_outputs(self, batch, model):
        gathered = super().eval_outputs(batch, model)
        return {**gathered, "x": batch[0]["x"]}

    def aggregate_eval(self, outputs):
        from sklearn.metrics import f1_score
        predicted = outputs["outputs"][:, 1] > outputs["outputs"][:, 0]
        if self.dump_dir:
            os.makedirs(self.dump_dir, exist_ok=True)
            np.savez(os.path.join(self.dump_dir, f"aggregated-{os.getpid()}.npz"),
                     x=outputs["x"], labels=outputs["labels"], outputs=outputs["outputs"])
        return {"f1": float(f1_score(outputs["labels"], predicted)),
                "rows": float(len(outputs["labels"]))}


# ------------------------------------------------------------ Keras callbacks over a kill

CALLBACKS_EPOCH_STEPS, CALLBACKS_EPOCHS = 6, 16


class PauseAt(tputrain.Action):
    """Pauses (`PauseAtStep`'s marker and wait) at one instant of a run: "loop:N" after
    the loop ending at step N (before its evaluation and save), "eval:N" after the
    evaluation at N (the Keras callbacks, listed before it, have run: CSV row written,
    rate cut) and before its save, "stop" after the save that follows a stop."""

    def __init__(self, instants: list[str]):
        self.instants = list(instants)

    def _pause(self, instant: str) -> None:
        if instant in self.instants:
            self.instants.remove(instant)
            print(f"tputrain-test: paused at {instant}", flush=True)
            _wait_for_fifo()

    def on_loop_end(self, context, step, logs):
        self._pause(f"loop:{step}")

    def on_eval_end(self, context, step, logs):
        self._pause(f"eval:{step}")

    def on_save(self, context, step, path):
        if context.stop_training:
            self._pause("stop")


def callbacks_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", name="classes")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.3, momentum=0.5),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False)
    return model


def callbacks_data(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 5)).astype(np.float32)
    noisy = rng.uniform(size=examples) < 0.15  # a plateau comes soon
    y = np.where(noisy, rng.integers(0, 3, size=examples), np.argmax(x[:, :3], -1))
    return x, y.astype(np.int64)


def keras_callbacks(model_dir: str, restore_best_weights: bool = False) -> list:
    """ReduceLROnPlateau (cuts with cooldown), EarlyStopping, and a CSVLogger in model_dir."""
    return [keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                              min_delta=0.01, cooldown=1),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, min_delta=0.002,
                                          restore_best_weights=restore_best_weights),
            keras.callbacks.CSVLogger(os.path.join(model_dir, "epochs.csv"))]


def keras_callbacks_run(model_dir: str, replicas: int, instants: list[str] = (),
                        restore_best_weights: bool = False) -> dict:
    """`tputrain.fit` with ReduceLROnPlateau, EarlyStopping and CSVLogger on a dataset
    reshuffled each epoch; pauses at `instants` (`PauseAt`). Writes and returns
    `result.npz` beside model_dir: the model's weights, its optimizer's rate, the
    returned logs."""
    from tiny import strategy_for

    tf.config.experimental.enable_op_determinism()
    model = callbacks_model()  # first: it sets the global seed the shuffle's derives from
    train = tf.data.Dataset.from_tensor_slices(
        callbacks_data(8 * CALLBACKS_EPOCH_STEPS, 1)).shuffle(512, seed=0).batch(8)
    logs = tputrain.fit(model, train, callbacks_data(40, 2), model_dir=model_dir,
                        steps=CALLBACKS_EPOCHS * CALLBACKS_EPOCH_STEPS,
                        eval_every=CALLBACKS_EPOCH_STEPS, steps_per_loop=CALLBACKS_EPOCH_STEPS,
                        checkpoint_every=CALLBACKS_EPOCH_STEPS, strategy=strategy_for(replicas),
                        callbacks=keras_callbacks(model_dir, restore_best_weights),
                        actions=[PauseAt(list(instants))] if instants else [],
                        report_mfu=False, jit_compile=False)
    result = {f"weight/{n}": w for n, w in enumerate(model.get_weights())}
    result["learning_rate"] = np.float32(model.optimizer.learning_rate.numpy())
    result.update({f"logs/{k}": np.float64(v) for k, v in logs.items()})
    np.savez(f"{model_dir.rstrip('/')}.result.npz", **result)
    return result


STARTUP_HOLD = Path(__file__).resolve().parent / "startup_hold"  # its sitecustomize


def sigterm_while_importing(argv: list[str], module: str = "tensorflow") -> "Process":
    """`python -m tputrain.run *argv`, held in its import of `module`
    (tests/support/startup_hold) until the test has sent it SIGTERM, then let go and
    run to its end: the finished Process (`.code`, `.text()`, `.log()`)."""
    hold = module if module == "tensorflow" else f"import:{module}"
    env = dict(child_env(), TPUTRAIN_TEST_HOLD=hold,
               PYTHONPATH=os.pathsep.join([str(STARTUP_HOLD), child_env()["PYTHONPATH"]]))
    process = Process([sys.executable, "-m", "tputrain.run", *argv], env, stdin=True)
    try:
        process.wait_for(f"tputrain-test: held while importing {module}")
        process.process.send_signal(signal.SIGTERM)
        process.send("go")
        process.code = process.finish(timeout=180)
    finally:
        process.process.kill()
    return process
