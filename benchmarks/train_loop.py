"""Training-loop throughput: tputrain's Trainer against the loops people would write instead.

    python benchmarks/train_loop.py            # full run, ~35 minutes on 2 cores
    python benchmarks/train_loop.py --quick    # smoke run on tiny models (JSON to stdout)
    python benchmarks/train_loop.py --fresh --tag fresh   # a new process each round
    python benchmarks/train_loop.py --replicas 2   # MirroredStrategy over 2 split-CPU devices

    python benchmarks/train_loop.py --workloads transformer \
        --contenders tputrain,keras_fit_xla --repeats 5   # a subset
    python benchmarks/train_loop.py --workloads conv --replicas 2 \
        --precision mixed_bfloat16 --tag conv_bf16_2replicas   # the conv net, 2 split-CPU replicas
    python benchmarks/train_loop.py --workloads mlp_dropout --repeats 5 --tag mlp_dropout \
        --contenders tputrain,tputrain_no_xla,tputrain_xla,tputrain_xla_keras_draws
    python benchmarks/train_loop.py --workloads mobilenet,efficientnetb0,resnet50v2 \
        --quick --out -   # keras.applications models, smoke run

Workloads: an MLP, a Transformer LM, only when asked the MLP with Dropout 0.5 after
each hidden layer (`--workloads mlp_dropout`; `tputrain_xla_keras_draws` is its XLA
step with Keras's own draws, as before `tputrain.loop.xla_dropout`), with GaussianNoise
0.1 after each (`mlp_noise`), or behind RandomFlip and RandomContrast on 32x32x3
images (`mlp_augment`), and (only when asked: `--workloads conv`) a small
ResNet with BatchNorm and a Dropout head on 32x32x3 images read from a TFRecord file
with random flip and crop (`ConvTask`); also only when asked, keras.applications
models on the same input at 64x64x3 (`--workloads mobilenet,efficientnetb0,resnet50v2`,
`ApplicationTask`, `weights=None`; MobileNet with alpha 0.5 and its dropout head).
`--precision` sets every contender's policy, `--replicas N` splits the CPU into N
logical devices (`split_cpu`) for every process.

Writes one JSON document to benchmarks/results/<today>-train_loop[-<tag>].json
(`--out PATH`, `--out -` for stdout; progress goes to stderr). Every contender
trains the same model (same initial weights, optimizer, precision, input
pipeline, metric) under the same strategy (the `_no_strategy` peers under none), each
in a process of its own, as a user's job would run:

* `tputrain`: `tputrain.Trainer.train()` with its defaults (jit_compile="auto", guard
  on, exact resume), for each `steps_per_loop` candidate;
* `hand_loop`: one `tf.function` with a `tf.range` loop over `strategy.run` (the
  framework ceiling: nothing but the step);
* `keras_fit`: Keras 3 `model.fit` for each `steps_per_execution` candidate, with
  Keras's default `jit_compile="auto"` (no XLA on a CPU-only machine);
* `keras_fit_xla`: the same with `jit_compile=True`;
* `keras_fit_no_strategy`, `keras_fit_xla_no_strategy`, `hand_loop_no_strategy`: the
  same with no strategy at all, as most scripts run on one device (no distributed
  dataset: fit with XLA ran the MLP 1.3-1.5x faster so). "keras_fit_best" and
  "hand_loop_best" are the best of each peer's configurations;
* `tputrain_no_xla`, `tputrain_no_guard`, `tputrain_no_xla_no_guard`: the Trainer
  with XLA off and/or the NaN/Inf guard off, to show what each costs or buys;
* `tputrain_fit` (only when named in `--contenders`): `tputrain.fit` on the Keras model
  compiled as `keras_fit`'s, on the same dataset, with its defaults;
* `tputrain_no_strategy`: the defaults under TensorFlow's default strategy (one
  device), to show what `OneDeviceStrategy` costs tputrain;
* `tputrain_program_10` (only when named): the defaults with 10 steps a launch, where
  "auto" gives a conv net on a CPU one;
* `tputrain_program_1`: the defaults with one step per XLA program launch
  (`steps_per_program=1`), to show what several steps a launch buy;
* `orbit`: Orbit's `StandardTrainer` (`tf.while_loop` over the step), if
  importable (`pip install --no-deps tf-models-official tf-keras`; never let pip
  replace TensorFlow).

Each is built and traced once in its own spawned process (with `--fresh`, once
per round in a new process), then measured `--repeats` times in short rounds,
interleaved (contender order rotates each round; the parent asks one process
at a time while the others wait idle), and the medians are reported. One process each because, in one shared process, where
a contender sat (which models and compiled programs were built before it) moved
its rate by 10% on the Transformer and up to a third on the MLP on this VM; and
each contender's CPU time is then its own. Many short rounds follow a shared machine's changing load better than a
few long ones. Steady-state steps/s only: every contender is timed from the end of its
first loop (call of k steps) to the end of its last, so per-call start-up and
end-of-call work (a fit's iterator teardown, the Trainer's final checkpoint and
eval), which a real run pays once, and any cost of switching contenders are
outside the window for all alike. Per-loop host work (the Trainer's logs and
TensorBoard summaries, Keras callbacks) is inside it.
Compare the ratios measured side by side, not absolute numbers across runs.
`--first_steps N`: the tputrain contenders' first, untimed call trains N steps
(not k), so a run is long enough for `jit_compile="auto"`'s plan trial
(`tputrain.loop.plan_trial`: a run of fewer than 10x its steps has none), which
then picks the plan the timed calls run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

import result_file  # noqa: E402  (benchmarks/, this script's folder)
from resume_time import cpu_kind  # noqa: E402  (benchmarks/: lscpu's instruction sets)
import tputrain  # noqa: E402
from tputrain.data import InputContext  # noqa: E402
from tputrain.loop.convolutions import onednn_enabled  # noqa: E402
from tputrain.core.cpu_info import cpu_name  # noqa: E402
from tputrain.precision import to_float32  # noqa: E402
from tputrain.tasks import SyntheticLMTask  # noqa: E402


def log(message: str) -> None:
    print(f"[train_loop] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------- tasks


class MLPTask(tputrain.Task):
    """A dense MLP classifier on a fixed set of random in-memory batches."""

    def __init__(self, features: int, hidden: tuple[int, ...], classes: int = 10,
                 batches: int = 16, optimizer: str = "adam", dropout: float = 0.0,
                 noise: float = 0.0, augment: bool = False):
        self.features, self.hidden, self.classes = features, hidden, classes
        self.batches = batches
        self.optimizer = optimizer
        self.dropout = dropout  # a Dropout after each hidden layer
        self.noise = noise  # a GaussianNoise of this stddev after each hidden layer
        # RandomFlip and RandomContrast on the features as square RGB images
        self.augment = augment

    def build_model(self) -> keras.Model:
        x = inputs = keras.Input((self.features,), name="x")
        if self.augment:
            side = int(round((self.features // 3) ** 0.5))
            x = keras.layers.Reshape((side, side, 3))(x)
            x = keras.layers.RandomFlip(seed=1)(x)
            x = keras.layers.Flatten()(keras.layers.RandomContrast(0.2, seed=2)(x))
        for units in self.hidden:
            x = keras.layers.Dense(units, activation="relu")(x)
            if self.dropout:
                x = keras.layers.Dropout(self.dropout)(x)
            if self.noise:
                x = keras.layers.GaussianNoise(self.noise)(x)
        logits = keras.layers.Dense(self.classes, dtype="float32")(x)
        return keras.Model({"x": inputs}, logits)

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        rng = np.random.RandomState(0)
        x = rng.randn(self.batches * batch, self.features).astype(np.float32)
        y = rng.randint(0, self.classes, self.batches * batch).astype(np.int64)
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(batch, drop_remainder=True)
        return (dataset.cache().repeat() if split == "train" else dataset).prefetch(2)

    def compute_loss(self, labels, outputs) -> tf.Tensor:
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        return tputrain.build_optimizer(self.optimizer, learning_rate=1e-3)


class LMTask(SyntheticLMTask):
    """configs/synthetic_transformer.gin's model and optimizer, without gin."""

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        return tputrain.build_optimizer("adamw", learning_rate=5e-4, weight_decay=0.01,
                                        global_clipnorm=1.0)

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


class ConvTask(tputrain.Task):
    """A small ResNet (BatchNorm, a Dropout head) on random 32x32x3 images read from a
    TFRecord file, with random flip and crop (`tputrain.data.stateless_augment`)."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), blocks: int = 1,
                 examples: int = 1024, classes: int = 10, size: int = 32):
        self.widths, self.blocks, self.classes = widths, blocks, classes
        self.examples, self.size = examples, size
        self._manifest: str | None = None

    def build_model(self) -> keras.Model:
        layers = keras.layers
        x = inputs = keras.Input((self.size, self.size, 3), name="image")
        x = layers.Conv2D(self.widths[0], 3, padding="same", use_bias=False)(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        for stage, width in enumerate(self.widths):
            for block in range(self.blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                shortcut = x
                y = layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
                y = layers.ReLU()(layers.BatchNormalization()(y))
                y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
                y = layers.BatchNormalization()(y)
                if stride != 1 or shortcut.shape[-1] != width:
                    shortcut = layers.Conv2D(width, 1, strides=stride, use_bias=False)(shortcut)
                    shortcut = layers.BatchNormalization()(shortcut)
                x = layers.ReLU()(layers.Add()([y, shortcut]))
        x = layers.Dropout(0.3)(layers.GlobalAveragePooling2D()(x))
        logits = layers.Dense(self.classes, dtype="float32")(x)
        return keras.Model({"image": inputs}, logits)

    def _records(self) -> str:
        """The manifest of a TFRecord file of random uint8 images, written once a process."""
        if self._manifest is None:
            rng = np.random.RandomState(0)
            images = rng.randint(0, 256, (self.examples, self.size, self.size, 3))
            labels = rng.randint(0, self.classes, self.examples)
            folder = tempfile.mkdtemp(prefix="tputrain-bench-conv-")
            tputrain.data.write_tfrecords({"image": images.astype(np.int64), "label": labels},
                                          os.path.join(folder, "train"), num_shards=1)
            self._manifest = os.path.join(folder, "train.manifest.json")
        return self._manifest

    def build_inputs(self, split: str, input_context: InputContext) -> tf.data.Dataset:
        train = split == "train"
        source = tputrain.data.TFRecordInput(
            manifest=self._records(), label_key="label", cache="memory", seed=0,
            shuffle=train, repeat=train)
        dataset = source(input_context)
        if train:
            dataset = dataset.apply(tputrain.data.stateless_augment(
                self._augment, seed=0, input_context=input_context))
        else:
            dataset = dataset.map(lambda f, y: ({"image": tf.cast(f["image"], tf.float32) / 255.0}, y))
        return dataset.prefetch(2)

    def _augment(self, features, labels, seed):
        """Per image: a random horizontal flip and a random 32x32 crop of the image
        padded by 4 pixels (vectorized over the batch)."""
        flip_seed, crop_seed = tf.unstack(tf.random.split(seed, 2))
        images = tf.cast(tf.reshape(features["image"], [-1, self.size, self.size, 3]),
                         tf.float32) / 255.0
        images = tf.image.stateless_random_flip_left_right(images, flip_seed)
        padded = tf.pad(images, [[0, 0], [4, 4], [4, 4], [0, 0]])
        offsets = tf.random.stateless_uniform([tf.shape(images)[0], 2], crop_seed, 0, 9,
                                              dtype=tf.int32)
        window = tf.range(self.size)
        rows = tf.gather(padded, offsets[:, :1] + window, axis=1, batch_dims=1)
        images = tf.gather(rows, offsets[:, 1:] + window, axis=2, batch_dims=1)
        return {"image": images}, labels

    def compute_loss(self, labels, outputs) -> tf.Tensor:
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_metrics(self) -> list[keras.metrics.Metric]:
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]

    def build_optimizer(self) -> keras.optimizers.Optimizer:
        return tputrain.build_optimizer("sgd", learning_rate=0.05, momentum=0.9)


class ApplicationTask(ConvTask):
    """A keras.applications model (`weights=None`: nothing downloads) on ConvTask's
    input (random images from a TFRecord file, random flip and crop) at a small size;
    `options` go to the application (MobileNet's `alpha` and `dropout`, ...)."""

    def __init__(self, application: str, size: int = 64, examples: int = 512,
                 **options: Any):
        super().__init__(examples=examples, size=size)
        self.application, self.options = application, options

    def build_model(self) -> keras.Model:
        inputs = keras.Input((self.size, self.size, 3), name="image")
        network = getattr(keras.applications, self.application)(
            weights=None, input_shape=(self.size, self.size, 3), classes=self.classes,
            classifier_activation=None, **self.options)
        logits = keras.layers.Activation("linear", dtype="float32")(network(inputs))
        return keras.Model({"image": inputs}, logits)


# The keras.applications workloads (only when asked, as the conv net): name ->
# (application, its options, quick size, full size, quick and full global batch).
APPLICATIONS = {
    "mobilenet": ("MobileNet", {"alpha": 0.5}, 32, 64, 8, 32),  # its head's Dropout 0.001
    "efficientnetb0": ("EfficientNetB0", {}, 32, 64, 8, 32),
    "resnet50v2": ("ResNet50V2", {}, 32, 64, 8, 32),
}


def application_workload(name: str, quick: bool) -> Workload:
    """A keras.applications model at a small input (`APPLICATIONS`)."""
    application, options, quick_size, size, quick_batch, batch = APPLICATIONS[name]
    size, batch = (quick_size, quick_batch) if quick else (size, batch)
    described = ", ".join([f"{key} {value}" for key, value in options.items()]
                          + [f"{size}x{size}x3 from TFRecords, random flip + crop"])
    return Workload(lambda: ApplicationTask(application, size, examples=8 * batch, **options),
                    batch, 10 if quick else 40, [5] if quick else [10],
                    f"keras.applications.{application} (weights=None), {described}, SGD momentum")


def probe_matmul(dtype: str, size: int = 2048, repeats: int = 8) -> tuple[float, float]:
    """(FLOP/s, FLOP per CPU-second of this process) of the best [size x size] matmul.

    The first is what `tputrain.observe.flops.measure_matmul_peak` caches; the second is
    the matmul's efficiency per CPU-second, the denominator of a CPU-time MFU.
    """
    a = tf.cast(tf.random.stateless_normal([size, size], seed=[1, 2]), dtype)
    b = tf.cast(tf.random.stateless_normal([size, size], seed=[3, 4]), dtype)
    matmul = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[:1, :1], tf.float32)))
    matmul(a, b).numpy()
    wall = cpu = float("inf")
    for _ in range(repeats):
        start = _now()
        matmul(a, b).numpy()
        end = _now()
        wall, cpu = min(wall, end[0] - start[0]), min(cpu, max(end[1] - start[1], 1e-9))
    return 2.0 * size**3 / wall, 2.0 * size**3 / cpu


# --------------------------------------------------------------- contenders


class Contender:
    """Builds once (`prepare`), then `measure(steps)` returns steps/s."""

    name = ""
    # True: built under the default strategy (a script that makes none), as Keras users
    # run fit on one device; else under tputrain.resolve_strategy()'s.
    no_strategy = False

    def __init__(self, task_factory: Callable[[], tputrain.Task], strategy, global_batch: int,
                 precision: str, k: int):
        self.task_factory = task_factory
        self.strategy = strategy
        self.global_batch = global_batch
        self.precision = precision
        self.k = k

    def _policy(self) -> None:
        keras.mixed_precision.set_global_policy(self.precision)
        keras.utils.set_random_seed(0)

    def _compiled_keras_model(self, task: tputrain.Task, **compile_options) -> keras.Model:
        """The task's model compiled as a Keras user compiles it for `fit`, in the scope."""
        with self.strategy.scope():
            model = task.build_model()
            model.compile(
                optimizer=task.build_optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                **compile_options)
        return model

    def prepare(self) -> None:
        raise NotImplementedError

    def measure(self, steps: int) -> tuple[float, float]:
        raise NotImplementedError


def _now() -> tuple[float, float]:
    """(wall clock, this process's CPU time over all its threads)."""
    return time.perf_counter(), time.process_time()


def _rate(times: list[tuple[float, float]], steps_between: int) -> tuple[float, float]:
    """(steps per wall second, steps per CPU second of this process).

    On a machine shared with other jobs the wall clock mostly measures the others;
    CPU time spent by this process per step is much less sensitive to them.
    """
    if len(times) < 2:
        raise RuntimeError("need at least two loops per measurement: raise the step count")
    return (steps_between / (times[-1][0] - times[0][0]),
            steps_between / max(times[-1][1] - times[0][1], 1e-9))


FIRST_STEPS = "TPUTRAIN_BENCH_FIRST_STEPS"  # `--first_steps`, for the spawned contenders


def _first_steps(k: int) -> int:
    """The steps of a tputrain contender's first, untimed call: k, or `--first_steps`."""
    return max(k, int(os.environ.get(FIRST_STEPS) or 0))


class TputrainContender(Contender):
    """The Trainer with its defaults (jit_compile="auto", guard on, exact resume on)."""

    name = "tputrain"
    jit_compile = "auto"
    guard_policy: str | None = "raise"
    steps_per_program: int | str = "auto"

    def prepare(self) -> None:
        self.model_dir = tempfile.mkdtemp(prefix="tputrain-bench-")
        self._times: list[tuple[tuple[float, float], int]] = []
        times = self._times

        class LoopClock(tputrain.Action):
            """The time at the end of each loop's host work (progress line included)."""

            steps = 0

            def loop_metrics(self, trainer, step, steps, seconds):
                self.steps = steps  # called before on_loop_end, in the same loop
                return {}

            def on_loop_end(self, trainer, step, logs):
                times.append((_now(), self.steps))

        clock = LoopClock()
        guard = tputrain.NonFiniteGuard(policy=self.guard_policy)
        self.trainer = tputrain.Trainer(
            self.task_factory(), self.model_dir, strategy=self.strategy,
            train_steps=_first_steps(self.k),
            steps_per_loop=self.k, global_batch_size=self.global_batch,
            checkpoint_every=10**9, eval_steps=1, precision=self.precision, seed=0,
            jit_compile=self.jit_compile, guard=guard, actions=[clock],
            steps_per_program=self.steps_per_program)
        self.trainer.train()  # traces the loop, runs k (or --first_steps) steps, saves, evaluates once
        # Later train(num_steps) calls continue from there (their restore of the
        # checkpoint just written is outside the timed window).

    def measure(self, steps: int) -> tuple[float, float]:
        self._times.clear()
        self.trainer.train(num_steps=max(steps, 2 * self.k))
        return _rate([t for t, _ in self._times], sum(s for _, s in self._times[1:]))

    @property
    def flops_per_step(self) -> float | None:
        return self.trainer.flops_per_step

    @property
    def xla_plan(self) -> str:
        """Why the step runs as it does (the start-up line's `XLA ...`)."""
        return self.trainer._steps.run_plan.xla_plan.why  # pylint: disable=protected-access


class TputrainFitContender(Contender):
    """`tputrain.fit` on a compiled Keras model and the peers' dataset, with its defaults
    (the Trainer's: jit_compile="auto", guard on), `steps_per_loop` k: what a Keras user
    switching from `model.fit` runs. Each measurement is one more `fit` call continuing
    the same model_dir (a new Trainer restores it, outside the timed window)."""

    name = "tputrain_fit"

    def prepare(self) -> None:
        self._policy()
        task = self.task_factory()
        self.model = self._compiled_keras_model(task)
        self.dataset = peer_inputs(self, task)
        self.model_dir = tempfile.mkdtemp(prefix="tputrain-bench-fit-")
        self._times: list[tuple[tuple[float, float], int]] = []
        self.steps = 0
        self._fit(_first_steps(self.k))

    def _fit(self, steps: int) -> None:
        times = self._times

        class LoopClock(tputrain.Action):
            """The time at the end of each loop's host work (as TputrainContender's)."""

            steps = 0

            def loop_metrics(self, trainer, step, steps, seconds):
                self.steps = steps
                return {}

            def on_loop_end(self, trainer, step, logs):
                times.append((_now(), self.steps))

        self.steps += steps
        tputrain.fit(self.model, self.dataset, model_dir=self.model_dir, steps=self.steps,
                     strategy=self.strategy, steps_per_loop=self.k, checkpoint_every=10**9,
                     precision=self.precision, seed=0, actions=[LoopClock()])

    def measure(self, steps: int) -> tuple[float, float]:
        self._times.clear()
        self._fit(max(steps, 2 * self.k))
        return _rate([t for t, _ in self._times], sum(s for _, s in self._times[1:]))


class TputrainNoXLAContender(TputrainContender):
    """The same Trainer with `jit_compile=False`: what "auto" bought."""

    name = "tputrain_no_xla"
    jit_compile = False


class TputrainNoStrategyContender(TputrainContender):
    """The Trainer under TensorFlow's default strategy (no `strategy.scope()`), as
    the no-strategy peers run: what `OneDeviceStrategy` costs on one device."""

    name = "tputrain_no_strategy"
    no_strategy = True


class TputrainXLAContender(TputrainContender):
    """The Trainer with `jit_compile=True`: the whole step compiled, whatever "auto"
    would have chosen (random ops on CPU included)."""

    name = "tputrain_xla"
    jit_compile = True


class TputrainXLAKerasDrawsContender(TputrainXLAContender):
    """`jit_compile=True` with Keras's own draws in the XLA program (the
    "auto_select" algorithm, whose key XLA's CPU fusion derived once a mask element),
    as the step drew them before `tputrain.loop.xla_dropout`."""

    name = "tputrain_xla_keras_draws"

    def prepare(self) -> None:
        from tputrain.loop import xla_dropout  # pylint: disable=import-outside-toplevel
        xla_dropout._OURS.clear()  # pylint: disable=protected-access  # this process only
        super().prepare()


class TputrainNoGuardContender(TputrainContender):
    """The default Trainer with the NaN/Inf guard off (`NonFiniteGuard.policy=None`):
    what the guard costs."""

    name = "tputrain_no_guard"

    guard_policy = None


class TputrainOneStepAProgramContender(TputrainContender):
    """The defaults but one step per XLA program launch (`steps_per_program=1`, the
    loop before several steps a launch): what the programs buy."""

    name = "tputrain_program_1"
    steps_per_program = 1


class TputrainTenStepsAProgramContender(TputrainContender):
    """The defaults but 10 steps per XLA program launch, where "auto" gives a conv net
    on a CPU one (`steps_per_program=10`; only when named): whether that rule holds."""

    name = "tputrain_program_10"
    steps_per_program = 10


class TputrainNoXLANoGuardContender(TputrainNoGuardContender):
    name = "tputrain_no_xla_no_guard"
    jit_compile = False


class TputrainBF16Contender(TputrainContender):
    """The same Trainer in mixed_bfloat16, interleaved with the float32 contenders."""

    name = "tputrain_bf16"

    def prepare(self) -> None:
        self.precision = "mixed_bfloat16"
        super().prepare()


def _replica_step(task: tputrain.Task, model, optimizer, metric, global_batch: int):
    def step(batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            outputs = to_float32(model(features, training=True))
            loss = tf.nn.compute_average_loss(task.compute_loss(labels, outputs),
                                              global_batch_size=global_batch)
            scaled = optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        metric.update_state(labels, outputs)
        return loss
    return step


def _build(contender: Contender):
    contender._policy()  # pylint: disable=protected-access
    task = contender.task_factory()
    with contender.strategy.scope():
        model = task.build_model()
        optimizer = task.build_optimizer()
        optimizer.build(model.trainable_variables)
        metric = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    return task, model, optimizer, metric, peer_inputs(contender, task)


def peer_inputs(contender: Contender, task: tputrain.Task) -> tf.data.Dataset:
    """The train dataset a peer (fit, the hand loop, Orbit) splits over its replicas:
    batches of the global batch, as one replica's Task would build them. (A Task
    builds per-replica batches; `experimental_distribute_dataset` and `fit` split
    each element again, so the Task's 2-replica batches gave the peers half the
    examples a step.)"""
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0,
                           num_replicas_in_sync=1, global_batch_size=contender.global_batch)
    return task.build_inputs("train", context)


class HandLoopContender(Contender):
    name = "hand_loop"

    def prepare(self) -> None:
        task, model, optimizer, metric, dataset = _build(self)
        step = _replica_step(task, model, optimizer, metric, self.global_batch)
        strategy = self.strategy
        self.iterator = iter(strategy.experimental_distribute_dataset(dataset))

        @tf.function
        def loop(iterator, num_steps):
            for _ in tf.range(num_steps):
                strategy.run(step, args=(next(iterator),))

        self.loop = loop
        self.loop(self.iterator, tf.constant(self.k))

    def measure(self, steps: int) -> tuple[float, float]:
        times = []
        for _ in range(max(2, steps // self.k)):
            self.loop(self.iterator, tf.constant(self.k))
            times.append(_now())
        return _rate(times, self.k * (len(times) - 1))


class KerasFitContender(Contender):
    name = "keras_fit"
    jit_compile: bool | str = "auto"  # Keras's default: on a CPU-only machine, no XLA

    def prepare(self) -> None:
        self._policy()
        task = self.task_factory()
        self.model = self._compiled_keras_model(task, steps_per_execution=self.k,
                                                jit_compile=self.jit_compile)
        self.dataset = peer_inputs(self, task)
        self._times: list[tuple[float, float]] = []
        times = self._times

        class Timer(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                times.append(_now())

        self.timer = Timer()
        self.model.fit(self.dataset, epochs=1, steps_per_epoch=2 * self.k, verbose=0,
                       callbacks=[self.timer])

    def measure(self, steps: int) -> tuple[float, float]:
        self._times.clear()
        steps = max(2, steps // self.k) * self.k
        self.model.fit(self.dataset, epochs=1, steps_per_epoch=steps, verbose=0,
                       callbacks=[self.timer])
        # One callback per execution of k steps: timed to the last step, not to the
        # end of fit (which also waits for the iterator to be freed).
        return _rate(self._times, self.k * (len(self._times) - 1))


class KerasFitXLAContender(KerasFitContender):
    """`model.fit` with `jit_compile=True`: Keras at its best, against tputrain_xla."""

    name = "keras_fit_xla"
    jit_compile = True


class KerasFitNoStrategyContender(KerasFitContender):
    """`model.fit` with no strategy scope, as most Keras scripts on one device run it:
    no distributed dataset (under OneDeviceStrategy, fit with XLA ran the MLP 1.3-1.5x
    slower here, at the cost of its per-step iterator)."""

    name = "keras_fit_no_strategy"
    no_strategy = True


class KerasFitXLANoStrategyContender(KerasFitXLAContender):
    name = "keras_fit_xla_no_strategy"
    no_strategy = True


class HandLoopNoStrategyContender(HandLoopContender):
    """The hand-written loop with no strategy: the plain dataset iterator."""

    name = "hand_loop_no_strategy"
    no_strategy = True


def _orbit():
    try:
        import orbit  # noqa: F401  pylint: disable=import-outside-toplevel
        return orbit, None
    except Exception as error:  # pylint: disable=broad-except
        return None, (f"cannot import orbit ({type(error).__name__}: {error}); install it for "
                      "the benchmark with `pip install --no-deps tf-models-official tf-keras` "
                      "(tf-models-official 2.20 pins TensorFlow 2.20: --no-deps keeps 2.21)")


class OrbitContender(Contender):
    name = "orbit"

    def prepare(self) -> None:
        orbit, error = _orbit()
        if orbit is None:
            raise RuntimeError(error)
        task, model, optimizer, metric, dataset = _build(self)
        step = _replica_step(task, model, optimizer, metric, self.global_batch)
        strategy = self.strategy

        class Trainer(orbit.StandardTrainer):
            def __init__(self):
                super().__init__(strategy.experimental_distribute_dataset(dataset),
                                 options=orbit.StandardTrainerOptions(use_tf_while_loop=True))

            def train_step(self, iterator):
                strategy.run(step, args=(next(iterator),))

            def train_loop_end(self):
                return {"accuracy": metric.result()}

        with strategy.scope():
            self.trainer = Trainer()
        self.trainer.train(tf.constant(self.k))

    def measure(self, steps: int) -> tuple[float, float]:
        times = []
        for _ in range(max(2, steps // self.k)):
            self.trainer.train(tf.constant(self.k))
            times.append(_now())
        return _rate(times, self.k * (len(times) - 1))


# ------------------------------------------------------- one process each


CONTENDERS: dict[str, type[Contender]] = {kind.name: kind for kind in (
    TputrainContender, HandLoopContender, KerasFitContender, OrbitContender,
    TputrainNoXLAContender, KerasFitXLAContender, TputrainNoGuardContender,
    TputrainNoXLANoGuardContender, TputrainBF16Contender, KerasFitNoStrategyContender,
    KerasFitXLANoStrategyContender, HandLoopNoStrategyContender,
    TputrainOneStepAProgramContender, TputrainXLAContender, TputrainNoStrategyContender,
    TputrainXLAKerasDrawsContender, TputrainFitContender, TputrainTenStepsAProgramContender)}
# Each peer at its best: the best median of its configurations (strategy, XLA).
BEST_OF = {"keras_fit_best": ("keras_fit", "keras_fit_xla", "keras_fit_no_strategy",
                              "keras_fit_xla_no_strategy"),
           "hand_loop_best": ("hand_loop", "hand_loop_no_strategy")}


class Workload(NamedTuple):
    task_factory: Callable[[], tputrain.Task]
    global_batch: int
    steps: int  # per measurement
    ks: list[int]  # steps per call tried
    model: str


def workload(name: str, quick: bool) -> Workload:
    """The three workloads, rebuilt by name in each contender's process."""
    if name == "mlp":
        if quick:
            return Workload(lambda: MLPTask(64, (128, 128)), 64, 40, [10], "MLP 64-128-128-10")
        # 400 steps (~7 s) a measurement: 50 MLP steps (1 s) were too short here.
        return Workload(lambda: MLPTask(512, (1024, 1024)), 256, 400, [20, 50],
                        "MLP 512-1024-1024-10, Adam")
    if name == "transformer":
        if quick:
            return Workload(lambda: LMTask(vocab_size=128, sequence_length=32, width=64,
                                           num_layers=1, num_heads=2), 8, 20, [5], "1-layer LM")
        return Workload(lambda: LMTask(vocab_size=512, sequence_length=128, width=256,
                                       num_layers=4, num_heads=4), 16, 30, [10],
                        "configs/synthetic_transformer.gin: 4 layers, width 256, "
                        "16 x 128 tokens, AdamW + clipnorm")
    if name == "conv":
        if quick:
            return Workload(lambda: ConvTask(widths=(8, 16), examples=256), 32, 20, [5],
                            "ResNet 8-16, 1 block a stage")
        return Workload(lambda: ConvTask(), 32, 40, [10],
                        "ResNet 16-32-64 (1 residual block a stage, BatchNorm, Dropout 0.3 "
                        "head), SGD momentum; 32x32x3 from TFRecords, random flip + crop")
    if name in APPLICATIONS:
        return application_workload(name, quick)
    if name == "mlp_dropout":  # issue 55: random layers under XLA
        if quick:
            return Workload(lambda: MLPTask(64, (128, 128), dropout=0.5), 64, 40, [10],
                            "MLP 64-128-128-10, Dropout 0.5")
        return Workload(lambda: MLPTask(512, (1024, 1024), dropout=0.5), 256, 60, [20],
                        "MLP 512-1024-1024-10, Dropout 0.5 after each hidden layer, Adam")
    if name == "mlp_noise":  # issue 55: GaussianNoise's normal draws under XLA
        if quick:
            return Workload(lambda: MLPTask(64, (128, 128), noise=0.1), 64, 40, [10],
                            "MLP 64-128-128-10, GaussianNoise 0.1")
        return Workload(lambda: MLPTask(512, (1024, 1024), noise=0.1), 256, 60, [20],
                        "MLP 512-1024-1024-10, GaussianNoise 0.1 after each hidden layer, Adam")
    if name == "mlp_augment":  # issue 55: augmentation layers under XLA
        if quick:
            return Workload(lambda: MLPTask(192, (128,), augment=True), 64, 40, [10],
                            "MLP on 8x8x3, RandomFlip + RandomContrast")
        return Workload(lambda: MLPTask(3072, (1024, 1024), augment=True), 256, 60, [20],
                        "MLP 3072-1024-1024-10 on 32x32x3, RandomFlip + RandomContrast, Adam")
    if name == "small_mlp":
        return Workload(lambda: MLPTask(32, (64,), batches=8), 64, 100 if quick else 1000,
                        [1, 50], "MLP 32-64-10, batch 64 (per-call overhead dominates)")
    raise ValueError(f"unknown workload {name!r}")


def serve(conn, workload_name: str, quick: bool, kind_name: str, ks: list[int],
          precision: str, replicas: int | None = None) -> None:
    """`_serve` with every temporary folder of this process (model dirs, records) under
    one folder that goes when the process ends: a queue of cells left ~150 MB each."""
    tempfile.tempdir = tempfile.mkdtemp(prefix="tputrain-bench-process-")
    try:
        _serve(conn, workload_name, quick, kind_name, ks, precision, replicas)
    finally:
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)


def _serve(conn, workload_name: str, quick: bool, kind_name: str, ks: list[int],
           precision: str, replicas: int | None = None) -> None:
    """A contender's own process: prepares it for each k, then measures on request.

    Its CPU time is its own: nothing another contender built or left behind (models,
    compiled programs, allocator state, threads) is in this process. With `replicas`
    > 1 its CPU is split into that many logical devices (MirroredStrategy over them).
    """
    logging.set_verbosity(logging.WARNING)
    try:
        if replicas:
            tputrain.split_cpu(replicas)
        kind = CONTENDERS[kind_name]
        strategy = tputrain.resolve_strategy()
        if kind.no_strategy:
            if strategy.num_replicas_in_sync > 1:
                raise RuntimeError(f"{kind_name} is for one device; this machine has "
                                   f"{strategy.num_replicas_in_sync} replicas")
            strategy = tf.distribute.get_strategy()
        spec = workload(workload_name, quick)
        contenders = {}
        for k in ks:
            contenders[k] = kind(spec.task_factory, strategy, spec.global_batch, precision, k)
            contenders[k].prepare()
    except Exception as error:  # pylint: disable=broad-except
        message = f"{type(error).__name__}: {error}"  # TF's start and its last lines
        conn.send(("error", message if len(message) <= 800 else
                   f"{message[:300]} ... {message[-500:]}"))
        return
    conn.send(("ready", {key: getattr(contenders[ks[0]], key, None)
                         for key in ("flops_per_step", "xla_plan")}))
    while True:
        request = conn.recv()
        if request[0] == "stop":
            return
        _, k, steps = request
        conn.send(contenders[k].measure(steps))


class ContenderProcess:
    """The parent's handle on one contender kind in its own (spawned) process."""

    def __init__(self, workload_name: str, quick: bool, kind: type[Contender],
                 ks: list[int], precision: str, replicas: int | None = None):
        context = multiprocessing.get_context("spawn")
        self.name, self.ks = kind.name, ks
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=serve, args=(child, workload_name, quick, kind.name, ks, precision, replicas),
            name=f"bench-{kind.name}", daemon=True)
        self._process.start()
        child.close()
        self.flops_per_step: float | None = None
        self.xla_plan: str | None = None

    def wait_ready(self) -> None:
        """Raises RuntimeError with the child's error if it could not prepare."""
        try:
            status, value = self._conn.recv()
        except EOFError:
            status, value = "error", f"the process died (exit code {self._process.exitcode})"
        if status != "ready":
            self.close()
            raise RuntimeError(value)
        self.flops_per_step, self.xla_plan = value["flops_per_step"], value["xla_plan"]

    def measure(self, k: int, steps: int) -> tuple[float, float]:
        try:
            self._conn.send(("measure", k, steps))
            return self._conn.recv()
        except (EOFError, BrokenPipeError) as error:
            raise RuntimeError(f"{self.name}'s process died while measuring k={k} (exit code "
                               f"{self._process.exitcode}); its stderr is above") from error

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()


# -------------------------------------------------------------- the runner


def summarize(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "all": [round(v, 4) for v in values]}


Rates = dict[tuple[str, int], list[float]]  # (contender, k) -> one rate per round


def run_workload(name: str, quick: bool, precision: str, kinds: list[type[Contender]],
                 repeats: int, peaks: dict[str, list[tuple[float, float]]],
                 ks: list[int] | None = None, fresh: bool = False,
                 replicas: int | None = None) -> dict[str, Any]:
    """Measures every contender `repeats` times, interleaved, each in a process of its own:
    the same process all rounds, or with `fresh` a new one each round (so a process's
    luck, where its memory landed, is one sample of the median rather than all)."""
    spec = workload(name, quick)
    ks = ks or spec.ks
    rates: Rates = {}
    cpu_rates: Rates = {}
    skipped: dict[str, str] = {}
    flops: dict[str, float] = {}  # the Trainer's FLOPs per step, from its first process

    def record(process: ContenderProcess) -> None:
        for k in ks:
            wall, cpu = process.measure(k, spec.steps)
            rates.setdefault((process.name, k), []).append(wall)
            cpu_rates.setdefault((process.name, k), []).append(cpu)
        if process.name == "tputrain":
            flops.setdefault("per_step", process.flops_per_step)
            flops.setdefault("xla_plan", process.xla_plan)

    def start(kind: type[Contender]) -> ContenderProcess | None:
        process = ContenderProcess(name, quick, kind, ks, precision, replicas)
        try:
            process.wait_ready()
            return process
        except RuntimeError as error:
            skipped[kind.name] = str(error)
            log(f"{name}: {kind.name} cannot run: {error}")
            return None

    kept = {} if fresh else {kind.name: start(kind) for kind in kinds}
    try:
        for repeat in range(repeats):
            order = kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]
            for kind in order:
                if kind.name in skipped:
                    continue
                process = start(kind) if fresh else kept[kind.name]
                if process is not None:
                    record(process)
                    if fresh:
                        process.close()
            for dtype in peaks:  # the matmul peak, probed between the same measurements
                peaks[dtype].append(probe_matmul(dtype))
            log(f"{name}: repeat {repeat + 1}/{repeats} (steps/s, steps/CPU-s): " + ", ".join(
                f"{n} k={k} {v[-1]:.2f} {cpu_rates[(n, k)][-1]:.2f}"
                for (n, k), v in rates.items()))
    finally:
        for process in kept.values():
            if process is not None:
                process.close()
    results = _summary(rates, cpu_rates, skipped, kinds, spec.global_batch)
    results.update({"precision": precision, "replicas": replicas or 1,
                    "steps_per_measurement": spec.steps,
                    "repeats": repeats, "fresh_process_each_round": fresh})
    if flops.get("per_step"):
        results["flops_per_step"] = flops["per_step"]
    if flops.get("xla_plan"):
        results["tputrain_xla_plan"] = flops["xla_plan"]
    return results


def _summary(rates: Rates, cpu_rates: Rates, skipped: dict[str, str],
             kinds: list[type[Contender]], global_batch: int) -> dict[str, Any]:
    """Each contender at its best k (by median), and the ratios between them."""
    results: dict[str, Any] = {"global_batch_size": global_batch}
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    for kind in kinds:
        per_k = {k: summarize(v) for (n, k), v in rates.items() if n == kind.name}
        per_k_cpu = {k: summarize(v) for (n, k), v in cpu_rates.items() if n == kind.name}
        if not per_k:
            results[kind.name] = {"error": skipped.get(kind.name, "not run")}
            continue
        best_k = max(per_k, key=lambda k: per_k[k]["median"])
        best[kind.name] = per_k[best_k]["median"]
        best_cpu[kind.name] = max(v["median"] for v in per_k_cpu.values())
        results[kind.name] = {
            "best_steps_per_call": best_k, "steps_per_second": per_k[best_k]["median"],
            "examples_per_second": per_k[best_k]["median"] * global_batch,
            "steps_per_cpu_second": best_cpu[kind.name],
            "by_steps_per_call": {str(k): v for k, v in per_k.items()},
            "by_steps_per_call_cpu_time": {str(k): v for k, v in per_k_cpu.items()}}
    ratios = _ratios(best, best_cpu)
    if ratios:
        results["ratios"] = ratios
        results["ratios_cpu_time"] = {
            key: best_cpu[key.split("_vs_")[0]] / best_cpu[key.split("_vs_")[1]] for key in ratios}
        results["ratios_cpu_time_paired"] = paired_ratios(ratios, cpu_rates)
    return results


def _ratios(best: dict[str, float], best_cpu: dict[str, float]) -> dict[str, float]:
    """The reported ratios of best medians; adds the "_best" entries to both dicts."""
    ratios = {}
    for ours in ("tputrain", "tputrain_no_xla", "tputrain_fit"):
        if ours in best:
            ratios.update({f"{ours}_vs_{n}": best[ours] / v for n, v in best.items()
                           if not n.startswith("tputrain")})
    if "tputrain" in best and "tputrain_no_xla" in best:
        ratios["tputrain_vs_tputrain_no_xla"] = best["tputrain"] / best["tputrain_no_xla"]
    if "tputrain_bf16" in best and "tputrain" in best:
        ratios["tputrain_bf16_vs_tputrain"] = best["tputrain_bf16"] / best["tputrain"]
    for on, off in (("tputrain", "tputrain_no_guard"), ("tputrain_no_xla", "tputrain_no_xla_no_guard"),
                    ("tputrain", "tputrain_program_1"), ("tputrain_program_10", "tputrain"),
                    ("tputrain", "tputrain_xla"),
                    ("tputrain_xla", "tputrain_xla_keras_draws"),
                    ("tputrain", "tputrain_xla_keras_draws"),
                    ("tputrain_xla", "tputrain_no_xla")):
        if on in best and off in best:
            ratios[f"{on}_vs_{off}"] = best[on] / best[off]
    # Each framework at its best configuration (XLA on or off, with or without a strategy).
    if "tputrain" in best:  # the defaults only
        best["tputrain_best"], best_cpu["tputrain_best"] = best["tputrain"], best_cpu["tputrain"]
    for peer, configurations in BEST_OF.items():
        runs = [n for n in configurations if n in best]
        if ("tputrain" in best or "tputrain_fit" in best) and runs:  # the best by CPU time
            chosen = max(runs, key=lambda n: best_cpu[n])
            best[peer], best_cpu[peer] = best[chosen], best_cpu[chosen]
            if "tputrain" in best:
                ours = "tputrain_best" if peer == "keras_fit_best" else "tputrain"
                ratios[f"{ours}_vs_{peer}"] = best[ours] / best[peer]
            if "tputrain_fit" in best and peer == "keras_fit_best":
                ratios[f"tputrain_fit_vs_{peer}"] = best["tputrain_fit"] / best[peer]
    return ratios


def paired_ratios(keys, cpu_rates: dict[tuple[str, int], list[float]]) -> dict[str, float]:
    """Each ratio as the median over rounds of (ours / theirs) within the round, both at
    their best steps per call (by median): a slow spell of the machine hits the two
    measurements of one round alike, so this is steadier than a ratio of medians."""
    best_k = {}
    for (name, k), values in cpu_rates.items():
        if name not in best_k or statistics.median(values) > statistics.median(
                cpu_rates[(name, best_k[name])]):
            best_k[name] = k
    paired = {}
    for key in keys:
        ours, theirs = key.split("_vs_")
        if theirs in BEST_OF:  # the peer's best configuration, by median
            theirs = max((n for n in BEST_OF[theirs] if n in best_k),
                         key=lambda n: statistics.median(cpu_rates[(n, best_k[n])]))
        ours = "tputrain" if ours == "tputrain_best" else ours
        if ours in best_k and theirs in best_k:
            pairs = zip(cpu_rates[(ours, best_k[ours])], cpu_rates[(theirs, best_k[theirs])])
            paired[key] = statistics.median(a / b for a, b in pairs)
    return paired


def add_mfu(result: dict[str, Any], peak: tuple[float, float], peak_name: str,
            contender: str = "tputrain") -> None:
    """MFU of the tputrain Trainer: wall clock against the wall-clock peak, and CPU time
    (FLOPs per CPU-second of training over FLOPs per CPU-second of the best matmul)."""
    ours = result.get(contender, {})
    if "flops_per_step" in result and "steps_per_second" in ours:
        flops = result["flops_per_step"]
        result["mfu" if contender == "tputrain" else f"mfu_{contender}"] = {
            "value": flops * ours["steps_per_second"] / peak[0],
            "value_cpu_time": flops * ours["steps_per_cpu_second"] / peak[1],
            "against": f"measured {peak_name} matmul peak {peak[0] / 1e9:.0f} GFLOP/s, "
                       f"{peak[1] / 1e9:.0f} GFLOP per CPU-second (best probes of this run)"}


def add_peaks(report: dict[str, Any], workloads: dict[str, Any],
              peaks: dict[str, list[tuple[float, float]]]) -> None:
    """The matmul peaks probed between rounds, and the MFUs measured against them."""
    peak = {dtype: (max(v[0] for v in values), max(v[1] for v in values))
            for dtype, values in peaks.items()}
    report["matmul_peak_gflops"] = {
        d: {"best": peak[d][0] / 1e9, "median": statistics.median(v[0] for v in values) / 1e9,
            "best_per_cpu_second": peak[d][1] / 1e9} for d, values in peaks.items()}
    if "transformer" in workloads:
        add_mfu(workloads["transformer"], peak["float32"], "float32")
        add_mfu(workloads["transformer"], peak["bfloat16"], "bfloat16", "tputrain_bf16")
    if "mlp" in workloads:
        add_mfu(workloads["mlp"], peak["float32"], "float32")


def add_goals(report: dict[str, Any], workloads: dict[str, Any]) -> None:
    """The bf16 speed-up and every goal of issue 12, measured against its target."""
    lm_result = workloads.get("transformer", {})
    fp32, bf16 = lm_result.get("tputrain", {}), lm_result.get("tputrain_bf16", {})
    if "steps_per_second" in fp32 and "steps_per_second" in bf16:
        report["bf16_vs_float32"] = {
            "transformer_step_ms_float32": 1000 / fp32["steps_per_second"],
            "transformer_step_ms_bfloat16": 1000 / bf16["steps_per_second"],
            "speedup": bf16["steps_per_second"] / fp32["steps_per_second"],
            "speedup_cpu_time": bf16["steps_per_cpu_second"] / fp32["steps_per_cpu_second"],
            "note": "tputrain Trainer with its defaults, float32 and mixed_bfloat16 measured "
                    "interleaved (jit_compile='auto': in float32 the whole step under XLA; "
                    "in bf16 on CPU the matmuls on oneDNN and only the optimizer update and "
                    "the GELUs under XLA)"}
        no_xla = lm_result.get("tputrain_no_xla", {})
        if "steps_per_second" in no_xla:
            report["bf16_vs_float32"].update({
                "speedup_vs_float32_without_xla": bf16["steps_per_second"] / no_xla["steps_per_second"],
                "speedup_vs_float32_without_xla_cpu_time":
                    bf16["steps_per_cpu_second"] / no_xla["steps_per_cpu_second"]})
    # tputrain with its defaults against each peer at its best (XLA allowed on both sides).
    goals = {"tputrain_vs_hand_loop": 0.99, "tputrain_vs_hand_loop_best": 0.99,
             "tputrain_best_vs_keras_fit_best": 1.0, "tputrain_fit_vs_keras_fit_best": 1.0,
             "tputrain_vs_orbit": 1.0, "tputrain_vs_tputrain_no_guard": 0.99,
             "tputrain_no_xla_vs_tputrain_no_xla_no_guard": 0.99}
    report["goals"] = {
        f"{w}.{k}": {"measured": workloads[w]["ratios"][k], "goal": g,
                     "met": workloads[w]["ratios"][k] >= g,
                     "measured_cpu_time": workloads[w]["ratios_cpu_time"][k],
                     "measured_cpu_time_paired": workloads[w]["ratios_cpu_time_paired"].get(k)}
        for w in workloads for k, g in goals.items()
        if k in workloads[w].get("ratios", {})}
    if "steps_per_loop_50_vs_1" in report:
        report["goals"]["steps_per_loop_50_vs_1"] = {
            "measured": report["steps_per_loop_50_vs_1"]["ratio"], "goal": 2.0,
            "met": report["steps_per_loop_50_vs_1"]["ratio"] >= 2.0}
    if "bf16_vs_float32" in report:
        bf16_report = report["bf16_vs_float32"]
        report["goals"]["transformer.bf16_vs_float32"] = {
            "measured": bf16_report["speedup"], "goal": 1.5, "met": bf16_report["speedup"] >= 1.5,
            "measured_cpu_time": bf16_report["speedup_cpu_time"],
            "measured_cpu_time_paired": lm_result["ratios_cpu_time_paired"].get(
                "tputrain_bf16_vs_tputrain")}
    for key, label in (("mfu", "transformer.mfu_float32"), ("mfu_tputrain_bf16", "transformer.mfu_bfloat16")):
        if key in lm_result:
            report["goals"][label] = {
                "measured": lm_result[key]["value"], "goal": 0.5,
                "met": lm_result[key]["value"] >= 0.5,
                "measured_cpu_time": lm_result[key]["value_cpu_time"]}


# Environment variables that make TensorFlow run as on a lesser CPU (an AVX2-only one
# emulated on an AVX-512 machine): oneDNN off, oneDNN's and XLA's instruction sets capped.
ISA_LIMITS = ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA", "XLA_FLAGS")


def isa_limits() -> dict[str, str]:
    """{"emulation": the limiting variables as set} when any is set, else {}: a run
    under them is named as an emulation in its JSON (`docs/performance.md`'s grid)."""
    found = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)]
    return {"emulation": " ".join(found)} if found else {}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--workloads", default="mlp,transformer,small_mlp",
                        help="comma-separated subset of mlp,transformer,conv,small_mlp,mlp_dropout,"
                             "mlp_noise,mlp_augment,"
                             f"{','.join(APPLICATIONS)} (default: mlp,transformer,small_mlp)")
    parser.add_argument("--precision", default="float32",
                        choices=["float32", "mixed_bfloat16"],
                        help="every contender's Keras policy (the workloads but small_mlp)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="split the CPU into this many logical devices (split_cpu), so "
                             "the strategy mirrors over them (the _no_strategy peers skip)")
    parser.add_argument("--fresh", action="store_true",
                        help="a new process for every contender in every round")
    parser.add_argument("--contenders", default="",
                        help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    parser.add_argument("--first_steps", type=int, default=0,
                        help="the tputrain contenders' first (untimed) call trains this many "
                             "steps, not k: long enough for jit_compile='auto''s plan trial")
    result_file.add_arguments(parser, "train_loop")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    os.environ[FIRST_STEPS] = str(args.first_steps)  # the spawned contenders read it
    logging.set_verbosity(logging.WARNING)
    quick = args.quick
    repeats = args.repeats or (1 if quick else 5)
    if args.replicas:
        tputrain.split_cpu(args.replicas)
    strategy = tputrain.resolve_strategy()
    started = time.time()
    load_before = os.getloadavg()
    peaks: dict[str, list[tuple[float, float]]] = {"float32": [], "bfloat16": []}
    # Every contender; the bf16 one is added to the Transformer workload only.
    # Keras's draws in XLA (for `mlp_dropout`) and `tputrain.fit` only when named (`--contenders`).
    all_kinds = [kind for kind in CONTENDERS.values() if kind is not TputrainBF16Contender
                 and (kind not in (TputrainXLAKerasDrawsContender, TputrainFitContender,
                                   TputrainTenStepsAProgramContender) or args.contenders)]

    report: dict[str, Any] = {
        "command": " ".join(["python benchmarks/train_loop.py", *sys.argv[1:]]),
        "machine": {"cpu": cpu_name(), "cpu_flags": cpu_kind(), "cores": os.cpu_count(),
                    "onednn": onednn_enabled(), **isa_limits(),
                    "strategy": type(strategy).__name__,
                    "replicas": strategy.num_replicas_in_sync, "tensorflow": tf.__version__,
                    "keras": keras.__version__, "load_average_before": load_before},
        "method": "each contender in a process of its own (spawned; it builds its model "
                  "there for every steps-per-call setting), measured in turn: steps/s from "
                  "the end of each call's first loop to the end of its last; medians over "
                  "interleaved rounds; best steps_per_loop / steps_per_execution per "
                  "contender. steps_per_cpu_second and ratios_cpu_time divide by the "
                  "contender process's CPU time instead of wall time: less sensitive to "
                  "other jobs on a shared machine. Compare ratios within one run.",
    }
    chosen = set(args.contenders.split(",")) if args.contenders else set(CONTENDERS)
    kinds = [kind for kind in all_kinds if kind.name in chosen]
    workloads: dict[str, Any] = {}
    for name in args.workloads.split(","):
        if name == "small_mlp":
            continue
        extra = [TputrainBF16Contender] if name == "transformer" and (
            TputrainBF16Contender.name in chosen) else []
        workloads[name] = run_workload(name, quick, args.precision, kinds + extra, repeats,
                                       peaks, fresh=args.fresh, replicas=args.replicas)
        workloads[name]["model"] = workload(name, quick).model
    if "small_mlp" in args.workloads.split(","):
        loop_sizes = run_workload("small_mlp", quick, "float32", [TputrainContender],
                                  repeats, peaks, fresh=args.fresh, replicas=args.replicas)
        by_k = loop_sizes["tputrain"]["by_steps_per_call"]
        report["steps_per_loop_50_vs_1"] = {
            "model": workload("small_mlp", quick).model,
            "steps_per_second": {k: v["median"] for k, v in by_k.items()},
            "ratio": by_k["50"]["median"] / by_k["1"]["median"], "goal": 2.0}

    add_peaks(report, workloads, peaks)
    report["workloads"] = workloads
    add_goals(report, workloads)
    report["machine"]["load_average_after"] = os.getloadavg()
    report["seconds"] = time.time() - started
    result_file.write(report, args.out, "train_loop", args.tag, quick)


if __name__ == "__main__":
    main()
