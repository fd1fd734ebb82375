"""The CLI end to end, as a user runs it: train, rerun, continue, SIGKILL and resume."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _env(tmp_path):
    env = dict(os.environ, TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return env


def run_cli(tmp_path, *args, timeout=240):
    command = [sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
               f"--model_dir={tmp_path / 'model'}", *args]
    result = subprocess.run(command, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=timeout, cwd=tmp_path)
    return result


def restored_step(log: str) -> int | None:
    match = re.search(r"restored .*ckpt-\d+ \(step (\d+)\)", log)
    return int(match.group(1)) if match else None


def listed_step(checkpoints) -> int | None:
    """The newest step the `checkpoint` state file lists (None before the first save)."""
    try:
        text = (checkpoints / "checkpoint").read_text()
    except FileNotFoundError:
        return None
    match = re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', text, re.M)
    return int(match.group(1)) if match else None


def final_accuracy(log: str) -> float:
    return float(re.findall(r"done at step \d+: .*accuracy ([0-9.]+)", log)[-1])


@pytest.mark.same_worker("readme_digits")
@pytest.mark.start_early(5)
def test_digits_trains_reruns_and_continues(tmp_path, readme_digits):
    # `readme_digits` (conftest): README command 1 run once, also served by test_export.py.
    root, first = readme_digits
    assert first.returncode == 0, first.stderr[-3000:]
    assert re.search(r"step 100/1200 \| loss [0-9.]+ \| accuracy .* examples/s .* ETA", first.stderr)
    assert final_accuracy(first.stderr) >= 0.95
    model_dir = root / "model"
    assert (model_dir / "operative_config.gin").read_text().count("DigitsTask.") >= 3
    assert list((model_dir / "checkpoints").glob("ckpt-1200.index"))
    assert list((model_dir / "train").glob("events.out.tfevents.*"))
    assert list((model_dir / "eval").glob("events.out.tfevents.*"))

    # Rerun and continue in a byte-for-byte copy (model/ and cache/): test_export.py
    # reads the first run's export/1200 in the original.
    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    again = run_cli(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert restored_step(again.stderr) == 1200
    assert "nothing to train" in again.stderr
    assert "step 1300" not in again.stderr

    # A rerun below the checkpoint's step trains nothing and keeps the config of the
    # run that made the checkpoints (passing it back reruns that run).
    operative = (tmp_path / "model" / "operative_config.gin").read_text()
    below = run_cli(tmp_path, "--gin_param=Trainer.train_steps=800")
    assert below.returncode == 0 and "nothing to train" in below.stderr, below.stderr[-3000:]
    assert (tmp_path / "model" / "operative_config.gin").read_text() == operative

    more = run_cli(tmp_path, "--gin_param=Trainer.train_steps=1400")
    assert more.returncode == 0, more.stderr[-3000:]
    assert restored_step(more.stderr) == 1200
    assert "step 1300/1400" in more.stderr and "step 1400/1400" in more.stderr
    assert "step 100/" not in more.stderr


@pytest.mark.start_early(7)
def test_sigkill_midway_resumes_from_latest_checkpoint(tmp_path):
    command = [sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
               f"--model_dir={tmp_path / 'model'}", "--gin_param=Trainer.steps_per_loop=20",
               "--gin_param=Trainer.checkpoint_every=100", "--gin_param=Trainer.train_steps=3000"]
    process = subprocess.Popen(command, env=_env(tmp_path), cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = tmp_path / "model" / "checkpoints"
    deadline = time.time() + 180
    # Wait on what the code guarantees: the state file (rewritten atomically after a
    # save completes) lists step >= 300. An index file can appear before it is listed.
    while time.time() < deadline and (listed_step(checkpoints) or 0) < 300:
        assert process.poll() is None, "training ended before it could be killed"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL

    resumed = run_cli(tmp_path, "--gin_param=Trainer.train_steps=3000",
                      "--gin_param=Trainer.checkpoint_every=100")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    step = restored_step(resumed.stderr)
    assert step is not None and step >= 300
    assert f"training from step {step} to 3000" in resumed.stderr


def test_gin_typo_fails_fast_with_suggestion(tmp_path):
    result = run_cli(tmp_path, "--gin_param=Trainer.train_step=5", timeout=120)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tputrain: error:") and "did you mean 'train_steps'" in last
    assert not (tmp_path / "model").exists()


def test_console_script_matches_module(tmp_path):
    """`tputrain --help` is the same program as `python -m tputrain.run --help`."""
    # The script installed beside this interpreter (a venv's bin/ need not be on PATH).
    executable = os.path.join(os.path.dirname(sys.executable), "tputrain")
    script = subprocess.run([executable, "--helpshort"], capture_output=True, text=True,
                            env=_env(tmp_path), timeout=120)
    module = subprocess.run([sys.executable, "-m", "tputrain.run", "--helpshort"],
                            capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert script.returncode == module.returncode  # absl's --help exits 1 by design
    for flag in ("--gin_file", "--gin_param", "--gin_search_path", "--gin_import", "--model_dir"):
        assert flag in script.stdout and flag in module.stdout


def test_sigterm_before_training_exits_42(tmp_path):
    """Issue 10.8: a SIGTERM while the Trainer is being built exited -15."""
    from faults import Process, child_env

    process = Process([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                       "--gin_file=digits.gin", "--gin_param=Trainer.task=@StallingTask()",
                       f"--model_dir={tmp_path / 'model'}"],
                      dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache")))
    process.wait_for("tputrain-test: building the model")
    assert process.kill(signal.SIGTERM) == 42, process.log()
    assert "before training started; nothing to save" in process.text()


def test_corrupt_data_found_mid_run_exits_1(tmp_path):
    """Issue 10.8: exit codes say 1 for corrupt data found mid-run (it exited 2, the code
    for bad input found before training)."""
    import numpy as np

    import tputrain
    from faults import child_env

    x = np.random.RandomState(0).randn(256, 8).astype(np.float32)
    files = tputrain.data.write_tfrecords({"x": x, "label": (x[:, 0] > 0).astype(np.int64)},
                                          str(tmp_path / "data" / "train"), num_shards=1)
    data = bytearray(open(files[0], "rb").read())
    middle = len(data) * 3 // 4  # records 0-15 (the pre-flight batch) stay readable
    data[middle:middle + 64] = b"\xff" * 64
    open(files[0], "wb").write(bytes(data))
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.run", "--gin_import=faults", "--gin_file=digits.gin",
         f"--gin_param=Trainer.task=@RecordsTask()",
         f"--gin_param=RecordsTask.pattern='{tmp_path / 'data' / 'train-*'}'",
         f"--gin_param=RecordsTask.eval_pattern='{tmp_path / 'data' / 'train-*'}'",
         "--gin_param=Trainer.global_batch_size=16", "--gin_param=Trainer.steps_per_loop=4",
         "--gin_param=Trainer.eval_steps=1", f"--model_dir={tmp_path / 'model'}"],
        env=dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache")),
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tputrain: error:") and os.path.basename(files[0]) in last


def test_help_lists_the_commands_and_exits_0(tmp_path):
    """`tputrain --help` exited 1 and listed no subcommand; a subcommand's usage line
    said `.venv/bin/tputrain [flags]`."""
    executable = os.path.join(os.path.dirname(sys.executable), "tputrain")
    overview = subprocess.run([executable, "--help"], capture_output=True, text=True,
                              env=_env(tmp_path), timeout=60)
    assert overview.returncode == 0, overview.stderr[-2000:]
    for command in ("run", "launch", "diagnose", "audit-precision", "write-tfrecords",
                    "vertex-spec"):
        assert re.search(rf"^  {command} +\S", overview.stdout, re.M), overview.stdout
    diagnose = subprocess.run([executable, "diagnose", "--helpshort"], capture_output=True,
                              text=True, env=_env(tmp_path), timeout=120)
    assert "USAGE: tputrain diagnose [flags]" in diagnose.stdout, diagnose.stdout[:2000]
    assert "--gin_file" in diagnose.stdout
