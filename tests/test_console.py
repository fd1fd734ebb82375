"""A plain Python script shows progress on stderr, as the CLI does, and can be silenced."""

import subprocess
import sys
import textwrap
from pathlib import Path

from faults import child_env

TESTS = Path(__file__).parent

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import tputrain
    from tiny import TinyTask
    if sys.argv[2] == "quiet":
        tputrain.show_progress(False)
    trainer = tputrain.Trainer(TinyTask(), sys.argv[1], train_steps=4, steps_per_loop=2,
                               global_batch_size=16, eval_steps=2, report_mfu=False)
    trainer.train()
""")


def run_script(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    result = subprocess.run([sys.executable, str(script), str(tmp_path / mode), mode],
                            capture_output=True, text=True, env=child_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if "tputrain:" in line]


def test_a_plain_script_shows_progress_without_absl_prefixes(tmp_path):
    lines = run_script(tmp_path, "loud")
    assert any(line.startswith("tputrain: OneDeviceStrategy") for line in lines), lines
    assert [line for line in lines if line.startswith("tputrain: step ")][-1].startswith(
        "tputrain: step 4/4 | loss ")
    assert any(line.startswith("tputrain: eval at step 4 | loss ") for line in lines), lines
    assert all(line.startswith("tputrain:") for line in lines), lines  # no "I1123 ..." prefix


def test_show_progress_false_silences_it(tmp_path):
    assert run_script(tmp_path, "quiet") == []


def test_tensorflow_start_up_noise_is_filtered_and_real_errors_kept():
    from tputrain.console import _filter_startup

    text = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
            "I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.\n"
            "I0000 00:00:1.1 1 cudart_stub.cc:31] Could not find cuda drivers on your machine\n"
            "I0000 00:00:2.0 1 port.cc:153] oneDNN custom operations are on.\n"
            "E0000 00:00:3.0 1 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n"
            "E0000 00:00:3.1 1 something.cc:1] a real error\n")
    assert _filter_startup(text) == ("I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.\n"
                                     "E0000 00:00:3.1 1 something.cc:1] a real error\n")
    # With a driver installed, a failing cuInit is a real problem: kept.
    assert "cuInit" in _filter_startup("E0000 1 cuda_platform.cc:52] failed call to cuInit: x\n")


def test_importing_tputrain_prints_no_error_level_line():
    result = subprocess.run([sys.executable, "-c", "import tputrain"], capture_output=True,
                            text=True, env=child_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("E")], result.stderr
