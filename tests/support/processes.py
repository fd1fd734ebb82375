"""Multi-worker processes for the tests: `tputrain launch` in a private network namespace."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import tensorflow as tf

from faults import Process, child_env


def _netns_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"],
                           capture_output=True)
    return probe.returncode == 0


NETNS = _netns_works()


def in_netns(command: list[str]) -> list[str]:
    """`command` in a private network namespace with only loopback (if available):
    TF's gRPC servers listen on every interface."""
    if not NETNS:
        return command
    return ["unshare", "-rn", "sh", "-c", "ip link set lo up && exec " + shlex.join(command)]


class Launch(Process):
    """A `tputrain launch` process in the private network namespace."""

    def __init__(self, args: list[str], **env_vars: str):
        super().__init__(in_netns([sys.executable, "-m", "tputrain.run", "launch", *args]),
                         {**child_env(), **env_vars})


def listed_steps(model_dir: Path) -> list[int]:
    """The steps of the checkpoints the state file lists."""
    state = tf.train.get_checkpoint_state(str(model_dir / "checkpoints"))
    return sorted(int(p.rsplit("-", 1)[1]) for p in state.all_model_checkpoint_paths) if state else []


def launched(config: Path, model_dir: Path, workers: int = 2, timeout: int = 300) -> str:
    """The output of `tputrain launch` of `config` (with tests/support/faults.py importable) on
    `workers` workers, asserted to have exited 0."""
    launch = Launch(["--workers", str(workers), "--gin_import=faults", f"--gin_file={config}",
                     f"--model_dir={model_dir}"])
    code = launch.finish(timeout=timeout)
    text = launch.text()
    assert code == 0, text[-4000:]
    return text
