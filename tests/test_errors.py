"""Every bad input gets one line that names the fix, and nothing is written to model_dir first.

One test per bad input of the fault-tolerance issue: gin typo, unknown configurable,
missing binding, no files match, corrupt TFRecord, dynamic shapes, indivisible
global batch, unwritable or full model_dir, a checkpoint of a different model.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tputrain
from faults import FaultTask, RecordsTask, write_records
from tputrain.checkpoint import CheckpointMismatchError
from tputrain.config.parsing import ConfigError, parse_gin, require_bound
from tiny import TinyTask, strategy_for

SUPPORT = Path(__file__).resolve().parent / "support"


def make_trainer(model_dir, task=None, replicas=1, **kwargs):
    options = dict(train_steps=2, steps_per_loop=2, global_batch_size=16, checkpoint_every=2,
                   eval_steps=1)
    options.update(kwargs)
    return tputrain.Trainer(task or TinyTask(), str(model_dir), strategy=strategy_for(replicas),
                            **options)


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text.split("\n  In call to configurable")[0], text
    return text


# ------------------------------------------------------------------- gin


def test_gin_typo_in_a_parameter_suggests_the_name():
    with pytest.raises(ConfigError) as caught:
        parse_gin(gin_params=["Trainer.train_step = 5"])
    assert "did you mean 'train_steps'" in one_line(caught.value)


def test_unknown_configurable_suggests_the_name():
    with pytest.raises(ConfigError) as caught:
        parse_gin(gin_params=["Traner.train_steps = 5"])
    assert "did you mean 'Trainer'" in one_line(caught.value)


def test_missing_required_binding_says_what_to_add():
    parse_gin(gin_params=["Trainer.train_steps = 5"])
    with pytest.raises(ConfigError) as caught:
        require_bound("Trainer.task")
    assert "add `Trainer.task = ...`" in one_line(caught.value)


# ---------------------------------------------------------------- inputs


def test_no_files_match_names_the_pattern(tmp_path):
    model_dir = tmp_path / "model"
    with pytest.raises(FileNotFoundError) as caught:
        make_trainer(model_dir, RecordsTask(str(tmp_path / "nothing-*.tfrecord")))
    assert "nothing-*.tfrecord" in one_line(caught.value)
    assert "check the path" in str(caught.value)
    assert not model_dir.exists()


def test_corrupt_tfrecord_names_the_file_before_training(tmp_path):
    files = write_records(tmp_path / "data")
    data = Path(files[1]).read_bytes()
    Path(files[1]).write_bytes(data[:20] + b"\xff" * 40 + data[60:])  # garbage in record 0
    model_dir = tmp_path / "model"
    with pytest.raises(OSError) as caught:
        make_trainer(model_dir, RecordsTask(str(tmp_path / "data" / "train-*.tfrecord")))
    message = one_line(caught.value)
    assert os.path.basename(files[1]) in message
    assert "rewrite the file" in message or "rewrite it" in message
    assert not model_dir.exists()


def test_a_missing_eval_pattern_fails_before_training(tmp_path):
    """Issue 10.4: it was found only at the first eval, after the whole training run."""
    write_records(tmp_path / "data")
    model_dir = tmp_path / "model"
    with pytest.raises(FileNotFoundError) as caught:
        make_trainer(model_dir, RecordsTask(str(tmp_path / "data" / "train-*.tfrecord"),
                                            str(tmp_path / "data" / "eval-*.tfrecord")))
    assert "eval-*.tfrecord" in one_line(caught.value)
    assert not model_dir.exists()


@pytest.mark.parametrize("value, error, words", [
    ("abc", TypeError, "Trainer.train_steps must be an int, got 'abc'"),
    (250.9, TypeError, "Trainer.train_steps must be an int, got 250.9"),
    (0, ValueError, "Trainer.train_steps must be >= 1, got 0"),
])
def test_a_bad_step_count_names_the_parameter(tmp_path, value, error, words):
    """Issue 10.4: 'abc' said "invalid literal for int()"; 250.9 was truncated to 250."""
    with pytest.raises(error) as caught:
        make_trainer(tmp_path / "model", train_steps=value)
    assert words in one_line(caught.value)
    assert not (tmp_path / "model").exists()


def test_dynamic_shapes_say_to_batch_with_drop_remainder(tmp_path):
    class Ragged(TinyTask):
        def build_inputs(self, split, input_context):
            return super().build_inputs(split, input_context).unbatch().batch(16)

    model_dir = tmp_path / "model"
    with pytest.raises(ValueError) as caught:
        make_trainer(model_dir, Ragged())
    assert "drop_remainder=True" in one_line(caught.value)
    assert not model_dir.exists()


def test_indivisible_global_batch_says_which_multiple(tmp_path):
    model_dir = tmp_path / "model"
    with pytest.raises(ValueError) as caught:
        make_trainer(model_dir, replicas=4, global_batch_size=18)
    assert "use a multiple of 4" in one_line(caught.value)
    assert not model_dir.exists()


class RepeatedEval(TinyTask):
    """Both splits repeat forever, as a user's first `build_inputs` often does."""

    def build_inputs(self, split, input_context):
        return super().build_inputs(split, input_context).repeat()


def test_an_eval_split_that_repeats_forever_needs_eval_steps(tmp_path):
    # Before: training ran, saved its final checkpoint, then counted the endless
    # eval split for ever (a hang at 100% CPU that ignored SIGTERM).
    model_dir = tmp_path / "model"
    with pytest.raises(ValueError) as caught:
        make_trainer(model_dir, RepeatedEval(), eval_steps=None)
    message = one_line(caught.value)
    assert "eval split repeats forever" in message and "eval_steps" in message
    assert not model_dir.exists()
    logs = make_trainer(model_dir, RepeatedEval(), eval_steps=3).train()
    assert 0.0 <= logs["accuracy"] <= 1.0


# ------------------------------------------------------------- model_dir

_MODEL_DIR_SCRIPT = """
import sys
import tputrain
from faults import FaultTask
from tiny import strategy_for

for model_dir, task in ((sys.argv[1], FaultTask(dropout=0.0)),
                        (sys.argv[2], FaultTask(dropout=0.0)),
                        (sys.argv[3], FaultTask(dropout=0.0, ballast_floats=600_000))):
    try:
        tputrain.Trainer(task, model_dir, strategy=strategy_for(1), train_steps=2,
                         global_batch_size=16)
        print("NO ERROR", model_dir)
    except OSError as error:
        print(type(error).__name__, str(error).replace("\\n", " "))
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for private mounts")
def test_unwritable_and_full_model_dir_are_named_before_training(tmp_path):
    """Real filesystems in a private mount namespace: a read-only one, a full one, and
    one with 1 MiB free for a model whose checkpoint needs ~2.4 MiB."""
    ro, full, small = tmp_path / "ro", tmp_path / "full", tmp_path / "small"
    for directory in (ro, full, small):
        directory.mkdir()
    script = tmp_path / "check.py"
    script.write_text(_MODEL_DIR_SCRIPT)
    shell = textwrap.dedent(f"""
        set -e
        mount -t tmpfs -o ro,size=1m tmpfs {ro}
        mount -t tmpfs -o size=64k tmpfs {full}
        dd if=/dev/zero of={full}/fill bs=4k 2>/dev/null || true
        mount -t tmpfs -o size=1m tmpfs {small}
        exec {sys.executable} {script} {ro}/model {full}/model {small}/model
        """)
    env = dict(os.environ, PYTHONPATH=str(SUPPORT), TF_CPP_MIN_LOG_LEVEL="2")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not permitted here: {probe.stderr.decode().strip()}")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True,
                            text=True, env=env, timeout=240)
    lines = [l for l in result.stdout.splitlines() if l.startswith(("ModelDirError", "NO ERROR"))]
    assert result.returncode == 0 and len(lines) == 3, result.stdout + result.stderr[-3000:]
    unwritable, full_disk, too_small = lines
    assert unwritable.startswith("ModelDirError") and "is not writable" in unwritable
    assert "choose a writable --model_dir" in unwritable
    for line in (full_disk, too_small):
        assert line.startswith("ModelDirError") and "free some space" in line, line
    assert "MiB free but a checkpoint needs" in too_small
    # The mounts were private to the child: here the directories are empty.
    assert not any(p.name == "model" for d in (ro, full, small) for p in d.iterdir())


_ROOM_SCRIPT = """
import sys
import tputrain
from faults import FaultTask
from tiny import strategy_for


class Shuffled(FaultTask):
    # A 30000-example shuffle buffer: ~1.2 MiB of iterator state in every checkpoint.
    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split != "train":
            return dataset
        return dataset.unbatch().shuffle(30000, seed=1).batch(8, drop_remainder=True)


for model_dir in sys.argv[1:]:
    try:
        trainer = tputrain.Trainer(Shuffled(dropout=0.0, ballast_floats=100_000), model_dir,
                                   strategy=strategy_for(1), train_steps=6, steps_per_loop=2,
                                   checkpoint_every=2, global_batch_size=8, eval_steps=1)
        trainer.train()
        print("NO ERROR", model_dir)
    except OSError as error:
        print(type(error).__name__, str(error).replace("\\n", " "))
"""


@pytest.mark.start_early(5)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for private mounts")
def test_room_counts_the_iterator_and_keep_plus_one_and_checkpoints_must_be_writable(tmp_path):
    """Issue 10.5 on real mounts: a 2 MiB disk passed the old estimate (2 x 0.4 MiB of
    variables, no iterator state) and died at a save; a read-only `checkpoints/` inside
    a writable model_dir passed pre-flight and failed at the first save."""
    small, ro_model = tmp_path / "small", tmp_path / "romodel"
    small.mkdir()
    (ro_model / "checkpoints").mkdir(parents=True)
    script = tmp_path / "room.py"
    script.write_text(_ROOM_SCRIPT)
    shell = textwrap.dedent(f"""
        set -e
        mount -t tmpfs -o size=2m tmpfs {small}
        mount -t tmpfs -o ro,size=1m tmpfs {ro_model}/checkpoints
        exec {sys.executable} {script} {small}/model {ro_model}
        """)
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not permitted here: {probe.stderr.decode().strip()}")
    env = dict(os.environ, PYTHONPATH=str(SUPPORT), TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True,
                            text=True, env=env, timeout=240)
    lines = [l for l in result.stdout.splitlines() if l.startswith(("ModelDirError", "NO ERROR"))]
    assert result.returncode == 0 and len(lines) == 2, result.stdout + result.stderr[-3000:]
    too_small, read_only = lines
    assert too_small.startswith("ModelDirError") and "plus the one being written" in too_small
    assert "keep_checkpoints=3" in too_small
    assert read_only.startswith("ModelDirError") and "checkpoints is not writable" in read_only
    assert not list(ro_model.rglob("ckpt-*"))


def test_model_dir_that_is_a_file_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError) as caught:
        make_trainer(blocker)
    assert "is a file, not a directory" in one_line(caught.value)
    assert blocker.read_text() == "not a directory"


def test_model_dir_inside_a_file_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="choose another --model_dir"):
        make_trainer(blocker / "model")


# ------------------------------------------------------------ checkpoint


def test_checkpoint_of_a_different_model_names_the_variables(tmp_path):
    model_dir = tmp_path / "model"
    make_trainer(model_dir, FaultTask(dropout=0.0, hidden=16)).train()
    before = {p: p.stat().st_mtime_ns for p in model_dir.rglob("*")}
    with pytest.raises(CheckpointMismatchError) as caught:
        make_trainer(model_dir, FaultTask(dropout=0.0, hidden=32))
    message = one_line(caught.value)
    assert "checkpoint has shape [8, 16], this model [8, 32]" in message
    assert "kernel" in message
    assert "Use a new model_dir" in message
    assert {p: p.stat().st_mtime_ns for p in model_dir.rglob("*")} == before


def test_checkpoint_with_fewer_layers_is_a_mismatch_not_a_partial_load(tmp_path):
    """Keras 3 keys variables by position: a smaller model would silently load a prefix."""
    model_dir = tmp_path / "model"
    make_trainer(model_dir, FaultTask(dropout=0.0, ballast_floats=4)).train()
    with pytest.raises(CheckpointMismatchError, match="is in the checkpoint but not in this model"):
        make_trainer(model_dir, FaultTask(dropout=0.0))


# ------------------------------------------------- issue 33.6: inputs that crash, hang or guess


def test_a_pattern_matching_only_an_empty_shard_fails_before_training(tmp_path):
    """Pre-flight read no batch and accepted it; training then ended in StopIteration."""
    (tmp_path / "empty-00000-of-00001.tfrecord").write_bytes(b"")
    model_dir = tmp_path / "model"
    with pytest.raises(ValueError) as caught:
        make_trainer(model_dir, RecordsTask(str(tmp_path / "empty-*.tfrecord")))
    assert "yields no batch" in one_line(caught.value) and "0-byte" in str(caught.value)
    assert not model_dir.exists()


def test_a_pattern_that_is_a_folder_is_named(tmp_path):
    """TensorFlow's traceback from reading a folder as a TFRecord file."""
    write_records(tmp_path / "data")
    with pytest.raises(IsADirectoryError) as caught:
        make_trainer(tmp_path / "model", RecordsTask(str(tmp_path / "data")))
    assert "matches only folders" in one_line(caught.value) and "*.tfrecord" in str(caught.value)


def test_a_manifest_that_is_a_folder_is_named(tmp_path):
    """TensorFlow's traceback from reading a folder as the manifest's JSON."""
    (tmp_path / "train.manifest.json").mkdir()
    with pytest.raises(IsADirectoryError) as caught:
        tputrain.data.TFRecordInput(manifest=str(tmp_path / "train.manifest.json"))
    assert "is a folder" in one_line(caught.value)


def test_a_global_batch_larger_than_the_data_is_refused_by_its_manifest(tmp_path):
    """A batch of 2e7 digits read the repeated data into one batch (3 GB) and never
    returned; the manifest knows there are 64 examples."""
    write_records(tmp_path / "data")
    model_dir = tmp_path / "model"
    with pytest.raises(ValueError) as caught:
        make_trainer(model_dir, RecordsTask(str(tmp_path / "data" / "train-*.tfrecord")),
                     global_batch_size=20_000_000)
    message = one_line(caught.value)
    assert "larger than the 64 examples" in message and "at most 64" in message
    assert not model_dir.exists()


@pytest.mark.parametrize("rate", [-1.0, -1, float("nan")])
def test_a_negative_learning_rate_is_refused(rate):
    """-1.0 trained by gradient ascent to exit 0; -1 said only "should be float"."""
    with pytest.raises(ValueError) as caught:
        tputrain.build_optimizer(learning_rate=rate)
    assert f"learning_rate={rate}" in one_line(caught.value)
    assert "positive float" in str(caught.value)
    assert tputrain.build_optimizer(learning_rate=1).learning_rate.numpy() == 1.0  # an int


class GeneratorTask(TinyTask):
    """A train split read from a Python generator (`Dataset.from_generator`)."""

    def build_inputs(self, split, input_context):
        import tensorflow as tf
        x, y = self.x, self.y
        dataset = tf.data.Dataset.from_generator(
            lambda: zip(x, y), output_signature=(tf.TensorSpec([8], tf.float32),
                                                 tf.TensorSpec([], tf.int64)))
        batch = input_context.get_per_replica_batch_size(input_context.global_batch_size)
        dataset = dataset.map(lambda a, b: ({"x": a}, b))
        return (dataset.repeat() if split == "train" else dataset).batch(batch, drop_remainder=True)


def test_a_generator_input_that_cannot_be_checkpointed_is_named_before_training(tmp_path):
    """Exact resume checkpoints the host iterator; a from_generator pipeline cannot be:
    one error naming the cause and the ways out, not TensorFlow's traceback."""
    with pytest.raises(tputrain.data.InputStateError,
                       match=r"GeneratorDataset.*from_generator.*from_tensor_slices.*distributed"):
        tputrain.Trainer(GeneratorTask(), str(tmp_path / "gen"), strategy=strategy_for(1),
                         train_steps=2, global_batch_size=16, eval_steps=1)
    assert not os.path.exists(tmp_path / "gen" / "checkpoints")


def _generator_data(examples: int = 64):
    import tensorflow as tf
    rng = np.random.RandomState(0)
    x, y = rng.randn(examples, 8).astype(np.float32), rng.randint(0, 2, examples)
    signature = (tf.TensorSpec([8], tf.float32), tf.TensorSpec([], tf.int64))
    return tf.data.Dataset.from_generator(lambda: zip(x, y), output_signature=signature
                                          ).repeat().batch(16), (x, y)


def _keras_model():
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_keras_models_generator_input_is_named_before_training_too(tmp_path):
    """`tputrain.fit` reads the user's dataset only to train (no probe): the same
    pipeline trained every step and then failed at the first save, telling the user to
    free disk space. It is named before training, with the ways out, and the way out
    it names (input_mode="distributed": a resume re-reads the data) trains, saves and
    resumes bitwise."""
    model = _keras_model()
    before = model.get_weights()
    train, evaluation = _generator_data()
    with pytest.raises(tputrain.data.InputStateError,
                       match=r"GeneratorDataset.*from_generator.*from_tensor_slices.*distributed"):
        tputrain.fit(model, train, evaluation, model_dir=str(tmp_path / "gen"), steps=20,
                     strategy=strategy_for(1), report_mfu=False)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert not os.path.exists(tmp_path / "gen" / "checkpoints")

    def trained(name, *steps):
        model = _keras_model()
        for total in steps:
            tputrain.fit(model, _generator_data()[0], evaluation, model_dir=str(tmp_path / name),
                         steps=total, steps_per_loop=5, strategy=strategy_for(1),
                         report_mfu=False, input_mode="distributed")
        return model.get_weights()

    resumed, straight = trained("resumed", 10, 20), trained("straight", 20)
    assert all(np.array_equal(a, b) for a, b in zip(resumed, straight))


# ------------------------------------------------------------ issue 50.6: tracebacks


def test_an_unknown_eval_split_is_one_line_listing_the_tasks_splits(tmp_path):
    """Issue 50.6: an eval set the Task has no data for was a KeyError (48 lines)."""
    from tputrain.tasks import DigitsTask

    model_dir = tmp_path / "model"
    with pytest.raises(ValueError) as caught:  # a task that lists its splits
        make_trainer(model_dir, DigitsTask(), eval_splits=("validation",))
    text = one_line(caught.value)
    assert "'validation'" in text and "('train', 'eval')" in text and "eval_splits" in text
    files = write_records(tmp_path / "data")
    with pytest.raises(ValueError) as caught:  # one whose build_inputs raises KeyError
        make_trainer(model_dir, RecordsTask(files[0]), eval_splits=("eval", "validation"))
    text = one_line(caught.value)
    assert "'validation'" in text and "RecordsTask" in text and "eval_splits" in text
    assert not model_dir.exists()


class NarrowEvalTask(TinyTask):
    """Its eval features have 6 columns where the train features (and model) have 8."""

    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split == "train":
            return dataset
        return dataset.map(lambda features, labels: ({"x": features["x"][:, :6]}, labels))


def test_eval_features_of_another_shape_are_one_line_before_anything_is_written(tmp_path):
    """Issue 50.6: eval features shaped unlike the model's inputs failed at the first
    evaluation with a 102-line Keras traceback, after training had begun."""
    model_dir = tmp_path / "model"
    with pytest.raises(ValueError) as caught:
        make_trainer(model_dir, NarrowEvalTask(), eval_every=2)
    text = one_line(caught.value)
    assert "'x'" in text and "eval" in text and "(6,)" in text and "(8,)" in text, text
    assert not model_dir.exists()


def test_training_on_a_truncated_only_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    """Issue 50.6: the good message came inside a 33-line traceback (eval, export and
    predict already said it in one line)."""
    from tputrain.cli.run import _train

    model_dir = tmp_path / "model"
    make_trainer(model_dir).train()
    (data,) = (model_dir / "checkpoints").glob("ckpt-2.data-*")
    data.write_bytes(data.read_bytes()[:len(data.read_bytes()) // 2])
    capsys.readouterr()
    with pytest.raises(SystemExit) as caught:
        _train(make_trainer(model_dir, train_steps=4))
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.startswith("tputrain: error:")]
    assert caught.value.code == 2 and len(lines) == 1 and "Traceback" not in error, error
    assert "ckpt-2" in lines[0], error


_FINISHED_SCRIPT = """
import os, shutil, sys
import tputrain
from faults import FaultTask
from tiny import strategy_for

model_dir = sys.argv[1]


def trainer():
    return tputrain.Trainer(FaultTask(dropout=0.0, ballast_floats=100_000), model_dir,
                            strategy=strategy_for(1), train_steps=4, steps_per_loop=2,
                            checkpoint_every=2, global_batch_size=8, eval_steps=1,
                            actions=[tputrain.Export()])


trainer().train()
filler = os.path.join(os.path.dirname(model_dir), "filler")  # someone else's file
with open(filler, "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"\\\\0" * 4096)
    except OSError:
        pass
os.truncate(filler, os.path.getsize(filler) - 128 * 1024)  # 128 KiB left: not a checkpoint
print("FREE", shutil.disk_usage(model_dir).free, flush=True)
try:
    rerun = trainer()
    rerun.train()
    print("RERUN DONE", int(rerun.step.numpy()), flush=True)
except OSError as error:
    print("RERUN", type(error).__name__, str(error).splitlines()[0], flush=True)
"""


@pytest.mark.start_early(2)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for private mounts")
def test_a_finished_run_rerun_on_a_nearly_full_disk_has_nothing_to_train(tmp_path):
    """Issue 50.7 on a real tmpfs: a scheduler's retry of a finished, exported job on a
    disk with less room than a checkpoint failed pre-flight ("model_dir is full",
    exit 2); it has nothing to train or save, so it says so and ends."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "finished.py"
    script.write_text(_FINISHED_SCRIPT)
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm is not permitted here: {probe.stderr.decode().strip()}")
    shell = f"mount -t tmpfs -o size=16m tmpfs {disk} && exec {sys.executable} {script} {disk}/model"
    path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True,
                            text=True, env=env, timeout=240)
    text = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0 and "FREE" in result.stdout, text
    assert "RERUN DONE 4" in result.stdout, text
    assert "nothing to train" in result.stderr, text
