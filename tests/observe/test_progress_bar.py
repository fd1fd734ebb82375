"""The live progress bar (tputrain/observe/progress_bar.py): in place on a terminal and in a
Jupyter kernel, updated inside a loop (between its lines), and the plain lines
alone where the output is a file; chosen by `Trainer.progress_bar`."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults import child_env
from tputrain.observe import progress_bar

SUPPORT = Path(__file__).resolve().parents[1] / "support"
# A run of 2 loops of 20 steps whose input waits for a file at its 15th batch (counting
# the Trainer's probe of the pipeline): the first loop's line cannot be printed before
# the file exists, so a bar showing a step from 1 to 19 was drawn inside the loop.
GATED_RUN = """
import os, sys, time
import tputrain
import tensorflow as tf
from tiny import TinyTask, strategy_for


class Gated(TinyTask):
    def build_inputs(self, split, input_context):
        dataset = super().build_inputs(split, input_context)
        if split != "train":
            return dataset
        count = [0]

        def gate(labels):
            count[0] += 1
            while count[0] == 15 and not os.path.exists(os.environ["GATE"]):
                time.sleep(0.05)  # the child's wait, released by the test
            return labels

        def gated(features, labels):
            labels = tf.py_function(gate, [labels], tf.int64)
            return features, tf.ensure_shape(labels, [16])
        return dataset.map(gated)


trainer = tputrain.Trainer(Gated(), sys.argv[1], strategy=strategy_for(1), train_steps=40,
                           steps_per_loop=20, global_batch_size=16, report_mfu=False,
                           jit_compile=False, progress_bar=sys.argv[2])
trainer.train()
print("tputrain-test: trained", flush=True)
"""


def _script(tmp_path) -> Path:
    script = tmp_path / "gated.py"
    script.write_text(GATED_RUN)
    return script


def _read_until(fd: int, pattern: str, seen: bytearray, timeout: float = 300) -> re.Match:
    """Reads the pty into `seen` until `pattern` is in it (bounded: a failure, not a wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, seen.decode(errors="replace"))
        if match:
            return match
        if not select.select([fd], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen.extend(chunk)
    raise AssertionError(f"no {pattern!r} on the terminal:\n{seen.decode(errors='replace')[-3000:]}")


def _terminal_env(**extra: str) -> dict[str, str]:
    """A person's terminal: not a CI job (a CI variable turns "auto" off), a real TERM."""
    env = dict(child_env(), TERM="xterm", **extra)
    env.pop("CI", None)
    return env


def test_a_terminal_gets_a_bar_updated_inside_a_loop_and_the_lines_above_it(tmp_path):
    gate = tmp_path / "gate"
    primary, secondary = pty.openpty()
    child = subprocess.Popen([sys.executable, str(_script(tmp_path)), str(tmp_path / "run"),
                              "auto"], stdin=secondary, stdout=secondary, stderr=secondary,
                             env=_terminal_env(GATE=str(gate), COLUMNS="120"))
    os.close(secondary)
    seen = bytearray()
    try:
        # Inside the first loop, blocked on its input: the bar shows a step short of 20.
        _read_until(primary, r"\rstep (1?[1-9]|10)/40 ", seen)
        assert "tputrain: step 20/40" not in seen.decode(errors="replace")
        gate.touch()
        _read_until(primary, r"tputrain-test: trained", seen)
    finally:
        gate.touch()  # a failed wait above must not leave the child blocked on its input
        try:
            child.wait(timeout=300)
        finally:
            child.kill()
            os.close(primary)
    text = seen.decode(errors="replace")
    assert child.returncode == 0, text[-3000:]
    # What the terminal shows: the bar is cleared (a carriage return, blanks and
    # another), then each plain loop line starts at the left of a line of its own.
    segments = [part.strip() for part in re.split(r"[\r\n]+", text)]
    assert any(s.startswith("tputrain: step 20/40 | loss") for s in segments), text[-3000:]
    assert any(s.startswith("tputrain: step 40/40 | loss") for s in segments), text[-3000:]
    # The bar: in place (carriage returns), with the step, a rate and an ETA.
    bars = [part for part in text.split("\r") if re.search(r"step \d+/40", part)]
    assert any(re.search(r"40/40 .*(step/s|s/step)", bar) for bar in bars), bars[-5:]
    assert any(re.search(r"\d+/40 .*<\d\d:\d\d", bar) for bar in bars), bars[-5:]  # ETA


def test_output_to_a_file_gets_the_plain_lines_only(tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, str(_script(tmp_path)), str(tmp_path / "run"),
                               "auto"], stdout=out, stderr=subprocess.STDOUT,
                              env=dict(child_env(), GATE=str(gate)), timeout=300)
    with open(log, newline="") as logged:  # carriage returns kept
        text = logged.read()
    assert done.returncode == 0, text[-3000:]
    assert "\r" not in text and "step/s" not in text, text[-3000:]
    assert re.search(r"^tputrain: step 40/40 \| loss", text, re.M), text[-3000:]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_setting_chooses_the_bar(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert progress_bar.wanted("auto", _Terminal())
    assert not progress_bar.wanted("auto", io.StringIO())  # a file, a pipe: plain lines
    assert progress_bar.wanted("on", io.StringIO())
    assert not progress_bar.wanted("off", _Terminal())
    monkeypatch.setenv("TERM", "dumb")
    assert not progress_bar.wanted("auto", _Terminal())
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("CI", "true")  # CI logs are files, whatever they pretend
    assert not progress_bar.wanted("auto", _Terminal())
    with pytest.raises(ValueError, match="progress_bar must be 'auto', 'on' or 'off'"):
        progress_bar.check_setting("yes")


NOTEBOOK_CELL = """
import os, sys
sys.path.insert(0, {tests!r})
sys.argv = ["gated", {model_dir!r}, "auto"]
os.environ["GATE"] = {gate!r}
exec(open({script!r}).read())
"""


@pytest.mark.slow  # a Jupyter kernel and a training run in it
def test_a_jupyter_kernel_gets_the_bar(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    gate = tmp_path / "gate"
    gate.touch()
    cell = NOTEBOOK_CELL.format(tests=str(SUPPORT), model_dir=str(tmp_path / "run"),
                                gate=str(gate), script=str(_script(tmp_path)))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    segments = [part.strip() for part in re.split(r"[\r\n]+", text)]
    assert any(s.startswith("tputrain: step 40/40 | loss") for s in segments), text[-3000:]
    bars = [part for part in text.split("\r") if re.search(r"step \d+/40", part)]
    assert any(re.search(r"40/40 .*(step/s|s/step)", bar) for bar in bars), text[-3000:]


TINY_GIN = """
Trainer.task = @FaultTask()
FaultTask.dropout = 0.0
Trainer.train_steps = 4
Trainer.steps_per_loop = 2
Trainer.global_batch_size = 16
Trainer.report_mfu = False
"""


@pytest.mark.slow  # a CLI run
def test_the_cli_flag_turns_the_bar_on_where_auto_would_not(tmp_path):
    config = tmp_path / "tiny.gin"
    config.write_text(TINY_GIN)
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "tputrain.cli", "run", "--gin_import=faults",
                               f"--gin_file={config}", f"--model_dir={tmp_path / 'run'}",
                               "--progress_bar=on"], stdout=out, stderr=subprocess.STDOUT,
                              env=child_env(), timeout=300)
    with open(log, newline="") as logged:  # carriage returns kept
        text = logged.read()
    assert done.returncode == 0, text[-3000:]
    assert re.search(r"\rstep 4/4 .*(step/s|s/step)", text), text[-3000:]
    bad = subprocess.run([sys.executable, "-m", "tputrain.cli", "run", "--progress_bar=yes"],
                         capture_output=True, text=True, env=child_env(), timeout=300)
    assert bad.returncode != 0 and "progress_bar" in bad.stderr, bad.stderr[-2000:]
