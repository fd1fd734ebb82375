"""Tests for tputrain.data.tfds: TFDSInput on mock data and on a tiny real TFDS dataset."""

import numpy as np
import pytest
import tensorflow as tf

tfds = pytest.importorskip("tensorflow_datasets")

import tputrain  # noqa: E402
from tputrain.config.parsing import parse_gin  # noqa: E402
from tputrain.data import InputContext, TFDSInput  # noqa: E402

pytestmark = [pytest.mark.start_early(10), pytest.mark.same_worker("test_tfds.py")]


class TputrainTinyTfds(tfds.core.GeneratorBasedBuilder):
    """40 examples: x = [i, i], label = i, and variable-length `tokens` (i % 3 + 1 of them)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "x": tfds.features.Tensor(shape=(2,), dtype=np.float32),
            "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int64),
            "label": np.int64,
        }))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(40)}

    def _generate_examples(self, n):
        for i in range(n):
            yield i, {"x": np.array([i, i], np.float32), "tokens": np.arange(i % 3 + 1),
                      "label": i}


@pytest.fixture(scope="module")
def tiny_data_dir(tmp_path_factory):
    """The tiny dataset prepared in 4 files (no download: the examples come from code)."""
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    TputrainTinyTfds(data_dir=data_dir).download_and_prepare(
        download_config=tfds.download.DownloadConfig(num_shards=4))
    return data_dir


def _labels(dataset):
    return [int(v) for _, labels in dataset for v in labels.numpy()]


def _tiny(data_dir, **kwargs):
    return TFDSInput("tputrain_tiny_tfds", "train", data_dir=data_dir,
                     features=("x", "label"), **kwargs)


def test_mock_mnist_gives_static_batches_and_a_label():
    with tfds.testing.mock_data(num_examples=40):
        dataset = TFDSInput("mnist", "train", global_batch_size=8)()
        features, labels = dataset.element_spec
        assert features["image"].shape == (8, 28, 28, 1) and labels.shape == (8,)
        images, labels = next(iter(dataset))
        assert images["image"].dtype == tf.uint8 and labels.dtype == tf.int64
        cached = TFDSInput("mnist", "test", global_batch_size=8, cache=True, repeat=False)()
        assert len(list(cached)) == 5  # 40 examples read once into memory


def test_each_pipeline_reads_its_own_files(tiny_data_dir):
    per_pipeline = [
        _labels(_tiny(tiny_data_dir, shuffle=False, repeat=False)(
            InputContext(2, i, num_replicas_in_sync=2, global_batch_size=4)))
        for i in range(2)]
    assert all(len(labels) == 20 for labels in per_pipeline)
    assert sorted(sum(per_pipeline, [])) == list(range(40))


def test_more_pipelines_than_files_read_even_sub_splits(tiny_data_dir, caplog):
    per_pipeline = [
        _labels(_tiny(tiny_data_dir, shuffle=True, seed=3, repeat=False)(
            InputContext(8, i, num_replicas_in_sync=8, global_batch_size=8)))
        for i in range(8)]
    assert "4 file(s) for 8 input pipelines" in caplog.text
    assert all(len(labels) == 5 for labels in per_pipeline)
    assert sorted(sum(per_pipeline, [])) == list(range(40))


def test_shuffled_and_reshuffled_each_epoch(tiny_data_dir):
    dataset = _tiny(tiny_data_dir, shuffle_buffer=40, seed=1)(InputContext(global_batch_size=40))
    first, second = [labels.numpy().tolist() for _, labels in dataset.take(2)]
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != list(range(40)) and first != second


@pytest.mark.parametrize("cache", [False, True])
def test_pad_remainder_keeps_the_last_examples(tiny_data_dir, cache):
    """40 examples in batches of 16: the third batch has 8 real rows and 8 of weight 0."""
    dataset = _tiny(tiny_data_dir, shuffle=False, repeat=False, cache=cache,
                    pad_remainder=True)(InputContext(global_batch_size=16))
    batches = list(dataset)
    assert [int(b[2].shape[0]) for b in batches] == [16, 16, 16]
    weights = np.concatenate([b[2].numpy() for b in batches])
    labels = np.concatenate([b[1].numpy() for b in batches])
    np.testing.assert_array_equal(weights, [1] * 40 + [0] * 8)
    assert sorted(labels[:40].tolist()) == list(range(40))
    with pytest.raises(ValueError, match="pad_remainder is for evaluation"):
        _tiny(tiny_data_dir, pad_remainder=True)


def test_variable_shapes_are_refused_with_the_fix(tiny_data_dir):
    inputs = TFDSInput("tputrain_tiny_tfds", "train", data_dir=tiny_data_dir, global_batch_size=4)
    with pytest.raises(ValueError, match=r"'tokens'.*TFDSInput.preprocess_example"):
        inputs()

    def pad_tokens(example):
        tokens = tf.pad(example["tokens"], [[0, 3 - tf.shape(example["tokens"])[0]]])
        return {**example, "tokens": tf.ensure_shape(tokens, [3])}

    def double_x(batch):
        return {**batch, "x": batch["x"] * 2}

    padded = TFDSInput("tputrain_tiny_tfds", "train", data_dir=tiny_data_dir, shuffle=False,
                       global_batch_size=4, preprocess_example=pad_tokens,
                       preprocess_batch=double_x)()
    features, labels = next(iter(padded))
    assert features["tokens"].shape == (4, 3)
    np.testing.assert_allclose(features["x"].numpy()[:, 0], 2 * labels.numpy())


def test_errors_name_the_fix(tmp_path, tiny_data_dir):
    with pytest.raises(ValueError, match="label_key 'label' is not in features"):
        TFDSInput("mnist", "train", features=("image",))
    with pytest.raises(ValueError, match=r"no feature\(s\) \['nope'\]"):
        TFDSInput("tputrain_tiny_tfds", "train", data_dir=tiny_data_dir, features=("nope",),
                  label_key=None, global_batch_size=2)()
    with pytest.raises(FileNotFoundError, match="tfds build tputrain_tiny_tfds"):
        TFDSInput("tputrain_tiny_tfds", "train", data_dir=str(tmp_path), global_batch_size=2)()


def test_tfds_config_trains_under_mock_data(tmp_path):
    """configs/tfds_mnist.gin, shortened; mock data comes from a Python generator, which
    tf.data cannot checkpoint, so the iterator is not saved: distributed input mode."""
    parse_gin(["tfds_mnist.gin"], [
        "Trainer.train_steps = 20", "Trainer.steps_per_loop = 10", "Trainer.eval_every = 20",
        "Trainer.eval_steps = 2", "Trainer.checkpoint_every = 20",
        "Trainer.global_batch_size = 16", "Trainer.report_mfu = False",
        "Trainer.input_mode = 'distributed'", f"Trainer.model_dir = '{tmp_path}'"])
    with tfds.testing.mock_data(num_examples=64):
        trainer = tputrain.Trainer(strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
        results = trainer.train()
    assert int(trainer.step.numpy()) == 20
    assert np.isfinite(results["loss"]) and 0.0 <= results["accuracy"] <= 1.0


def _scaled_by(factor: float):
    def scale(example):  # one name for every factor: only its closure tells them apart
        return {**example, "x": example["x"] * factor}
    return scale


def test_a_file_cache_is_keyed_by_the_preprocess_functions_code_not_its_name(
        tmp_path, tiny_data_dir):
    """A cache was keyed by preprocess_example's name: after a change of its body (or of a
    value it closes over), the cache of the old function was served, silently."""
    def first_x(factor):
        inputs = _tiny(tiny_data_dir, shuffle=False, global_batch_size=4, repeat=False,
                       cache=str(tmp_path / "cache"), preprocess_example=_scaled_by(factor))
        features, labels = next(iter(inputs()))
        return (features["x"].numpy()[:, 0] / np.maximum(labels.numpy(), 1)).tolist()

    assert first_x(2.0)[1:] == [2.0] * 3
    assert first_x(3.0)[1:] == [3.0] * 3
    assert first_x(2.0)[1:] == [2.0] * 3
