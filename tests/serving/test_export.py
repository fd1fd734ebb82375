"""Export: a checkpoint becomes a SavedModel that a fresh process serves, with float32
outputs whatever the training precision, from the best checkpoint when one is kept."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.serving.export import feature_spec_of, signature_inputs
from tputrain.jobs.sidecar import ReadOnlyTrainer, evaluate_checkpoints


class SpecTask(TinyTask):
    """TinyTask with a tf.Example feature spec (gets the serving_examples signature)."""

    feature_spec = {"x": ([8], "float32"), "label": ([], "int64")}


class Bfloat16OutputTask(TinyTask):
    """Its last layer computes in the policy's dtype: bfloat16 outputs under mixed_bfloat16."""

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        return keras.Model({"x": inputs}, keras.layers.Dense(2)(hidden))


def make(task, model_dir, actions=(), **kwargs):
    options = dict(train_steps=8, steps_per_loop=2, global_batch_size=16, eval_every=2,
                   eval_steps=2, checkpoint_every=4, report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(task, str(model_dir), strategy=strategy_for(1), actions=actions,
                            **options)


def serialized(x: np.ndarray) -> tf.Tensor:
    return tf.constant([tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=row))})).SerializeToString()
        for row in x])


def test_export_action_writes_the_best_checkpoint_with_both_signatures(tmp_path):
    best, export = tputrain.BestCheckpoint("loss", "min"), tputrain.Export()
    trainer = make(SpecTask(), tmp_path / "run", [best, export])
    trainer.train()
    assert export.path == str(tmp_path / "run" / "export" / str(best.step))
    loaded = tf.saved_model.load(export.path)
    assert sorted(loaded.signatures) == ["serving_default", "serving_examples"]
    x = trainer.task.x[:32]
    outputs = loaded.signatures["serving_default"](x=tf.constant(x))["outputs"]
    from_examples = loaded.signatures["serving_examples"](examples=serialized(x))["outputs"]
    np.testing.assert_allclose(from_examples, outputs, rtol=1e-6)
    # The weights of the best checkpoint, not of the last step.
    tf.train.Checkpoint(model=trainer.model).read(
        str(tmp_path / "run" / "best" / f"ckpt-{best.step}")).expect_partial()
    np.testing.assert_allclose(outputs, trainer.model({"x": x}), rtol=1e-5, atol=1e-6)


class BestSteps(tputrain.Action):
    """Records the BestCheckpoint's step after each eval (listed after it)."""

    def __init__(self, best):
        self.best, self.steps = best, []

    def on_eval_end(self, trainer, step, logs):
        if self.best.step == step:
            self.steps.append(step)


def test_export_every_best_writes_a_version_per_new_best(tmp_path):
    """Export(every_best=True): one SavedModel per eval that set a new best, named by its
    step (a server watching export/ picks up each), and no second export at the end."""
    best = tputrain.BestCheckpoint("loss", "min")
    recorder, export = BestSteps(best), tputrain.Export(every_best=True)
    trainer = make(SpecTask(), tmp_path / "run", [best, recorder, export])
    trainer.train()
    assert len(recorder.steps) >= 2  # loss fell at more than one eval
    exported = sorted(int(p.name) for p in (tmp_path / "run" / "export").iterdir())
    assert exported == recorder.steps
    assert export.path == str(tmp_path / "run" / "export" / str(best.step))
    with pytest.raises(ValueError, match="needs a BestCheckpoint action listed before it"):
        make(SpecTask(), tmp_path / "other", [tputrain.Export(every_best=True), best]).train()


def test_mixed_bfloat16_exports_float32_outputs_of_any_step(tmp_path, monkeypatch):
    trainer = make(Bfloat16OutputTask(), tmp_path / "run", precision="mixed_bfloat16")
    trainer.train()
    x = trainer.task.x[:32]
    assert trainer.model({"x": x}).dtype == tf.bfloat16
    path = tputrain.export_checkpoint(trainer, step=4)
    assert path == str(tmp_path / "run" / "export" / "4")
    loaded = tf.saved_model.load(path)
    assert list(loaded.signatures) == ["serving_default"]  # no feature spec: no examples
    assert loaded.signatures["serving_default"].structured_outputs["outputs"].dtype == tf.float32
    outputs = loaded.signatures["serving_default"](x=tf.constant(x))["outputs"]
    tf.train.Checkpoint(model=trainer.model).read(
        str(tmp_path / "run" / "checkpoints" / "ckpt-4")).expect_partial()
    np.testing.assert_allclose(outputs, tf.cast(trainer.model({"x": x}), tf.float32),
                               rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match=r"no checkpoint of step 5 .* steps \[4, 8\]"):
        tputrain.export_checkpoint(trainer, step=5)
    with pytest.raises(ValueError, match="no best checkpoint"):
        tputrain.export_checkpoint(trainer, best=True)
    monkeypatch.setenv("AIP_MODEL_DIR", str(tmp_path / "vertex" / "model"))
    assert tputrain.export_checkpoint(trainer) == str(tmp_path / "vertex" / "model")
    assert (tmp_path / "vertex" / "model" / "saved_model.pb").exists()


def test_feature_specs_of_the_built_in_tasks():
    digits = feature_spec_of(tputrain.tasks.DigitsTask())
    assert digits["image"].shape == [64] and digits["image"].dtype == tf.float32
    assert feature_spec_of(TinyTask()) is None


def test_variable_length_inputs_give_no_examples_signature_rather_than_an_error(tmp_path):
    """A serving_examples signature would need the inputs' packing; export goes on without."""
    tputrain.data.write_tfrecords({"tokens": [[1], [2, 3]], "label": [0, 1]},
                                  str(tmp_path / "seq"), num_shards=1)
    inputs = tputrain.data.TFRecordInput(manifest=str(tmp_path / "seq.manifest.json"),
                                         to_static=tputrain.data.PadSequences(4))

    class SequenceTask(TinyTask):
        def __init__(self):
            super().__init__()
            self.inputs = {"train": inputs}

    assert feature_spec_of(SequenceTask()) is None


# ------------------------------------------------------------ end to end (README)

LOAD = """
import glob, json, sys
import numpy as np, tensorflow as tf
path, cache = sys.argv[1:]
model = tf.saved_model.load(path)
records = list(tf.data.TFRecordDataset(sorted(glob.glob(cache + "/digits/eval-*"))))
parsed = tf.io.parse_example(records, {"image": tf.io.FixedLenFeature([64], tf.float32),
                                       "label": tf.io.FixedLenFeature([], tf.int64)})
outputs = model.signatures["serving_default"](image=parsed["image"])["outputs"]
examples = model.signatures["serving_examples"](examples=tf.stack(records))["outputs"]
correct = lambda logits: float(np.mean(np.argmax(logits, -1) == parsed["label"].numpy()))
print(json.dumps({"dtype": outputs.dtype.name, "accuracy": correct(outputs),
                  "examples_accuracy": correct(examples), "count": len(records)}))
"""


def run(tmp_path, *args):
    env = dict(os.environ, TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    env.pop("AIP_MODEL_DIR", None)
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def served_accuracy(tmp_path, path) -> dict:
    """In a fresh process: load the SavedModel, call it on the digits eval images."""
    return json.loads(run(tmp_path, "-c", LOAD, str(path), str(tmp_path / "cache")).stdout)


def trained_accuracy(log: str) -> float:
    return float(re.findall(r"done at step \d+: .*accuracy ([0-9.]+)", log)[-1])


@pytest.mark.same_worker("readme_digits")
@pytest.mark.slow
def test_readme_command_exports_a_model_that_serves_the_trained_accuracy(readme_digits):
    # `readme_digits` (conftest): README command 1 run once, also checked by test_run.py.
    root, train = readme_digits
    assert train.returncode == 0, train.stderr[-3000:]
    model_dir = root / "model"
    assert [p.name for p in (model_dir / "export").iterdir()] == ["1200"]
    served = served_accuracy(root, model_dir / "export" / "1200")
    assert served["count"] == 320 and served["dtype"] == "float32"
    assert served["accuracy"] == served["examples_accuracy"]
    assert abs(served["accuracy"] - trained_accuracy(train.stderr)) <= 0.005


@pytest.mark.start_early(11)
@pytest.mark.slow
def test_mixed_bfloat16_run_serves_float32_and_the_cli_exports_any_step(tmp_path):
    model_dir = tmp_path / "bf16"
    train = run(tmp_path, "-m", "tputrain.run", "--gin_file=digits.gin",
                f"--model_dir={model_dir}", "--gin_param=Trainer.precision='mixed_bfloat16'",
                "--gin_param=Trainer.train_steps=400")
    served = served_accuracy(tmp_path, model_dir / "export" / "400")
    assert served["dtype"] == "float32"
    assert abs(served["accuracy"] - trained_accuracy(train.stderr)) <= 0.005
    # `tputrain export` reads the run's operative config; any kept step.
    exported = run(tmp_path, "-m", "tputrain.cli", "export", f"--model_dir={model_dir}",
                   "--step=200")
    assert exported.stdout.strip() == str(model_dir / "export" / "200")
    assert served_accuracy(tmp_path, model_dir / "export" / "200")["dtype"] == "float32"

@pytest.mark.slow

def test_the_cli_exports_while_a_training_process_holds_model_dir(tmp_path):
    """`tputrain export` only reads the run (a ReadOnlyTrainer): it works beside the
    process that trains there and holds model_dir's lock (here, this test process)."""
    from faults import FaultTask, child_env

    model_dir = tmp_path / "run"
    trainer = make(FaultTask(), model_dir, train_steps=4)
    trainer.train()  # this process is the chief: it holds the lock until it ends
    config = tmp_path / "run.gin"
    config.write_text("Trainer.task = @FaultTask()\nTrainer.global_batch_size = 16\n")
    command = [sys.executable, "-m", "tputrain.cli", "export", "--gin_import=faults",
               f"--gin_file={config}", f"--model_dir={model_dir}"]
    train_again = command[:3] + ["run", *command[4:], "--gin_param=Trainer.train_steps=8"]
    refused = subprocess.run(train_again, env=child_env(), capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and f"in use by pid {os.getpid()}" in refused.stderr, \
        refused.stderr[-3000:]  # a second writer is refused: the lock is really held
    exported = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                              timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert exported.stdout.strip() == str(model_dir / "export" / "4")
    assert tf.saved_model.load(str(model_dir / "export" / "4")).signatures["serving_default"]


class PixelsRegressionTask(TinyTask):
    """A 1-unit regression head on a plain-tensor input (no features dict) named "pixels"."""

    def build_model(self) -> keras.Model:
        pixels = keras.Input((8,), name="pixels")
        return keras.Model(pixels, keras.layers.Dense(1)(keras.layers.Dense(4)(pixels)))

    def build_inputs(self, split, input_context):
        dataset = tf.data.Dataset.from_tensor_slices((self.x, self.x[:, :1] * 2.0)).repeat()
        return dataset.batch(input_context.global_batch_size, drop_remainder=True)

    def compute_loss(self, labels, outputs):
        return tf.reduce_mean(tf.square(labels - outputs), axis=-1)

    def build_metrics(self):
        return []


def test_a_plain_tensor_input_is_served_under_its_keras_input_name(tmp_path):
    export = tputrain.Export()
    trainer = make(PixelsRegressionTask(), tmp_path / "run", [export], eval_every=None)
    trainer.train()
    serve = tf.saved_model.load(export.path).signatures["serving_default"]
    assert list(serve.structured_input_signature[1]) == ["pixels"]
    x = trainer.task.x[:5]
    outputs = serve(pixels=tf.constant(x))["outputs"]
    np.testing.assert_allclose(outputs, trainer.model(x), rtol=1e-5, atol=1e-6)


def tiny_application() -> keras.Model:
    """keras.applications' MobileNet, small (weights=None: nothing is downloaded)."""
    return keras.applications.MobileNet(weights=None, input_shape=(32, 32, 3), alpha=0.25,
                                        classes=2, classifier_activation=None)


def test_a_keras_applications_input_is_named_as_keras_names_its_layer():
    """keras.applications' models declare `keras.Input(shape)` with no name: the signature
    names it `input_layer` (Keras's name for its layer), never the automatic
    `keras_tensor_N`, which changes with every model built and with `clone_model`."""
    features = tf.TensorSpec([4, 32, 32, 3], tf.float32)
    first = tiny_application()
    for model in (first, tiny_application(), keras.models.clone_model(first)):
        assert signature_inputs(model, features).name == "input_layer"
    named = keras.Input((32, 32, 3), name="image")
    model = keras.applications.MobileNet(weights=None, input_tensor=named, alpha=0.25,
                                         classes=2)
    assert signature_inputs(model, features).name == "image"


@pytest.mark.slow
def test_a_keras_applications_model_is_served_under_its_input_layers_name(tmp_path):
    """Exported from `tputrain.fit` (a cloned model), its one input is `input_layer`."""
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(8, 32, 32, 3)).astype(np.float32)
    labels = rng.integers(0, 2, size=8)
    keras.utils.set_random_seed(0)
    model = tiny_application()
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    export = tputrain.Export()
    tputrain.fit(model, (images, labels), (images[:4], labels[:4]),
                 model_dir=str(tmp_path / "run"), steps=1, batch_size=4,
                 strategy=strategy_for(1), actions=[export], report_mfu=False,
                 jit_compile=False)
    serve = tf.saved_model.load(export.path).signatures["serving_default"]
    assert list(serve.structured_input_signature[1]) == ["input_layer"]
    outputs = serve(input_layer=tf.constant(images[:3]))["outputs"]
    np.testing.assert_allclose(outputs, model(images[:3], training=False), rtol=1e-4,
                               atol=1e-5)


def test_a_model_dirs_config_is_read_as_data_and_its_imports_are_not_run(tmp_path):
    """Issue 33, item 7: `operative_config.gin` of a model_dir (often shared storage) is
    parsed without its `import` lines, even with model_dir first on sys.path (`python -m`
    run from inside it); the skipped module is named in one line."""
    from faults import child_env

    model_dir = tmp_path / "shared"
    model_dir.mkdir()
    marker = tmp_path / "planted-ran"
    (model_dir / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (model_dir / "operative_config.gin").write_text(
        "import planted\nTrainer.task = @FaultTask()\nTrainer.global_batch_size = 16\n")
    result = subprocess.run([sys.executable, "-m", "tputrain.cli", "export", "--model_dir=.",
                             "--gin_import=faults"], cwd=model_dir, env=child_env(),
                            capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "the model_dir's module was imported"
    assert "not importing planted" in result.stderr and "--gin_import" in result.stderr
    assert result.returncode == 2 and "no checkpoint in ." in result.stderr, result.stderr[-3000:]


# ------------------------------------------------------------ issue 33.5: failures of export


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A TinyTask run with checkpoints at steps 4 and 8 (tests copy it to change it)."""
    model_dir = tmp_path_factory.mktemp("trained") / "run"
    make(TinyTask(), model_dir).train()
    return model_dir


def copy_of(trained, tmp_path) -> ReadOnlyTrainer:
    """A ReadOnlyTrainer (as `tputrain export` builds) on a copy of the trained run."""
    model_dir = tmp_path / "run"
    shutil.copytree(trained, model_dir)
    return ReadOnlyTrainer(TinyTask(), str(model_dir), strategy=strategy_for(1), train_steps=8,
                           steps_per_loop=2, global_batch_size=16, eval_steps=2,
                           checkpoint_every=4, report_mfu=False)


def temps(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) if folder.exists() else []


def failing_save(error):
    """A SavedModel writer that leaves half a folder and raises `error` (a full or
    read-only disk; as root, chmod cannot make one)."""
    def save(model, inputs, path, examples=None):
        os.makedirs(os.path.join(path, "variables"))
        open(os.path.join(path, "variables", "variables.data-00000-of-00001"), "wb").close()
        raise error
    return save


@pytest.mark.same_worker("export_trained")
@pytest.mark.parametrize("error, words", [
    (OSError(errno.ENOSPC, "No space left on device"), "free some space"),
    (tf.errors.PermissionDeniedError(None, None, "Read-only file system"), "a writable folder"),
])
def test_a_failed_write_is_one_line_and_leaves_no_temp_folder(trained, tmp_path, monkeypatch,
                                                              error, words):
    """A full disk or read-only model_dir gave TF's traceback and a partial *.tmp-* folder."""
    trainer = copy_of(trained, tmp_path)
    monkeypatch.setattr(tputrain.serving.export, "save_serving_model", failing_save(error))
    with pytest.raises(OSError) as caught:
        tputrain.export_checkpoint(trainer)
    assert "\n" not in str(caught.value) and words in str(caught.value)
    assert str(tmp_path / "run" / "export" / "8") in str(caught.value)
    assert "--export_dir=DIR" in str(caught.value)  # `tputrain export`'s flag
    assert temps(tmp_path / "run" / "export") == []


def test_a_full_disk_at_the_final_export_is_one_line_and_the_rerun_exports(
        tmp_path, monkeypatch, capsys):
    """Issue 50.6: a full disk at the end-of-run export was a 40-line traceback (the
    rerun completed the export); now one line, exit 1 as a full disk at a save."""
    from tputrain.cli.run import _train

    def trainer():
        return tputrain.Trainer(TinyTask(), str(tmp_path / "run"), strategy=strategy_for(1),
                                train_steps=4, steps_per_loop=2, global_batch_size=16,
                                eval_steps=2, checkpoint_every=4, report_mfu=False,
                                actions=[tputrain.Export()])

    with monkeypatch.context() as patch:
        patch.setattr(tputrain.serving.export, "save_serving_model",
                      failing_save(OSError(errno.ENOSPC, "No space left on device")))
        capsys.readouterr()
        with pytest.raises(SystemExit) as caught:
            _train(trainer())
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.startswith("tputrain: error:")]
    assert caught.value.code == 1 and len(lines) == 1 and "Traceback" not in error, error
    assert "free some space" in lines[0] and "rerun" in lines[0], lines
    # `tputrain run` has no --export_dir: the fix names the Export action's binding.
    assert "--export_dir" not in lines[0], lines
    assert "--gin_param=\"Export.export_dir='DIR'\"" in lines[0], lines
    assert temps(tmp_path / "run" / "export") == []
    trainer().train()  # room again: the rerun trains nothing and exports
    assert (tmp_path / "run" / "export" / "4" / "saved_model.pb").exists()


@pytest.mark.same_worker("export_trained")
def test_an_export_dir_that_is_a_file_is_named(trained, tmp_path):
    trainer = copy_of(trained, tmp_path)
    (tmp_path / "served").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        tputrain.export_checkpoint(trainer, export_dir=str(tmp_path / "served"))
    assert temps(tmp_path) == []


@pytest.mark.same_worker("export_trained")
def test_temp_folders_of_killed_exports_are_removed(trained, tmp_path):
    trainer = copy_of(trained, tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is gone
    stale = tmp_path / "run" / "export" / f"8.tmp-{socket.gethostname()}-{dead.pid}-0badf00d"
    live = tmp_path / "run" / "export" / f"8.tmp-{socket.gethostname()}-{os.getpid()}-0123abcd"
    for folder in (stale, live):
        (folder / "variables").mkdir(parents=True)
    assert tputrain.export_checkpoint(trainer) == str(tmp_path / "run" / "export" / "8")
    assert temps(tmp_path / "run" / "export") == [live.name]  # a running export's is kept


@pytest.mark.same_worker("export_trained")
def test_an_existing_version_is_not_overwritten_with_another_step(trained, tmp_path):
    """--export_dir=MODEL_DIR/export/8 --step=4 rewrote version 8 in place with step 4."""
    trainer = copy_of(trained, tmp_path)
    version = tputrain.export_checkpoint(trainer, step=8)
    before = (tmp_path / "run" / "export" / "8" / "saved_model.pb").read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        tputrain.export_checkpoint(trainer, step=4, export_dir=version)
    assert (tmp_path / "run" / "export" / "8" / "saved_model.pb").read_bytes() == before
    assert tputrain.export_checkpoint(trainer, step=8) == version  # the same step: kept


@pytest.mark.same_worker("export_trained")
def test_a_concurrent_export_of_the_same_step_is_not_an_error(trained, tmp_path, monkeypatch):
    """Two `tputrain export --step=8` at once: the second rename failed (AlreadyExistsError
    traceback) and left a complete export/8.tmp-* behind."""
    trainer = copy_of(trained, tmp_path)
    real = tputrain.serving.export.save_serving_model
    target = tmp_path / "run" / "export" / "8"

    def other_process_renames_first(model, inputs, path, examples=None):
        names = real(model, inputs, path, examples)
        shutil.copytree(path, target)  # the other export's rename lands first
        return names

    monkeypatch.setattr(tputrain.serving.export, "save_serving_model", other_process_renames_first)
    assert tputrain.export_checkpoint(trainer, step=8) == str(target)
    assert temps(tmp_path / "run" / "export") == []


def truncate(model_dir, step):
    data = next((model_dir / "checkpoints").glob(f"ckpt-{step}.data-*"))
    data.write_bytes(data.read_bytes()[:len(data.read_bytes()) // 2])


@pytest.mark.same_worker("export_trained")
def test_a_truncated_latest_checkpoint_falls_back_to_the_older_one(trained, tmp_path, caplog):
    """`IndexError: Read less bytes than requested`, no file named and no fallback."""
    trainer = copy_of(trained, tmp_path)
    truncate(tmp_path / "run", 8)
    assert tputrain.export_checkpoint(trainer) == str(tmp_path / "run" / "export" / "4")
    assert "ckpt-8 is unreadable" in caplog.text and "older" in caplog.text
    with pytest.raises(ValueError) as caught:
        tputrain.export_checkpoint(trainer, step=8)
    assert "ckpt-8" in str(caught.value) and "--step" in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.same_worker("export_trained")
def test_eval_of_a_truncated_checkpoint_falls_back_or_names_it(trained, tmp_path):
    trainer = copy_of(trained, tmp_path)
    truncate(tmp_path / "run", 8)
    assert list(evaluate_checkpoints(trainer)) == [4]
    with pytest.raises(ValueError, match="cannot read the checkpoint .*ckpt-8"):
        evaluate_checkpoints(trainer, step=8)


@pytest.mark.same_worker("export_trained")
def test_the_side_car_reports_each_checkpoint_as_it_is_evaluated(trained, tmp_path):
    """`tputrain eval --continuous` printed its lines only when it finished (none when
    killed): `on_result` (the CLI prints there) is called before the next checkpoint."""
    trainer = copy_of(trained, tmp_path)
    seen = []

    def first_only(step, logs):
        seen.append(step)
        raise KeyboardInterrupt  # a side-car killed after its first evaluation

    with pytest.raises(KeyboardInterrupt):
        evaluate_checkpoints(trainer, continuous=True, timeout=60, on_result=first_only)
    assert seen == [4]


# ------------------------------------------------------------ a kill at the end of a run

@pytest.mark.slow
def test_a_kill_at_any_file_event_after_the_final_checkpoint_is_completed_by_a_rerun(tmp_path):
    """Issue 33.2: killed before each file event after the final checkpoint (the final
    evaluation's records, the export; copies into best/ also cut in half), a rerun
    completes what is missing and nothing else: it exports (it said 'nothing to train'
    and never wrote export/<step>/) and ends as the uninterrupted run."""
    from faults import file_events
    from file_events import CONFIG, assert_same_outcome, event_child, kill_states, run_outcome

    config = tmp_path / "end.gin"
    config.write_text(CONFIG + "Trainer.train_steps = 12\nEarlyStopping.patience = 100\n")
    # One run paused at every file event, its model_dir copied as a kill there leaves it.
    code, text = kill_states(config, tmp_path / "reference", tmp_path / "killed")
    assert code == 0, text[-3000:]
    events = file_events(text)
    final = max(i for i, (_, what) in enumerate(events) if what == "save checkpoints/ckpt-12")
    # The end-of-run actions' events: the final evaluation's records, then the export
    # written aside and renamed (goodput's record and the operative config are not theirs).
    window = [(n, w) for n, w in events[final + 1:]
              if re.search(r" (best|export)/|early_stopping\.json", w)]
    shapes = [re.sub(r"\d+", "N", w) for _, w in window]
    assert shapes[-2:] == ["savedmodel export/N.tmp", "rename export/N"], window
    assert "rename checkpoints/early_stopping.json" in shapes, window
    kills = [(n, w, False) for n, w in window] + [(n, w, True) for n, w in window
                                                   if w.startswith("copy ")]
    expected = run_outcome(tmp_path / "reference")
    for number, what, torn in kills:
        model_dir = tmp_path / "killed" / f"{number}-{int(torn)}"
        rerun = event_child(config, model_dir)
        assert rerun.finish(timeout=900) == 0, rerun.log()
        assert "nothing to train" in rerun.text() and "training from step" not in rerun.text()
        reruns = [w for _, w in file_events(rerun.text())]
        assert not any(w.startswith("save ") for w in reruns), reruns  # no checkpoint written
        assert_same_outcome(run_outcome(model_dir), expected,
                            f"killed before event {number} ({what}, torn={torn})")


def test_a_model_with_a_list_of_inputs_is_served_under_their_names(tmp_path):
    """`tputrain.fit(model, ([a, b], y), actions=[Export()])` trained every step, then
    failed at the end ("export needs the model's features to be one tensor or a dict")
    and the user's model got no weights back. The list's inputs are served by their
    `keras.Input` names, in the model's order (an unnamed one by its place)."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 3)).astype(np.float32)
    b = rng.normal(size=(64, 2)).astype(np.float32)
    y = (a[:, 0] + b[:, 0] > 0).astype(np.int64)
    first, second = keras.Input((3,), name="a"), keras.Input((2,))
    model = keras.Model([first, second], keras.layers.Dense(2)(
        keras.layers.Concatenate()([first, second])))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    export = tputrain.Export()
    tputrain.fit(model, ([a, b], y), model_dir=str(tmp_path / "run"), steps=4, batch_size=16,
                 strategy=strategy_for(1), actions=[export], report_mfu=False,
                 jit_compile=False)
    serve = tf.saved_model.load(export.path).signatures["serving_default"]
    assert sorted(serve.structured_input_signature[1]) == ["a", "input_1"]
    served = list(serve(a=tf.constant(a[:5]), input_1=tf.constant(b[:5])).values())[0]
    np.testing.assert_allclose(served, model([a[:5], b[:5]]), rtol=1e-5, atol=1e-6)


def test_features_export_cannot_serve_are_refused_before_training(tmp_path):
    """A structure no signature takes (a dict holding a list) failed at the end of the
    run, after every step; now it fails before the first, with nothing checkpointed."""
    rng = np.random.default_rng(0)
    x = {"pair": (rng.normal(size=(32, 2)).astype(np.float32),) * 2}
    y = rng.integers(0, 2, size=32)
    first, second = keras.Input((2,), name="p0"), keras.Input((2,), name="p1")
    model = keras.Model({"pair": [first, second]}, keras.layers.Dense(2)(
        keras.layers.Concatenate()([first, second])))
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="export needs the model's features"):
        tputrain.fit(model, (x, y), model_dir=str(tmp_path / "run"), steps=4, batch_size=16,
                     strategy=strategy_for(1), actions=[tputrain.Export()], report_mfu=False,
                     jit_compile=False)
    assert not (tmp_path / "run" / "checkpoints").exists()
