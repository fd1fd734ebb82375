"""One run per model_dir: a second process is refused by name; kill -9 frees the lock."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from faults import Process, child_env
from tputrain.fault_tolerance.lock import LOCK_FILE, ModelDirInUseError, lock_model_dir, release_model_dir

HOLDER = textwrap.dedent("""
    import sys
    from tputrain.fault_tolerance.lock import lock_model_dir
    lock_model_dir(sys.argv[1])
    print("holding", flush=True)
    sys.stdin.readline()
""")


def _holder(model_dir) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(model_dir)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=child_env())
    assert process.stdout.readline().strip() == "holding"
    return process


def test_a_second_process_is_refused_naming_the_first(tmp_path):
    holder = _holder(tmp_path / "model")
    try:
        with pytest.raises(ModelDirInUseError) as caught:
            lock_model_dir(str(tmp_path / "model"))
        message = str(caught.value)
        assert f"in use by pid {holder.pid}" in message and "choose another --model_dir" in message
    finally:
        holder.kill()
        holder.wait()


def test_kill_9_of_the_holder_frees_the_lock(tmp_path):
    holder = _holder(tmp_path / "model")
    holder.send_signal(signal.SIGKILL)
    assert holder.wait() == -signal.SIGKILL
    lock_model_dir(str(tmp_path / "model"))  # no stale lock to clean up
    try:
        assert f'"pid": {os.getpid()}' in (tmp_path / "model" / LOCK_FILE).read_text()
    finally:
        release_model_dir(str(tmp_path / "model"))


def test_the_same_process_may_lock_again(tmp_path):
    lock_model_dir(str(tmp_path / "model"))
    try:
        lock_model_dir(str(tmp_path / "model"))  # a second Trainer in a notebook
    finally:
        release_model_dir(str(tmp_path / "model"))
    holder = _holder(tmp_path / "model")  # released: another process may take it
    holder.kill()
    holder.wait()


def test_a_lock_on_a_deleted_model_dir_protects_nothing(tmp_path):
    """The directory was removed and made again (a notebook starting over): the old
    lock is on a file that is gone, so another process could take the new one."""
    lock_model_dir(str(tmp_path / "model"))
    shutil.rmtree(tmp_path / "model")
    holder = _holder(tmp_path / "model")
    try:
        with pytest.raises(ModelDirInUseError, match=f"in use by pid {holder.pid}"):
            lock_model_dir(str(tmp_path / "model"))
    finally:
        holder.kill()
        holder.wait()
    lock_model_dir(str(tmp_path / "model"))
    release_model_dir(str(tmp_path / "model"))


def test_a_model_dir_that_cannot_be_made_is_left_to_preflight(tmp_path):
    """No lock error for a bad path: pre-flight is what names the problem and the fix."""
    (tmp_path / "file").write_text("not a directory")
    lock_model_dir(str(tmp_path / "file"))
    lock_model_dir(str(tmp_path / "file" / "model"))
    assert (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.slow
def test_two_cli_runs_on_one_model_dir(tmp_path):
    """Issue 10.7: both ran and both exited 0, interleaving their checkpoints."""
    def command(steps: int) -> list[str]:
        return [sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
                f"--model_dir={tmp_path / 'model'}", f"--gin_param=Trainer.train_steps={steps}",
                "--gin_param=Trainer.steps_per_loop=10"]

    env = dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))
    first = Process(command(100_000), env)
    try:
        first.wait_for(r"tputrain: training from step")
        second = subprocess.run(command(20), env=env, capture_output=True, text=True,
                                timeout=240)
        assert second.returncode == 2, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("tputrain: error: model_dir") and \
            f"in use by pid {first.process.pid}" in last and "-m tputrain.run" in last, last
    finally:
        assert first.kill(signal.SIGTERM) == 42, first.log()


def test_a_folder_that_cannot_be_locked_is_named_in_the_warning(tmp_path, caplog):
    """`tputrain eval` locks model_dir/eval: a lock file that cannot be made said "model_dir
    is not locked against a second run", naming neither the folder nor the right run."""
    folder = tmp_path / "run" / "eval"
    folder.mkdir(parents=True)
    (folder / LOCK_FILE).mkdir()  # a lock "file" that is a folder cannot be opened
    with caplog.at_level("WARNING"):
        lock_model_dir(str(folder))
    said = [r.getMessage() for r in caplog.records if "not locked" in r.getMessage()]
    assert len(said) == 1 and f"{folder} is not locked against a second process" in said[0], said
