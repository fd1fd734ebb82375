"""A plain Python script shows progress on stderr, as the CLI does, and can be silenced."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from faults import child_env

SUPPORT = Path(__file__).resolve().parents[1] / "support"

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
    script.write_text(SCRIPT.format(tests=str(SUPPORT)))
    result = subprocess.run([sys.executable, str(script), str(tmp_path / mode), mode],
                            capture_output=True, text=True, env=child_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if "tputrain:" in line]


@pytest.mark.same_worker("console_xla_run")
def test_a_plain_script_shows_progress_without_absl_prefixes(xla_run):
    # The XLA script below is such a plain script: one child process serves both tests.
    lines = [line for line in xla_run.stderr.splitlines() if "tputrain:" in line]
    assert any(line.startswith("tputrain: OneDeviceStrategy") for line in lines), lines
    assert [line for line in lines if line.startswith("tputrain: step ")][-1].startswith(
        "tputrain: step 4/4 | loss ")
    assert any(line.startswith("tputrain: eval at step 4 | loss ") for line in lines), lines
    assert all(line.startswith("tputrain:") for line in lines), lines  # no "I1123 ..." prefix


def test_show_progress_false_silences_it(tmp_path):
    assert run_script(tmp_path, "quiet") == []


def test_tensorflow_start_up_noise_is_filtered_and_real_errors_kept():
    from tputrain.observe.console import _filter_startup

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


@pytest.mark.parametrize("level, kept", [("0", "IWE"), ("1", "WE"), ("2", "E"), ("3", "")])
def test_start_up_lines_below_tf_cpp_min_log_level_are_dropped(monkeypatch, level, kept):
    # TF's C++ lines written before absl's log is initialised ignore the level (the
    # oneDNN line on a CPU with AVX-512 bf16): the capture applies it to them.
    from tputrain.observe.console import _at_log_level

    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", level)
    text = ("I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.\n"
            "W0000 00:00:2.0 1 x.cc:1] a warning\n"
            "E0000 00:00:3.1 1 something.cc:1] a real error\n"
            "tputrain: error: flag --x: must be positive\n")
    lines = _at_log_level(text).splitlines()
    assert [line[0] for line in lines[:-1]] == list(kept)
    assert lines[-1] == "tputrain: error: flag --x: must be positive"  # not a TF line: kept


# A script that imports tputrain first, then TensorFlow and Keras, and logs: one child
# process for the tests below that ask what such a script prints.
TPUTRAIN_FIRST = ("import tputrain, tensorflow, keras\ntputrain.show_progress()\n"
                  "tputrain.show_progress()\ntputrain.resolve_strategy()\n")


@pytest.fixture(scope="module")
def tputrain_first():
    return subprocess.run([sys.executable, "-c", TPUTRAIN_FIRST], capture_output=True,
                          text=True, env=child_env(), timeout=300)


@pytest.mark.same_worker("console_tputrain_first")
def test_importing_tputrain_prints_no_error_level_line(tputrain_first):
    # tputrain imports TensorFlow lazily: the start-up filter applies to whoever does.
    result = tputrain_first
    assert result.returncode == 0, result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("E")], result.stderr


# A user's script: devices, strategy and precision set up before the Trainer, on the
# built-in digits data (TFRecords read through an in-memory cache).
SET_UP_FIRST = textwrap.dedent("""
    import sys
    if sys.argv[2] == "tensorflow-first":
        import keras, tensorflow  # noqa: F401
    import tputrain
    from tputrain.tasks.digits import DigitsTask
    tputrain.split_cpu(2)
    strategy = tputrain.resolve_strategy()
    tputrain.set_precision_policy("float32")
    trainer = tputrain.Trainer(DigitsTask(), sys.argv[1], strategy=strategy, train_steps=4,
                               steps_per_loop=2, global_batch_size=16, eval_steps=2,
                               report_mfu=False)
    trainer.train()
""")
# Lines that alarm and say nothing to the user (issue 34). TensorFlow's C++ start-up
# lines before tputrain is imported are out of its reach (see `filter_tensorflow_startup`).
NOISE = re.compile("did not fully read the dataset|Sharding callback duration|"
                   "Reduce to .* then broadcast|Writing fingerprint")
STARTUP_NOISE = re.compile("failed call to cuInit|All log messages before absl::InitializeLog")


@pytest.mark.parametrize("first", ["tputrain", pytest.param("tensorflow-first",
                                                             marks=pytest.mark.slow)])
def test_a_script_that_sets_up_first_shows_the_strategy_each_loop_and_no_noise(tmp_path, first):
    script = tmp_path / "train.py"
    script.write_text(SET_UP_FIRST)
    env = dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TF_CPP_MIN_LOG_LEVEL")  # what a user sees
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), first],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert any(line.startswith("tputrain: using MirroredStrategy(2 CPU devices), 2 replicas")
               for line in lines), result.stderr
    steps = [line.split(" | ")[0] for line in lines if line.startswith("tputrain: step ")]
    assert steps == ["tputrain: step 2/4", "tputrain: step 4/4"], result.stderr
    assert any(line.startswith("tputrain: eval at step 4 | loss ") for line in lines), lines
    assert [line for line in lines if NOISE.search(line)] == []
    if first == "tputrain":
        assert [line for line in lines if STARTUP_NOISE.search(line)] == []
    # TensorFlow's lines other than those of its import before tputrain's (out of reach).
    theirs = [line for line in lines
              if not line.startswith("tputrain:") and not STARTUP_NOISE.search(line)]
    repeated = [line for line in set(theirs) if theirs.count(line) > 1]
    assert repeated == [], repeated  # TensorFlow's lines once, not once per handler


def test_the_cli_on_two_replicas_prints_plain_lines_once_and_no_noise(tmp_path):
    """`tputrain --gin_file=digits.gin` as a user runs it, on 2 replicas."""
    env = dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    result = subprocess.run(
        [sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
         f"--model_dir={tmp_path / 'run'}", "--gin_param=split_cpu.num_devices=2",
         "--gin_param=Trainer.train_steps=4", "--gin_param=Trainer.steps_per_loop=2",
         "--gin_param=Trainer.steps_per_fetch=2", "--gin_param=Trainer.eval_every=4",
         "--gin_param=Trainer.checkpoint_every=2"],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert any(line.startswith("tputrain: using MirroredStrategy(2 CPU devices)")
               for line in lines), result.stderr  # without absl's "I1125 12:00:00 ..." prefix
    steps = [line.split(" | ")[0] for line in lines if line.startswith("tputrain: step ")]
    assert steps == ["tputrain: step 2/4", "tputrain: step 4/4"], result.stderr
    assert [line for line in lines if NOISE.search(line) or STARTUP_NOISE.search(line)] == []
    assert tensorflow_lines(result.stderr) == []
    (config,) = [line for line in lines if " replica(s) on " in line]
    assert ", remat off" in config, config  # the config line names every plan knob (issue 52)
    repeated = [line for line in set(lines) if lines.count(line) > 1]
    assert repeated == [], repeated


def test_what_counts_as_the_programs_own_logging_configuration(monkeypatch, tmp_path):
    """absl's own handler and the bare `basicConfig()` absl's first log call adds do not
    silence the progress lines; a handler, format or root level of the program's does."""
    import logging

    from absl import logging as absl_logging

    from tputrain.observe.console import user_configured_logging

    root = logging.getLogger()
    bare = logging.StreamHandler(sys.stderr)
    bare.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    monkeypatch.setattr(root, "level", logging.WARNING)
    monkeypatch.setattr(root, "handlers", [])
    assert not user_configured_logging()
    monkeypatch.setattr(root, "handlers", [bare, absl_logging.get_absl_handler()])
    assert not user_configured_logging()
    monkeypatch.setattr(root, "level", logging.INFO)  # basicConfig(level=logging.INFO)
    assert user_configured_logging()
    monkeypatch.setattr(root, "level", logging.WARNING)
    custom = logging.StreamHandler(sys.stderr)
    custom.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    monkeypatch.setattr(root, "handlers", [custom])
    assert user_configured_logging()
    monkeypatch.setattr(root, "handlers", [logging.FileHandler(tmp_path / "log.txt", delay=True)])
    assert user_configured_logging()


@pytest.mark.same_worker("console_tputrain_first")
@pytest.mark.parametrize("first", ["keras", "tputrain"])
def test_tensorflow_imported_first_is_told_once_how_to_silence_its_start_up(first, request):
    """Its start-up lines printed before tputrain was imported: the first tputrain line
    says once to import tputrain first (issue 52); with tputrain first, nothing to say."""
    if first == "keras":
        script = ("import keras, tputrain\ntputrain.show_progress()\ntputrain.show_progress()\n"
                  "tputrain.resolve_strategy()\n")
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env=child_env(), timeout=300)
    else:
        result = request.getfixturevalue("tputrain_first")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("tputrain:")]
    told = [line for line in ours if "import tputrain before" in line]
    if first == "keras":
        assert told == ours[:1], ours
    else:
        assert told == [], ours


# TensorFlow's own lines (C++: "W0000 00:00:... file.cc:39] ...") and E-level lines that
# a run printed with tputrain imported first (issue 52).
TENSORFLOW_LINE = re.compile(r"^[IWEF]\d{4} |^E\d|^ERROR|\.(cc|py):\d+\] ")

XLA_SCRIPT = textwrap.dedent("""
    import sys
    import tputrain
    from tiny import TinyTask
    trainer = tputrain.Trainer(TinyTask(), sys.argv[1], train_steps=4, steps_per_loop=2,
                               global_batch_size=16, eval_steps=1, report_mfu=False,
                               jit_compile=True, eval_every=2)
    trainer.train()
""")


def tensorflow_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if TENSORFLOW_LINE.search(line)]


def test_tensorflow_line_pattern_finds_cpp_and_error_lines():
    assert tensorflow_lines(
        "W0000 00:00:1.5 185 assert_op.cc:39] Ignoring Assert operator x\n"
        "I1129 07:00:00.1 1 cross_device_ops.py:634] Gather to /cpu:0 then broadcast\n"
        "E0000 00:00:3.0 1 x.cc:1] an error\n"
        "tputrain: step 2/4 | loss 0.5\n") == [
        "W0000 00:00:1.5 185 assert_op.cc:39] Ignoring Assert operator x",
        "I1129 07:00:00.1 1 cross_device_ops.py:634] Gather to /cpu:0 then broadcast",
        "E0000 00:00:3.0 1 x.cc:1] an error"]


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory):
    """XLA_SCRIPT run once as a user runs it (TensorFlow's lines not silenced)."""
    tmp_path = tmp_path_factory.mktemp("xla_run")
    script = tmp_path / "train.py"
    script.write_text(XLA_SCRIPT)
    # A first run: its own compile cache, not the suite's (whose reloaded entries print
    # XLA's cache lines, which this test is not about).
    env = dict(child_env(), TPUTRAIN_CACHE_DIR=str(tmp_path / "cache"),
               TPUTRAIN_COMPILE_CACHE=str(tmp_path / "xla"))
    env.pop("TF_CPP_MIN_LOG_LEVEL")  # what a user sees
    env.pop("TF_XLA_FLAGS", None)  # the suite's cache would win over the variable above
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "run")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.same_worker("console_xla_run")
def test_an_xla_run_prints_no_tensorflow_line(xla_run):
    """`Ignoring Assert operator` twice on every XLA compile came from the loss's
    average (`tf.nn.compute_average_loss`'s checks, which XLA drops)."""
    assert "tputrain: step 4/4" in xla_run.stderr
    assert tensorflow_lines(xla_run.stderr) == []


@pytest.mark.parametrize("message", [
    "Collective all_reduce tensors: 1 all_reduces, num_devices = 1, group_size = 2, "
    "implementation = CommunicationImplementation.RING, num_packs = 1",
    "Check health not enabled.",
    "Gather to /job:localhost/replica:0/task:0/device:CPU:0 then broadcast to ('/cpu:0',).",
    "Enabled multi-worker collective ops with available devices: ['/cpu:0']",
    "MultiWorkerMirroredStrategy with cluster_spec = {}, task_type = 'worker', task_id = 0"])
def test_tensorflow_distribution_chatter_is_dropped_and_its_warnings_kept(message):
    """The INFO lines a `tputrain launch` worker or a 2-replica gather printed (issue 52)."""
    import logging

    from tputrain.observe.console import _DropTensorFlowChatter

    def record(level):
        return logging.LogRecord("tensorflow", level, "cross_device_ops.py", 634, message,
                                 None, None)

    assert not _DropTensorFlowChatter().filter(record(logging.INFO))
    assert _DropTensorFlowChatter().filter(record(logging.WARNING))


# While a program is read back from the compile cache (`compile_cache.reading`).
READ_BACK = textwrap.dedent("""
    import os, sys
    from tputrain.loop.compile_cache import READ_BACK_LINES
    from tputrain.observe.console import native_lines_dropped
    lines = [
        "E0000 00:00:1.0 1 text_format.cc:378] Error parsing text-format "
        "tensorflow.XlaSerializedCacheEntry: 2:1: Expected identifier, got: 5",
        "E0000 00:00:1.1 1 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result. Target "
        "machine feature +prefer-no-scatter is not  supported on the host machine. Machine",
        "E0000 00:00:1.2 1 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result. Target "
        "machine feature +avx512f is not  supported on the host machine. Machine",
        "E0000 00:00:1.3 1 something.cc:1] a real error"]
    with native_lines_dropped(READ_BACK_LINES):
        for line in lines:
            os.write(2, (line + "\\n").encode())
        os.write(2, b"\\rbar 1/4")  # a partial line: at once
        sys.stderr.write("tputrain: a line from Python\\n")
        if sys.argv[1] == "abort":
            os.write(2, b"F0000 00:00:1.4 1 x.cc:1] Check failed: a fatal error\\n")
            os.abort()
    os.write(2, b"after\\n")
""")


@pytest.mark.parametrize("end", ["return", "abort"])
def test_read_back_error_lines_are_dropped_and_real_errors_kept_even_in_a_crash(end):
    """The compile cache's harmless E-lines go; a real error, a missing instruction set,
    Python's lines, a partial line and a crash's last line all reach stderr in order."""
    result = subprocess.run([sys.executable, "-c", READ_BACK, end], capture_output=True,
                            env=child_env(), timeout=120)
    kept = result.stderr.decode().split("\n")  # bytes: the partial line keeps its `\r`
    assert not [line for line in kept if "XlaSerializedCacheEntry" in line or
                "prefer-no-scatter" in line], kept
    assert kept[:3] == [
        "E0000 00:00:1.2 1 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result. Target machine "
        "feature +avx512f is not  supported on the host machine. Machine",
        "E0000 00:00:1.3 1 something.cc:1] a real error",
        "\rbar 1/4tputrain: a line from Python"], kept
    if end == "abort":
        assert result.returncode != 0 and kept[3:] == [
            "F0000 00:00:1.4 1 x.cc:1] Check failed: a fatal error", ""], kept
    else:
        assert result.returncode == 0 and kept[3:] == ["after", ""], kept
