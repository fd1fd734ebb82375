"""gs:// for real: TF's own GCS filesystem against a local emulator (see gcs_emulator.py).

model_dir, checkpoints, summaries and TFRecord data on gs://; the bucket check
before training; resume from a gs:// checkpoint equals an uninterrupted run.
"""

import numpy as np
import pytest
import tensorflow as tf

import tputrain
from gcs_emulator import BUCKET, LocalGCS
from tputrain.runtime.gcs import BucketError, check_bucket_writable, split_gs_path
from faults import RecordsTask, write_records
from tiny import strategy_for, weights

pytestmark = pytest.mark.same_worker("test_gcs.py")

pytest.importorskip("gcp_storage_emulator")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with LocalGCS(tmp_path_factory.mktemp("gcs")) as local:
        yield local


@pytest.fixture
def gcs_env(gcs, monkeypatch):
    for key, value in gcs.env.items():
        monkeypatch.setenv(key, value)
    return gcs


def make_trainer(model_dir, pattern, train_steps):
    return tputrain.Trainer(RecordsTask(pattern), model_dir, strategy=strategy_for(2),
                            train_steps=train_steps, steps_per_loop=2, global_batch_size=16,
                            checkpoint_every=2, eval_steps=1)


def test_gs_model_dir_and_data_save_restore_and_resume_exactly(gcs_env, tmp_path):
    local_data = write_records(tmp_path / "data")
    gs_data = [f"gs://{BUCKET}/data/{path.rsplit('/', 1)[1]}" for path in local_data]
    for local, remote in zip(local_data, gs_data):
        tf.io.gfile.copy(local, remote)
    pattern = f"gs://{BUCKET}/data/train-*.tfrecord"
    model_dir = f"gs://{BUCKET}/runs/resume"

    first = make_trainer(model_dir, pattern, train_steps=4)
    first.train()
    checkpoints = tf.io.gfile.glob(f"{model_dir}/checkpoints/ckpt-*.index")
    assert sorted(p.rsplit("/", 1)[1] for p in checkpoints) == ["ckpt-2.index", "ckpt-4.index"]
    assert tf.io.gfile.glob(f"{model_dir}/train/events.*"), "summaries on gs:// too"

    resumed = make_trainer(model_dir, pattern, train_steps=6)
    resumed.train()
    assert int(resumed.step.numpy()) == 6
    assert tf.train.latest_checkpoint(f"{model_dir}/checkpoints").endswith("ckpt-6")

    reference = make_trainer(str(tmp_path / "reference"), str(tmp_path / "data" / "train-*"),
                             train_steps=6)
    reference.train()
    for a, b in zip(weights(reference), weights(resumed)):
        np.testing.assert_array_equal(a, b)


def test_missing_bucket_is_named_before_training(gcs_env, tmp_path):
    with pytest.raises(BucketError, match=r"bucket gs://no-such-bucket does not exist: create it"):
        write_records(tmp_path / "data")
        make_trainer("gs://no-such-bucket/run", str(tmp_path / "data" / "train-*"), 2)


def test_bucket_check_writes_and_removes_a_probe(gcs_env):
    check_bucket_writable(f"gs://{BUCKET}/runs/probe")
    assert not tf.io.gfile.glob(f"gs://{BUCKET}/runs/probe/.tputrain-write-test-*")


def test_split_gs_path():
    assert split_gs_path("gs://b/x/y/") == ("b", "x/y")
    with pytest.raises(ValueError, match="gs://BUCKET/path"):
        split_gs_path("gs:///x")
