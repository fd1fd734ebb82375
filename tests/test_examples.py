"""Every script in examples/ runs (kept small)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.slow


# TensorFlow's C++ lines ("W0000 ... assert_op.cc:39] ...") and E-level lines: an
# example run as a user runs it prints none (issue 52). (An absl app prints INFO lines
# with absl's prefix, tputrain's among them: those are the app's choice.)
TENSORFLOW_LINE = re.compile(r"^[IWEF]\d{4} .*\.cc:\d+\] |^E\d{4} |^ERROR")


def run_example(name, *args):
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # what a user sees
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env,
                            capture_output=True, text=True, timeout=300)
    # vertex_mlp_keras.py is the plain Keras script a migration starts from: no tputrain.
    if result.returncode == 0 and "import tputrain" in (EXAMPLES / name).read_text():
        theirs = [line for line in result.stderr.splitlines() if TENSORFLOW_LINE.search(line)]
        assert theirs == [], theirs
    return result


def test_custom_task_trains_on_two_replicas_in_bfloat16(tmp_path):
    result = run_example("custom_task.py", f"--model_dir={tmp_path}", "--train_steps=300")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = re.search(r"replicas=(\d+) precision=(\S+) compute_dtype=(\S+) accuracy=([0-9.]+)",
                        result.stdout)
    assert summary, result.stdout
    replicas, precision, compute_dtype, accuracy = summary.groups()
    assert (int(replicas), precision, compute_dtype) == (2, "mixed_bfloat16", "bfloat16")
    assert float(accuracy) > 0.8  # 4 well-separated clusters; chance is 0.25


def _summary(pattern, result):
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(pattern, result.stdout)
    assert match, result.stdout[-2000:]
    return match.groups()


def test_vertex_mlp_keras_starting_point_runs(tmp_path):
    """The plain-Keras script docs/migrating.md starts from (no tputrain)."""
    result = run_example("vertex_mlp_keras.py", f"--model_dir={tmp_path}", "--num_examples=512",
                         "--epochs=1", "--batch_size=64")
    (accuracy,) = _summary(r"replicas=1 loss=[0-9.]+ accuracy=([0-9.]+)", result)
    assert float(accuracy) > 0.5  # 10 separable clusters; chance is 0.1


def test_vertex_mlp_on_tputrain_trains_on_two_replicas(tmp_path):
    result = run_example("vertex_mlp.py", f"--model_dir={tmp_path}", "--num_examples=512",
                         "--global_batch_size=64", "--steps_per_loop=10", "--cpu_replicas=2",
                         "--train_steps=20")
    replicas, step, accuracy = _summary(
        r"replicas=(\d+) precision=float32 step=(\d+) loss=[0-9.]+ accuracy=([0-9.]+)", result)
    assert (int(replicas), int(step)) == (2, 20)
    assert float(accuracy) > 0.5  # 10 separable clusters; chance is 0.1
    assert len(list((tmp_path / "data").glob("train-*.tfrecord"))) == 8
    assert len(list((tmp_path / "checkpoints").glob("ckpt-20.index"))) == 1


def test_custom_train_step_logs_its_auxiliary_losses(tmp_path):
    result = run_example("custom_train_step.py", f"--model_dir={tmp_path}", "--train_steps=60")
    replicas, accuracy = _summary(r"replicas=(\d+) accuracy=([0-9.]+)", result)
    assert int(replicas) == 2
    assert float(accuracy) > 0.8  # 4 separated clusters; chance is 0.25
    losses = re.findall(r"step 60/60 \| loss ([0-9.e-]+) \| classification_loss ([0-9.e-]+) "
                        r"\| reconstruction_loss ([0-9.e-]+)", result.stderr)
    assert losses, result.stderr[-3000:]
    total, classification, reconstruction = map(float, losses[-1])
    # The step returns per-replica shares; the Trainer's sum over replicas is the mean.
    assert total == pytest.approx(classification + 0.5 * reconstruction, rel=1e-3)


def test_tfds_example_runs_under_mock_data(tmp_path):
    script = (
        "import runpy, sys\n"
        "import tensorflow_datasets as tfds\n"
        f"sys.argv = ['tfds_mnist.py', '--model_dir={tmp_path}', '--train_steps=20',\n"
        "            '--global_batch_size=16', '--steps_per_loop=10']\n"
        "with tfds.testing.mock_data(num_examples=64):\n"
        f"    runpy.run_path({str(EXAMPLES / 'tfds_mnist.py')!r}, run_name='__main__')\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    step, loss, accuracy = _summary(r"step=(\d+) loss=([0-9.]+) accuracy=([0-9.]+)", result)
    assert int(step) == 20
    assert (tmp_path / "checkpoints").is_dir()
