"""Multi-worker for real: `tputrain launch --workers 2` on 127.0.0.1, MultiWorkerMirrored.

The workers run inside a private network namespace (`unshare -rn`, loopback
only) when the kernel allows it, because TF's gRPC servers listen on every
interface. Each launch costs ~30-45 s here (three TF imports on 2 cores).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf

from faults import (STARTUP_HOLD, FaultTask, Process, child_env,
                    sigterm_while_importing)
from events import train_scalars
from processes import Launch, in_netns, listed_steps
from tiny import model_bytes
from tputrain.cli.launch import parse_args
from tputrain.distribution.launch import Launcher, tf_configs

CONFIG = """
Trainer.task = @FaultTask()
Trainer.train_steps = 100000
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.checkpoint_every = 4
Trainer.eval_steps = 1
Trainer.report_mfu = False  # skips tracing the step to count FLOPs
FaultTask.dropout = 0.3
"""


@pytest.mark.start_early(9)
@pytest.mark.slow
def test_two_workers_train_chief_checkpoints_fail_together_resume_and_preempt(tmp_path):
    config = tmp_path / "mw.gin"
    config.write_text(CONFIG)
    model_dir = tmp_path / "model"
    args = ["--workers", "2", "--peer_exit_timeout", "90", "--gin_import=faults",
            f"--gin_file={config}", f"--model_dir={model_dir}"]

    # The non-chief's scratch directory (tempfile's, under TMPDIR): never in the log
    # (issue 52), deleted at its end.
    temp = tmp_path / "temp"
    temp.mkdir()

    # 1. Train until the chief has a checkpoint, then SIGKILL worker 1.
    launch = Launch(args, TMPDIR=str(temp))
    pids = launch.wait_for(r"worker 0 pid (\d+), worker 1 pid (\d+)")
    launch.wait_for(rf"\[worker 0\] .*saved checkpoint {re.escape(str(model_dir))}/checkpoints/ckpt-\d+")
    launch.wait_for(r"\[worker 1\] .*saving checkpoint at step \d+")
    (scratch,) = temp.glob("tputrain-worker-*")
    assert (scratch / "checkpoints").is_dir(), "the non-chief writes its part there"
    os.kill(int(pids.group(2)), signal.SIGKILL)
    code = launch.finish(timeout=150)
    text = launch.text()
    assert code != 0, text[-3000:]
    # Worker 0 noticed the lost peer and exited non-zero by itself (TF's heartbeats),
    # before the launcher stopped it (which it does after --peer_exit_timeout, saying so).
    assert "workers exited with worker 0: code 1, worker 1: signal SIGKILL" in text, text[-3000:]
    assert "stopping worker(s)" not in text
    assert "[worker 0] tputrain: error: lost a worker" in text
    assert "tputrain-worker-" not in text
    shutil.rmtree(scratch, ignore_errors=True)  # a SIGKILLed worker cannot clean up

    # 2. Rerun the same command: both workers resume from the chief's latest
    #    checkpoint. Then SIGTERM the launcher: it reaches both workers, which agree
    #    on a step (all-reduce at the loop boundary), checkpoint it and exit 42.
    resume_step = listed_steps(model_dir)[-1]
    launch = Launch(args, TMPDIR=str(temp))
    launch.wait_for(r"\[worker \d\] .*tputrain: step \d+/")  # both train (collectives)
    launch.process.send_signal(signal.SIGTERM)
    code = launch.finish(timeout=240)
    text = launch.text()
    assert code == 42, text[-3000:]
    for worker in (0, 1):
        assert re.search(rf"\[worker {worker}\] .*restored \S+/model/checkpoints/ckpt-{resume_step} ",
                         text), text[-3000:]
    stopped = {int(w): int(s) for w, s in
               re.findall(r"\[worker (\d)\] .*preempted at step (\d+); saved", text)}
    assert set(stopped) == {0, 1} and stopped[0] == stopped[1] > resume_step, stopped
    assert listed_steps(model_dir)[-1] == stopped[0]
    assert "workers exited with worker 0: code 42, worker 1: code 42" in text
    # TensorFlow's multi-worker chatter (issue 52): tputrain's lines say it once.
    assert not re.findall(r".*(?:Collective all_reduce|Check health not enabled|"
                          r"assert_op\.cc|Gather to ).*", text)
    assert tf.io.gfile.glob(str(model_dir / "train" / "events.*")), "the chief wrote summaries"
    # Each loop's all-reduce: the model's float32 bytes, and its share of the loop, in
    # [0, 1] (a measured all-reduce that drowns in a busy host's noise counts 0).
    scalars = train_scalars(model_dir)
    assert set(scalars["comm/gradient_bytes"]) == {model_bytes(FaultTask())}, scalars
    shares = scalars["comm/allreduce_fraction"]
    assert len(shares) == len(scalars["steps_per_second"]), scalars  # every loop
    assert all(0 <= share <= 1 for share in shares), scalars
    assert "tputrain-worker-" not in text
    assert not list(temp.glob("tputrain-worker-*")), "the non-chief deletes its scratch directory"


@pytest.mark.slow
def test_a_worker_that_never_joins_is_named_after_the_timeout(tmp_path):
    config = tmp_path / "mw.gin"
    config.write_text(CONFIG)
    model_dir = tmp_path / "model"
    tf_config = tf_configs(2)[0]
    missing = json.loads(tf_config)["cluster"]["worker"][1]
    env = dict(child_env(), TF_CONFIG=tf_config)
    command = in_netns([sys.executable, "-m", "tputrain.run", "--gin_import=faults",
                        f"--gin_file={config}", f"--model_dir={model_dir}",
                        "--gin_param=join_watchdog.timeout=3"])
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"worker 1 ({missing}) did not join within 3 s" in result.stderr
    assert "raise join_watchdog.timeout" in result.stderr
    assert not model_dir.exists()


def test_launcher_arguments_pass_through_to_the_workers():
    args, rest = parse_args(["--workers", "3", "--gin_file=a.gin", "--model_dir=/m",
                             "--gin_param=Trainer.train_steps=5"])
    assert args.workers == 3
    assert rest == ["--gin_file=a.gin", "--model_dir=/m", "--gin_param=Trainer.train_steps=5"]
    configs = [json.loads(c) for c in tf_configs(3)]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        Launcher(0, [])


def test_launcher_exit_code_rules(tmp_path):
    """0 if all succeed, 42 if all were preempted, else the first failure's code."""
    def run(codes):
        script = "import sys; sys.exit(int(sys.argv[-1]))"
        launcher = Launcher(len(codes), [], peer_exit_timeout=5)
        launcher.processes = [subprocess.Popen([sys.executable, "-c", script, str(c)])
                              for c in codes]
        return launcher.wait()

    assert run([0, 0]) == 0
    assert run([42, 42]) == 42
    assert run([0, 3]) == 3



def test_a_death_by_the_signal_the_launcher_got_or_forwarded_is_a_preemption():
    """Ctrl-C reaches every process of the terminal's group: a worker still starting
    dies by that SIGINT, another by the SIGTERM the launcher forwards; both were
    preempted (it exited 1). A SIGKILL stays a failure."""
    def run(own_signal: int) -> int:
        script = ("import os, signal; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.kill(os.getpid(), int(os.sys.argv[-1]))")
        launcher = Launcher(2, [], peer_exit_timeout=5)
        launcher.processes = [
            subprocess.Popen([sys.executable, "-c", script, str(int(own_signal))]),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])]
        launcher.processes[0].wait()  # dead before the launcher forwards
        launcher.forward(signal.SIGTERM, received=signal.SIGINT)
        return launcher.wait()

    assert run(signal.SIGINT) == 42
    assert run(signal.SIGKILL) == 1

_PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans(on: bool) -> None:
    """Makes this process the parent of orphaned descendants (Linux), so their exit
    codes can be waited for once their parent, the launcher, is gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


def _exit_codes(pidfds: dict[int, int], timeout: float) -> dict[int, int | None]:
    """Exit code of each adopted pid, None for one still running after `timeout` s."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    for pid, pidfd in pidfds.items():
        ready, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) if ready else None
        os.close(pidfd)
    return codes


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")
def test_kill_9_of_the_launcher_stops_its_workers(tmp_path):
    """Issue 10.6: the workers trained on, headless, to the end. They now see the
    launcher's pipe close and take it as a preemption: checkpoint, exit 42."""
    config = tmp_path / "mw.gin"
    config.write_text(CONFIG)
    model_dir = tmp_path / "model"
    pids: list[int] = []
    codes: dict[int, int | None] = {}
    _adopt_orphans(True)
    try:
        launch = Launch(["--workers", "2", "--gin_import=faults", f"--gin_file={config}",
                         f"--model_dir={model_dir}"])
        pids = [int(p) for p in
                launch.wait_for(r"worker 0 pid (\d+), worker 1 pid (\d+)").groups()]
        pidfds = {pid: os.pidfd_open(pid) for pid in pids}  # before any pid can be reused
        launch.wait_for(r"\[worker \d\] .*tputrain: step \d+/")  # both are in the loop
        launch.process.send_signal(signal.SIGKILL)
        launch.finish(timeout=60)
        # The workers' own bound is 60 s after the launcher's death, then exit 1.
        codes = _exit_codes(pidfds, timeout=120)
    finally:
        for pid in pids:
            if codes.get(pid) is None:  # never leave one training (and reap it if ours)
                with contextlib.suppress(ProcessLookupError, ChildProcessError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        _adopt_orphans(False)
    assert list(codes.values()) == [42, 42], f"worker exit codes {codes} (None: still running)"
    assert listed_steps(model_dir), "the chief checkpointed before exiting"


@pytest.mark.parametrize("workers", ["0", "-2", "two"])
def test_a_bad_worker_count_is_one_line_and_exit_2(workers, capsys):
    """Issue 33.6: --workers 0 or -2 gave a ValueError traceback from Launcher."""
    with pytest.raises(SystemExit) as caught:
        parse_args(["--workers", workers, "--gin_file=a.gin"])
    error = capsys.readouterr().err
    assert caught.value.code == 2
    assert error.count("\n") == 1 and error.startswith("tputrain launch: error: argument "
                                                      "--workers"), error




def _held_launch(tmp_path, workers: int, *flags: str) -> tuple[Launch, dict[int, int]]:
    """`tputrain launch` whose workers are held at interpreter start-up, before any
    handler of theirs (tests/support/startup_hold); returns it once every worker is
    held, with their pids by worker index."""
    launch = Launch(["--workers", str(workers), "--gin_file=digits.gin",
                     f"--model_dir={tmp_path / 'model'}", *flags], TPUTRAIN_TEST_HOLD="startup",
                    PYTHONPATH=os.pathsep.join([str(STARTUP_HOLD), child_env()["PYTHONPATH"]]))
    held = [launch.wait_for(r"\[worker (\d)\] tputrain-test: held at start-up \(pid (\d+)\)")
            for _ in range(workers)]
    return launch, {int(match.group(1)): int(match.group(2)) for match in held}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_to_the_launcher_while_its_workers_start_exits_42(tmp_path, signum):
    """Issue (tryout 2, #5): the workers, still starting, died by the SIGTERM the launcher
    forwarded, and the launcher exited 1 ("training failed") for a preemption. Its last
    line names the signal it was sent (Ctrl-C: SIGINT), not the one it forwards."""
    launch, _ = _held_launch(tmp_path, 2)
    code = launch.kill(signum)
    assert code == 42, launch.log()
    assert launch.text().strip().splitlines()[-1] == (
        f"tputrain launch: preempted ({signal.Signals(signum).name}): rerun the same command "
        "to resume (exit code 42)")


def test_a_worker_killed_by_a_signal_the_launcher_did_not_send_is_a_failure(tmp_path):
    """A SIGKILL from outside is a failure (1), and so stays the SIGTERM the launcher
    sends a peer still running after --peer_exit_timeout: only a signal the launcher
    was sent and forwarded means a preemption."""
    launch, pids = _held_launch(tmp_path, 2, "--peer_exit_timeout=0")
    os.kill(pids[0], signal.SIGKILL)
    code = launch.finish(timeout=120)
    assert code == 1, launch.log()
    assert "worker 0: signal SIGKILL, worker 1: signal SIGTERM" in launch.text()


def test_sigterm_to_the_launcher_before_it_starts_workers_exits_42(tmp_path):
    """It died by it (-15, 143 in a shell) until its handler was installed, after its
    imports; it is held from the command's first line. The launcher is held in its
    import of the Launcher (tests/support/startup_hold) until the test has signalled it."""
    launch = sigterm_while_importing(
        ["launch", "--workers", "2", "--gin_file=digits.gin", f"--model_dir={tmp_path / 'model'}"],
        module="tputrain.distribution.launch")
    assert launch.code == 42, launch.log()
    assert launch.text().strip().splitlines()[-1] == (
        "tputrain launch: signal 15 before the workers started; nothing to save: rerun the "
        "same command to resume (exit code 42)")


_LAUNCH_PROBE = """
import sys
from tputrain.cli import main
from tputrain.distribution.launch import Launcher

def start(self):
    print("TENSORFLOW AT START", "tensorflow" in sys.modules, flush=True)
    sys.exit(0)

Launcher.start = start
sys.argv = ["tputrain", "launch", "--workers", "2", "--gin_file=digits.gin"]
main.console_main()
"""


def test_the_launcher_starts_its_workers_without_importing_tensorflow():
    """The workers import TensorFlow; the launcher only starts them, forwards signals
    and waits. It imported TensorFlow (for the number 42): seconds of start-up and
    hundreds of MB before any worker started."""
    result = subprocess.run([sys.executable, "-c", _LAUNCH_PROBE], capture_output=True,
                            text=True, timeout=120, env=child_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TENSORFLOW AT START False" in result.stdout, result.stdout
