"""Tests for tputrain.data.file_cache: an on-disk cache holds the data it is named for."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tputrain.data import InputContext, TFRecordInput, write_tfrecords


def _write(directory, name: str, value: float) -> str:
    """8 examples whose `x` is `value` (so a batch shows what data it came from)."""
    write_tfrecords({"x": np.full((8, 1), value, np.float32), "y": np.zeros(8, np.int64)},
                    str(directory / name), num_shards=1)
    return str(directory / f"{name}.manifest.json")


def _read(manifest: str, cache: str) -> list[float]:
    """One pass, in file order, through a file cache at `cache`."""
    inputs = TFRecordInput(manifest=manifest, label_key="y", shuffle=False, repeat=False,
                           cache=cache)
    return [float(v) for features, _ in inputs(InputContext(global_batch_size=4))
            for v in features["x"].numpy().ravel()]


def test_a_rewritten_source_is_read_again_not_served_from_the_old_cache(tmp_path):
    cache = str(tmp_path / "cache")
    assert _read(_write(tmp_path, "train", 1.0), cache) == [1.0] * 8
    assert _read(_write(tmp_path, "train", 2.0), cache) == [2.0] * 8


def test_train_and_eval_inputs_with_one_cache_prefix_each_read_their_own_data(tmp_path):
    cache = str(tmp_path / "cache")
    train, evaluation = _write(tmp_path, "train", 1.0), _write(tmp_path, "eval", 9.0)
    assert _read(train, cache) == [1.0] * 8
    assert _read(evaluation, cache) == [9.0] * 8
    assert _read(train, cache) == [1.0] * 8


def test_an_unchanged_source_reads_the_cache_it_wrote(tmp_path):
    """What a resumed run needs: the same data and options name the same cache file."""
    manifest, cache = _write(tmp_path, "train", 1.0), str(tmp_path / "cached" / "c")
    os.makedirs(tmp_path / "cached")
    assert _read(manifest, cache) == [1.0] * 8
    written = sorted(os.listdir(tmp_path / "cached"))
    assert any(name.endswith(".index") for name in written), written
    assert _read(manifest, cache) == [1.0] * 8
    assert sorted(os.listdir(tmp_path / "cached")) == written  # no second cache


def test_a_cache_folder_that_does_not_exist_is_made(tmp_path):
    manifest = _write(tmp_path, "train", 1.0)
    assert _read(manifest, str(tmp_path / "new" / "folder" / "c")) == [1.0] * 8
    assert any(name.endswith(".index") for name in os.listdir(tmp_path / "new" / "folder"))


def test_a_cache_folder_that_cannot_be_made_is_named_in_one_line(tmp_path):
    manifest = _write(tmp_path, "train", 1.0)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"cannot make the cache folder '.*a_file/sub'.*"
                                         "writable path prefix") as raised:
        _read(manifest, str(tmp_path / "a_file" / "sub" / "c"))
    assert "\n" not in str(raised.value)


class _CachedTask:
    """A Task whose train and eval inputs are file-cached TFRecords (one prefix)."""

    def __new__(cls, manifest: str, cache: str):
        import keras
        import tputrain

        class Task(tputrain.Task):
            def build_model(self):
                x = keras.Input((4,), name="x")
                return keras.Model({"x": x}, keras.layers.Dense(2)(x))

            def build_inputs(self, split, context):
                return TFRecordInput(manifest=manifest, label_key="y", cache=cache,
                                     shuffle_buffer=10, repeat=split == "train")(context)

            def compute_loss(self, labels, outputs):
                return keras.losses.sparse_categorical_crossentropy(labels, outputs,
                                                                    from_logits=True)
        return Task()


def test_a_trainer_on_a_new_file_cache_trains_and_resumes(tmp_path):
    """A run on a file cache not yet written failed on its first loop ("Existing cache
    files found ... delete the above files"): the Trainer opens the train input more
    than once, and tf.data made each iterator of the unwritten cache a writer. The
    cache is now written whole when the pipeline is built; a run stopped at step 7 and
    resumed ends where the uninterrupted one does."""
    import tputrain

    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 4)).astype(np.float32)
    write_tfrecords({"x": x, "y": (x[:, 0] > 0).astype(np.int64)}, str(tmp_path / "train"),
                    num_shards=3)
    manifest = str(tmp_path / "train.manifest.json")

    def run(name: str, steps: int) -> list[np.ndarray]:
        trainer = tputrain.Trainer(
            _CachedTask(manifest, str(tmp_path / "cache" / "c")), str(tmp_path / name),
            train_steps=steps, steps_per_loop=1, checkpoint_every=1, eval_steps=1,
            global_batch_size=8, report_mfu=False, progress_bar="off")
        trainer.train()
        return [v.numpy() for v in trainer.model.weights]

    whole = run("whole", 17)
    run("resumed", 7)
    for a, b in zip(run("resumed", 17), whole):
        np.testing.assert_array_equal(a, b)


def test_a_written_cache_is_read_without_another_pass(tmp_path, caplog):
    """The check for a finished cache looked for tf.data's temporary `_0.index`, which
    the finished write merges away: every build passed over the data again and said
    "writing the cache" (minutes of start-up on large data, on every process start)."""
    manifest = _write(tmp_path, "train", 1.0)
    with caplog.at_level("INFO"):
        for _ in range(2):
            inputs = TFRecordInput(manifest=manifest, label_key="y", shuffle=False,
                                   repeat=False, cache=str(tmp_path / "cache" / "c"))
            inputs(InputContext(global_batch_size=4))
    said = [r.getMessage() for r in caplog.records if "writing the cache" in r.getMessage()]
    assert len(said) == 1, said


def test_a_second_process_waits_for_the_first_to_write_the_cache(tmp_path):
    """Two processes filling one new cache: the second deleted the first's lock file
    (taken for a killed writer's) and one of them died in tf.data (NotFoundError on
    its temporary files). tputrain's own lock orders them: the second reads the
    cache the first wrote; a lock a killed writer held is released by the kernel."""
    import subprocess
    import sys

    manifest = _write(tmp_path, "train", 1.0)
    script = (
        "import sys\n"
        "from tputrain.data import InputContext, TFRecordInput\n"
        f"inputs = TFRecordInput(manifest={manifest!r}, label_key='y', shuffle=False, "
        f"repeat=False, cache={str(tmp_path / 'cache' / 'c')!r})\n"
        "values = [float(v) for f, _ in inputs(InputContext(global_batch_size=4)) "
        "for v in f['x'].numpy().ravel()]\n"
        "assert values == [1.0] * 8, values\n")
    children = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE,
                                 text=True) for _ in range(3)]
    for child in children:
        _, err = child.communicate(timeout=240)
        assert child.returncode == 0, err[-2000:]


IDENTITY = """
import functools, json
import numpy as np
from tputrain.data.file_cache import callable_identity

def make(factor, table):
    def scale(example, *, shift=np.float32(1)):
        if example in {"alpha", "beta", "gamma"}:
            return example
        return example * factor + shift + table[0]
    return scale

print(json.dumps([callable_identity(make(2.0, np.arange(3))),
                  callable_identity(functools.partial(make, 2.0)),
                  callable_identity(make(3.0, np.arange(3))),
                  callable_identity(make(2.0, np.arange(4)))]))
"""


def test_a_preprocess_functions_identity_is_the_same_in_every_process_and_tells_values():
    """The cache's name holds the preprocess function's identity: it must not depend on
    addresses or the string hash seed (else every run would write a new cache), and
    must tell another closed-over value or array apart."""
    import json
    import subprocess
    import sys

    def identities(seed: str):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", IDENTITY], env=env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    first, second = identities("1"), identities("2")
    assert first == second
    assert len({json.dumps(i) for i in first}) == 4
