"""A real `mlflow server` on 127.0.0.1 for the tracker tests (a file store beside it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` in its own process group (it starts a uvicorn child): `kill()`
    ends them all, as a crashed tracking server."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true")
        self.log = open(root / "mlflow-server.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"file://{root / 'store'}",
             "--artifacts-destination", str(root / "artifacts")],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> str:
        """Waits until /health answers (what the server guarantees once it serves)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "mlflow server ended at start-up"
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self.uri
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"mlflow server did not answer within {timeout} s")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.log.close()
