"""InitCheckpoint: task B (a new head) starts from task A's backbone, from a tputrain
model_dir, a plain TF checkpoint or a .weights.h5; what is not loaded is named; a
resumed run keeps its own weights; slots only when asked; mirrored on 2 replicas."""

from __future__ import annotations

import logging

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from tiny import TinyTask, strategy_for
from tputrain.actions.init_checkpoint import InitCheckpoint, rename, selected

pytestmark = pytest.mark.same_worker("test_init_checkpoint.py")


class FineTask(TinyTask):
    """TinyTask with a named two-layer backbone and a head of `classes` outputs."""

    def __init__(self, head: str = "head_a", classes: int = 2, backbone: str = "backbone",
                 learning_rate: float = 0.05):
        super().__init__(learning_rate=learning_rate)
        self.head, self.classes, self.backbone = head, classes, backbone

    def build_model(self) -> keras.Model:
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation="relu", name=f"{self.backbone}_1")(inputs)
        h = keras.layers.Dense(8, activation="relu", name=f"{self.backbone}_2")(h)
        return keras.Model({"x": inputs}, keras.layers.Dense(self.classes, name=self.head)(h))


class Capture(tputrain.Action):
    """Records every model and optimizer variable as the run starts (after the actions
    before it, InitCheckpoint included), per replica."""

    def __init__(self):
        self.model: dict[str, list[np.ndarray]] = {}
        self.optimizer: dict[str, list[np.ndarray]] = {}

    def on_train_begin(self, trainer, step):
        self.model = {v.path: replicas(v) for v in trainer.model.variables}
        self.optimizer = {v.path: replicas(v) for v in trainer.optimizer.variables}


def replicas(variable) -> list[np.ndarray]:
    """Each replica's copy of a (possibly mirrored) Keras variable."""
    value = getattr(variable, "value", variable)
    copies = getattr(value, "values", None) or (value,)
    return [np.array(c) for c in copies]


def make(task, model_dir, actions=(), replicas_=1, **kwargs):
    options = dict(train_steps=4, steps_per_loop=2, global_batch_size=16, eval_steps=1,
                   checkpoint_every=2, report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(task, str(model_dir), strategy=strategy_for(replicas_),
                            actions=list(actions), **options)


def values(model_or_trainer) -> dict[str, np.ndarray]:
    model = getattr(model_or_trainer, "model", model_or_trainer)
    return {v.path: np.array(v) for v in model.variables}


BACKBONE = ["backbone_1/kernel", "backbone_1/bias", "backbone_2/kernel", "backbone_2/bias"]


@pytest.fixture(scope="module")
def task_a(tmp_path_factory):
    """Task A trained 4 steps on 2 replicas: (model_dir, final weights, final slots by name)."""
    model_dir = tmp_path_factory.mktemp("a")
    trainer = make(FineTask(), model_dir, replicas_=2)
    trainer.train()
    slots = {v.name: np.array(v) for v in trainer.optimizer.variables}
    return str(model_dir), values(trainer), slots


def messages(caplog) -> str:
    return " ".join(r.getMessage() for r in caplog.records)


# ------------------------------------------------------------ the acceptance test


def test_b_starts_from_a_backbone_and_the_log_names_what_was_not_loaded(tmp_path, task_a, caplog):
    a_dir, a_weights, _ = task_a
    init, capture = InitCheckpoint(a_dir, include=["backbone"]), Capture()
    trainer = make(FineTask("head_b", classes=3), tmp_path, [init, capture])
    with caplog.at_level(logging.INFO):
        trainer.train(num_steps=2)
    for name in BACKBONE:
        np.testing.assert_array_equal(capture.model[name][0], a_weights[name])
    assert capture.model["head_b/kernel"][0].shape == (8, 3)  # B's own head, as built
    assert sorted(name for name, _ in init.report.loaded) == sorted(BACKBONE)
    assert init.report.excluded == ["head_b/kernel", "head_b/bias"]
    assert init.report.unused == ["head_a/bias", "head_a/kernel"]
    log = messages(caplog)
    assert "loaded 4 of 6 model variables" in log
    assert "outside include: head_b/kernel, head_b/bias" in log
    assert "not used: head_a/bias, head_a/kernel" in log
    assert trainer.current_step == 2  # fine-tuning counts its own steps from 0


def test_a_resumed_run_keeps_its_own_weights(tmp_path, task_a, caplog):
    a_dir, a_weights, _ = task_a
    first = make(FineTask("head_b", classes=3), tmp_path, [InitCheckpoint(a_dir, ["backbone"])])
    first.train(num_steps=2)  # saves ckpt-2 with B's trained weights
    b_weights = values(first)
    init, capture = InitCheckpoint(a_dir, ["backbone"]), Capture()
    rerun = make(FineTask("head_b", classes=3), tmp_path, [init, capture])
    with caplog.at_level(logging.INFO):
        rerun.train(num_steps=2)
    assert init.report is None and "has its own checkpoint (step 2)" in messages(caplog)
    for name in BACKBONE:
        np.testing.assert_array_equal(capture.model[name][0], b_weights[name])
        assert not np.array_equal(capture.model[name][0], a_weights[name])


def test_two_replicas_each_get_a_weights(tmp_path, task_a):
    a_dir, a_weights, _ = task_a
    capture = Capture()
    make(FineTask("head_b", classes=3), tmp_path, [InitCheckpoint(a_dir, ["backbone"]), capture],
         replicas_=2).train(num_steps=2)
    for name in BACKBONE:
        assert len(capture.model[name]) == 2
        for copy in capture.model[name]:
            np.testing.assert_array_equal(copy, a_weights[name])


def test_gin_configures_it_as_an_action(tmp_path, task_a):
    a_dir, a_weights, _ = task_a
    gin.parse_config(f"Trainer.actions = [@InitCheckpoint()]\nInitCheckpoint.path = '{a_dir}'\n"
                     "InitCheckpoint.include = ['backbone']\n")
    trainer = tputrain.Trainer(FineTask("head_b", classes=3), str(tmp_path),
                               strategy=strategy_for(1), train_steps=2, steps_per_loop=2,
                               global_batch_size=16, eval_steps=1, report_mfu=False)
    [init] = trainer.actions
    assert isinstance(init, InitCheckpoint) and init.include == ["backbone"]
    init.on_train_begin(trainer, 0)
    for name in BACKBONE:
        np.testing.assert_array_equal(values(trainer)[name], a_weights[name])


# ------------------------------------------------------------ optimizer slots


def test_optimizer_slots_only_when_asked_and_never_the_iterations(tmp_path, task_a):
    a_dir, _, a_slots = task_a
    momentum = "backbone_1_kernel_momentum"  # by name: the optimizer's own prefix varies
    assert np.any(a_slots[momentum] != 0)  # A's momentum is worth taking
    without = make(FineTask("head_b", classes=3), tmp_path / "without")
    InitCheckpoint(a_dir, ["backbone"]).on_train_begin(without, 0)
    assert not np.any(np.array(next(v for v in without.optimizer.variables
                                    if v.name == momentum)))
    with_slots = make(FineTask("head_b", classes=3), tmp_path / "with")
    init = InitCheckpoint(a_dir, ["backbone"], optimizer=True)
    init.on_train_begin(with_slots, 0)
    taken = {v.name: np.array(v) for v in with_slots.optimizer.variables}
    for name in BACKBONE:
        slot = f"{name.replace('/', '_')}_momentum"
        np.testing.assert_array_equal(taken[slot], a_slots[slot])
    assert init.report.slots_loaded == 4
    assert not np.any(taken["head_b_kernel_momentum"])
    assert int(with_slots.optimizer.iterations.numpy()) == 0 and with_slots.current_step == 0


def test_optimizer_slots_from_a_weights_file_are_refused(tmp_path):
    model = FineTask().build_model()
    model.save_weights(str(tmp_path / "a.weights.h5"))
    trainer = make(FineTask("head_b", classes=3), tmp_path / "b")
    with pytest.raises(ValueError, match="has no optimizer slots"):
        InitCheckpoint(str(tmp_path / "a.weights.h5"), optimizer=True).on_train_begin(trainer, 0)


# ------------------------------------------------------------ other sources


def random_weights(model: keras.Model, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    for variable in model.variables:
        variable.assign(rng.randn(*variable.shape).astype("float32"))
    return values(model)


@pytest.mark.parametrize("as_folder", [False, True])
def test_a_plain_tf_checkpoint_of_a_keras_model(tmp_path, as_folder):
    source = FineTask().build_model()
    expected = random_weights(source)
    prefix = tf.train.Checkpoint(model=source).save(str(tmp_path / "tf" / "ckpt"))
    target = FineTask("head_b", classes=3).build_model()
    report = InitCheckpoint(str(tmp_path / "tf") if as_folder else prefix).load(target)
    assert report.missing == ["head_b/kernel", "head_b/bias"]  # no include: not in it
    for name in BACKBONE:
        np.testing.assert_array_equal(values(target)[name], expected[name])


def test_a_folder_without_a_state_file_takes_the_highest_step(tmp_path):
    """A `best/` folder or copied files: ckpt-10 is newer than ckpt-7 (not by spelling)."""
    source = FineTask().build_model()
    random_weights(source, seed=7)
    tf.train.Checkpoint(model=source).write(str(tmp_path / "copied" / "ckpt-7"))
    expected = random_weights(source, seed=10)
    tf.train.Checkpoint(model=source).write(str(tmp_path / "copied" / "ckpt-10"))
    target = FineTask().build_model()
    report = InitCheckpoint(str(tmp_path / "copied")).load(target)
    assert report.path.endswith("ckpt-10") and not report.missing and not report.unused
    for name, value in expected.items():
        np.testing.assert_array_equal(values(target)[name], value)


def test_a_keras_weights_file_matches_by_layer_name(tmp_path):
    source = FineTask().build_model()
    expected = random_weights(source)
    source.save_weights(str(tmp_path / "a.weights.h5"))
    target = FineTask("head_b", classes=3).build_model()
    report = InitCheckpoint(str(tmp_path / "a.weights.h5"), include=["backbone"]).load(target)
    assert len(report.loaded) == 4 and report.unused == ["head_a/0", "head_a/1"]
    for name in BACKBONE:
        np.testing.assert_array_equal(values(target)[name], expected[name])


@pytest.mark.parametrize("kind", ["checkpoint", "h5"])
def test_mapping_renames_layers(tmp_path, kind):
    source = FineTask().build_model()
    expected = random_weights(source)
    if kind == "h5":
        path = str(tmp_path / "a.weights.h5")
        source.save_weights(path)
    else:
        path = tf.train.Checkpoint(model=source).save(str(tmp_path / "ckpt"))
    target = FineTask("head_b", classes=3, backbone="encoder").build_model()
    InitCheckpoint(path, include=["encoder"], mapping={"encoder": "backbone"}).load(target)
    for name in BACKBONE:
        np.testing.assert_array_equal(values(target)[name.replace("backbone", "encoder")],
                                      expected[name])


def test_a_regex_include_takes_only_what_it_matches(tmp_path):
    source = FineTask().build_model()
    expected = random_weights(source)
    prefix = tf.train.Checkpoint(model=source).save(str(tmp_path / "ckpt"))
    target = FineTask().build_model()
    before = values(target)
    InitCheckpoint(prefix, include=[r"backbone_\d/kernel"]).load(target)
    after = values(target)
    np.testing.assert_array_equal(after["backbone_2/kernel"], expected["backbone_2/kernel"])
    np.testing.assert_array_equal(after["backbone_2/bias"], before["backbone_2/bias"])
    np.testing.assert_array_equal(after["head_a/kernel"], before["head_a/kernel"])


# ------------------------------------------------------------ errors


def test_a_shape_mismatch_names_the_variable_and_both_shapes(task_a):
    target = FineTask("head_a", classes=3).build_model()  # same name, other shape
    before = values(target)
    with pytest.raises(ValueError, match=r"head_a/kernel is \[8, 3\] in this model and "
                                         r"head_a/kernel is \[8, 2\] in the checkpoint"):
        InitCheckpoint(task_a[0]).load(target)
    for name, value in values(target).items():  # nothing half-loaded
        np.testing.assert_array_equal(value, before[name])


def test_strict_raises_naming_what_the_checkpoint_lacks(task_a):
    target = FineTask("head_b", classes=3).build_model()
    with pytest.raises(ValueError, match="has no head_b/kernel, head_b/bias"):
        InitCheckpoint(task_a[0], strict=True).load(target)
    InitCheckpoint(task_a[0], include=["backbone"], strict=True).load(target)  # all there


def test_missing_paths_and_matching_nothing_are_errors(tmp_path, task_a):
    model = FineTask().build_model()
    with pytest.raises(FileNotFoundError, match="is neither a tputrain model_dir"):
        InitCheckpoint(str(tmp_path / "nowhere")).load(model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        InitCheckpoint(str(tmp_path / "nowhere.weights.h5")).load(model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        InitCheckpoint(str(tmp_path / "empty")).load(model)
    with pytest.raises(ValueError, match="no variable of this model is in"):
        InitCheckpoint(task_a[0], include=["decoder"]).load(model)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="InitCheckpoint.include"):
        InitCheckpoint("x", include=[3])
    with pytest.raises(ValueError, match="include=\\[\\] takes nothing"):
        InitCheckpoint("x", include=[])
    with pytest.raises(TypeError, match="InitCheckpoint.mapping"):
        InitCheckpoint("x", mapping=["encoder"])
    with pytest.raises(TypeError, match="InitCheckpoint.optimizer"):
        InitCheckpoint("x", optimizer="yes")
    assert InitCheckpoint("x", include="backbone").include == ["backbone"]


def test_rename_and_selected():
    mapping = {"enc": "backbone", "enc_2/kernel": "other/kernel"}
    assert rename("enc_1/bias", mapping) == "backbone_1/bias"
    assert rename("enc_2/kernel", mapping) == "other/kernel"  # exact beats prefix
    assert rename("head/bias", mapping) == "head/bias"
    assert selected("backbone_1/kernel", ["backbone"]) and selected("x", None)
    assert selected("backbone_1/kernel", [r".*/kernel"])
    assert not selected("head/bias", [r".*/kernel"])


def test_a_missing_source_or_a_shape_mismatch_fails_before_anything_is_written(tmp_path, task_a):
    """Issue 33.4: both failed at on_train_begin, after the lock, operative config and
    goodput files were written; now the Trainer's construction raises (CLI: exit 2)."""
    cases = [(InitCheckpoint(str(tmp_path / "nowhere")), FineTask(), FileNotFoundError,
              "is neither a tputrain model_dir"),
             (InitCheckpoint(task_a[0]), FineTask("head_a", classes=3), ValueError,
              r"head_a/kernel is \[8, 3\] in this model")]
    for index, (action, task, error, words) in enumerate(cases):
        model_dir = tmp_path / f"run{index}"
        with pytest.raises(error, match=words) as caught:
            make(task, model_dir, [action])
        assert "\n" not in str(caught.value).split("\n  In call to configurable")[0]
        assert not model_dir.exists()
