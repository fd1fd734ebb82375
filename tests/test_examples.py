"""Every script in examples/ runs (kept small)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.slow


def run_example(name, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_custom_task_trains_on_two_replicas_in_bfloat16(tmp_path):
    result = run_example("custom_task.py", f"--model_dir={tmp_path}", "--train_steps=300")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = re.search(r"replicas=(\d+) precision=(\S+) compute_dtype=(\S+) accuracy=([0-9.]+)",
                        result.stdout)
    assert summary, result.stdout
    replicas, precision, compute_dtype, accuracy = summary.groups()
    assert (int(replicas), precision, compute_dtype) == (2, "mixed_bfloat16", "bfloat16")
    assert float(accuracy) > 0.8  # 4 well-separated clusters; chance is 0.25
