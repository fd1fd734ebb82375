"""XLA's persistent compilation cache (issue 38): a rerun reads its programs back,
and a changed model never runs a stale one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from faults import child_env
from tputrain.core import cpu_info
from tputrain.loop import compile_cache

# A tiny model whose whole step is one XLA program (jit_compile=True, one replica);
# `activation` changes the program, not the variables. `ops_first`: TensorFlow has
# run an op before tputrain is imported.
SCRIPT = r"""
import json, sys
model_dir, activation, ops_first = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if ops_first:
    import tensorflow as tf
    tf.constant(1.0) + 1.0
import tputrain
import keras, tensorflow as tf
from tiny import TinyTask

class Task(TinyTask):
    def __init__(self, activation):
        super().__init__(num_examples=64)
        self.activation = activation

    def build_model(self):
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(16, activation=self.activation)(inputs)
        return keras.Model({"x": inputs}, keras.layers.Dense(2)(h))

trainer = tputrain.Trainer(Task(activation), model_dir, train_steps=6, steps_per_loop=3,
                           global_batch_size=16, jit_compile=True, report_mfu=False,
                           strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
trainer.train()
print("WEIGHTS " + json.dumps([w.numpy().tolist() for w in trainer.model.weights]))
"""


def _train(tmp_path, name: str, activation: str, ops_first: bool = False,
           **env_vars: str) -> tuple[list, str]:
    env = child_env()
    env.pop("TF_XLA_FLAGS", None)  # not the suite's own cache
    env.pop(compile_cache.ENV, None)
    # Keras imports matplotlib where it is installed, which writes its font cache under
    # XDG_CACHE_HOME: not tputrain's file, so it goes elsewhere.
    env["MPLCONFIGDIR"] = str(tmp_path / "matplotlib")
    env.update(env_vars)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / name), activation,
                             "1" if ops_first else "0"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("WEIGHTS "))
    return json.loads(line[len("WEIGHTS "):]), result.stderr


def _assert_no_read_back_error_line(log: str, cache: str) -> None:
    """A program read back made TensorFlow log error-level lines (it tries the entry as
    text before binary; XLA:CPU names its own tuning flags as features the host lacks):
    none reaches the console (issue 52); the cache's one tputrain line does."""
    lines = log.splitlines()
    assert not [line for line in lines if line.startswith("E0")], lines
    assert len([line for line in lines if line.startswith("tputrain: XLA compilation cache "
                                                          f"{cache} (1 program(s))")]) == 1, lines


def _entries(directory) -> set[str]:
    """The programs' entries (not tputrain's record of those it checked)."""
    return {name for _, _, names in os.walk(directory) for name in names
            if name != compile_cache.CHECKED}


def test_a_rerun_reads_the_programs_back_and_a_changed_model_compiles_anew(tmp_path):
    cache = str(tmp_path / "shared_cache")
    first, log = _train(tmp_path, "a", "relu", TPUTRAIN_COMPILE_CACHE=cache)
    assert f"tputrain: XLA compilation cache {cache}" in log
    written = _entries(cache)
    assert written, "the first run wrote its compiled programs"
    again, log = _train(tmp_path, "b", "relu", TPUTRAIN_COMPILE_CACHE=cache)  # read back
    assert _entries(cache) == written
    _assert_no_read_back_error_line(log, cache)
    assert again == first
    changed, _ = _train(tmp_path, "c", "tanh", TPUTRAIN_COMPILE_CACHE=cache)
    assert _entries(cache) > written  # another program, the same variables
    assert changed == _train(tmp_path, "d", "tanh", TPUTRAIN_COMPILE_CACHE="off")[0] != first


@pytest.mark.slow
def test_the_default_is_a_folder_per_tensorflow_version_in_the_users_cache(tmp_path):
    from importlib import metadata

    _, log = _train(tmp_path, "run", "relu", XDG_CACHE_HOME=str(tmp_path / "home_cache"))
    cache = tmp_path / "home_cache" / "tputrain" / "xla" / f"tf-{metadata.version('tensorflow')}"
    assert _entries(cache) and str(cache) in log


@pytest.mark.slow
def test_off_writes_nothing_and_says_nothing(tmp_path):
    _, log = _train(tmp_path, "run", "relu", XDG_CACHE_HOME=str(tmp_path / "home_cache"),
                    TPUTRAIN_COMPILE_CACHE="off")
    assert not (tmp_path / "home_cache").exists()
    assert "compilation cache" not in log


def test_tensorflow_started_before_tputrain_is_said_once(tmp_path):
    cache = tmp_path / "cache"
    _, log = _train(tmp_path, "run", "relu", ops_first=True, TPUTRAIN_COMPILE_CACHE=str(cache))
    assert log.count("may be unused: TensorFlow had started before tputrain was imported") == 1
    assert not _entries(cache)


def test_a_directory_named_in_tf_xla_flags_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(compile_cache, "_state", dict(compile_cache._state))
    monkeypatch.setenv("TF_XLA_FLAGS", f"--xla_x=1 {compile_cache.FLAG}=/elsewhere")
    assert compile_cache.enable(str(tmp_path / "mine")) == "/elsewhere"
    assert not (tmp_path / "mine").exists()
    monkeypatch.setenv("TF_XLA_FLAGS", "--xla_x=1")
    assert compile_cache.enable(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert os.environ["TF_XLA_FLAGS"] == f"--xla_x=1 {compile_cache.FLAG}={tmp_path / 'mine'}"
    assert (tmp_path / "mine").is_dir()


@pytest.mark.parametrize("setting", ["off", "0", "false", ""])
def test_the_variable_turns_it_off(monkeypatch, setting):
    monkeypatch.setenv(compile_cache.ENV, setting)
    assert compile_cache.default_directory() is None


def test_the_default_folder_is_per_cpu_so_another_cpu_never_reads_a_program(monkeypatch, tmp_path):
    # XLA's CPU programs are compiled for the host's instruction set (AVX-512, say): a
    # home folder shared with a machine without it must not hand them over.
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    here = compile_cache.default_directory()
    assert here == compile_cache.default_directory()  # stable
    assert os.path.dirname(os.path.dirname(here)) == str(tmp_path / "tputrain" / "xla")
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: "fpu sse2 avx2")
    older = compile_cache.default_directory()
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: "fpu sse2 avx2 avx512f")
    newer = compile_cache.default_directory()
    assert older != newer and os.path.dirname(older) == os.path.dirname(newer)


def test_an_instruction_set_cap_in_xla_flags_gets_a_folder_of_its_own(monkeypatch, tmp_path):
    # XLA_FLAGS=--xla_cpu_max_isa=AVX2 compiles AVX2 programs on an AVX-512 host; the
    # cache's key ignores XLA_FLAGS, so the host's folder would hand AVX-512 ones back.
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    uncapped = compile_cache.default_directory()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    capped = compile_cache.default_directory()
    assert capped != uncapped and os.path.dirname(capped) == os.path.dirname(uncapped)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_cpu_max_isa=AVX2")
    assert compile_cache.default_directory() == capped  # the cap alone decides
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert compile_cache.default_directory() == uncapped


# ------------------------------------------------------------ damaged caches (issue 50)
#
# The cache is an optimisation: a damaged, truncated, foreign or unreadable entry is
# removed with one warning naming it (its program compiles again and is rewritten),
# and a cache path that is no writable directory turns the cache off with one warning.


def _one_entry(directory) -> str:
    """The path of a real entry of XLA's cache, copied into `directory`: one program
    compiled in this process (its cache is the suite's, TF_XLA_FLAGS)."""
    import tensorflow as tf

    tf.function(lambda x: x * 3.0 + 1.0, jit_compile=True)(tf.ones([5]))
    source = compile_cache.current()
    entries = sorted(os.path.join(source, name) for name in os.listdir(source)
                     if name.endswith(".pb"))
    assert entries, f"no entry in {source}"
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, os.path.basename(entries[0]))
    with open(entries[0], "rb") as entry, open(target, "wb") as copy:
        copy.write(entry.read())
    return target


def _foreign_key(entry: bytes) -> bytes:
    """`entry` with its key's first varint (the signature fingerprint) changed in
    place: another program's entry under this one's name."""
    assert entry[0] == 0x0A  # field 1 (the key), length-delimited
    length_bytes = 1
    while entry[length_bytes] & 0x80:
        length_bytes += 1
    start = 1 + length_bytes
    assert entry[start] == 0x08  # the key's field 1, a varint
    damaged = bytearray(entry)
    damaged[start + 1] ^= 0x01  # in its lowest 7 bits
    return bytes(damaged)


DAMAGES = {
    "garbage": lambda entry: os.urandom(len(entry)),
    "truncated": lambda entry: entry[:len(entry) // 2],
    "foreign": _foreign_key,
    "empty": lambda entry: b"",
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_entry_is_removed_with_one_warning_naming_it(tmp_path, damage):
    entry = _one_entry(tmp_path / "cache")
    good = _one_entry(tmp_path / "other")
    with open(entry, "rb") as file:
        content = file.read()
    with open(entry, "wb") as file:
        file.write(DAMAGES[damage](content))
    os.replace(good, str(tmp_path / "cache" / "xla_compile_cache__1__2__XLA_CPU_JIT.pb"))
    # `good` holds the real entry under another name: foreign too (its key names another)
    warnings = compile_cache.check_entries(str(tmp_path / "cache"))
    assert sorted(warnings) == sorted(
        f"tputrain: XLA compilation cache entry {path} is damaged or another program's "
        f"({why}): removed; its program compiles again and is rewritten" for path, why in [
            (entry, _WHY[damage]),
            (str(tmp_path / "cache" / "xla_compile_cache__1__2__XLA_CPU_JIT.pb"), "another key")])
    assert not [name for name in os.listdir(tmp_path / "cache") if name.endswith(".pb")]


def test_a_sound_entry_is_kept_and_checked_once(tmp_path):
    entry = _one_entry(tmp_path / "cache")
    assert compile_cache.check_entries(str(tmp_path / "cache")) == []
    assert os.path.exists(entry)
    checked = json.loads((tmp_path / "cache" / compile_cache.CHECKED).read_text())
    assert list(checked) == [os.path.basename(entry)]
    os.remove(entry)  # gone: forgotten
    assert compile_cache.check_entries(str(tmp_path / "cache")) == []
    assert json.loads((tmp_path / "cache" / compile_cache.CHECKED).read_text()) == {}


def test_an_unreadable_entry_is_removed_with_one_warning(tmp_path):
    entry = _one_entry(tmp_path / "cache")
    os.remove(entry)
    os.makedirs(entry)  # what TensorFlow would fail to read as a file
    warnings = compile_cache.check_entries(str(tmp_path / "cache"))
    assert len(warnings) == 1 and entry in warnings[0]
    assert not os.path.exists(entry)


# Another library put a file of tputrain's entry proto's name into protobuf's default
# pool first: building the entry's message fails (a TypeError from protobuf, as when the
# proto named a type that did not resolve), which the check must not pass on.
_CHECKER_FAILS = r"""
import json, sys
from google.protobuf import descriptor_pb2, descriptor_pool
proto = descriptor_pb2.FileDescriptorProto(name="tputrain/xla_compilation_cache_entry.proto",
                                           package="another.library", syntax="proto3")
proto.message_type.add(name="Other")
descriptor_pool.Default().Add(proto)
from tputrain.loop import compile_cache
print("RESULT " + json.dumps(compile_cache.check_entries(sys.argv[1])))
"""


def test_a_check_that_cannot_read_entries_keeps_them_and_says_so_once(tmp_path):
    """The cache is never fatal: the check itself failing leaves every entry as it is."""
    (tmp_path / "cache").mkdir()
    entry = tmp_path / "cache" / "xla_compile_cache__1__2__XLA_CPU_JIT.pb"
    entry.write_bytes(b"not checked")
    result = subprocess.run([sys.executable, "-c", _CHECKER_FAILS, str(tmp_path / "cache")],
                            capture_output=True, text=True, env=child_env())
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    (warning,) = json.loads(line.removeprefix("RESULT "))
    assert warning.startswith(f"tputrain: XLA compilation cache {tmp_path / 'cache'}: its "
                              "entries could not be checked (TypeError: ")
    assert warning.endswith(f"left as they are; set {compile_cache.ENV}=off if a step "
                            "fails reading one")
    assert entry.read_bytes() == b"not checked"


@pytest.mark.parametrize("kind", ["file", "under_a_file"])
def test_a_cache_path_that_is_no_directory_turns_the_cache_off_with_one_warning(
        monkeypatch, tmp_path, kind):
    # A fresh process's state: an earlier Trainer in this worker reported already.
    monkeypatch.setattr(compile_cache, "_state", {"directory": None, "too_late": False,
                                                  "reported": False, "off": None})
    monkeypatch.setenv("TF_XLA_FLAGS", "--xla_x=1")
    (tmp_path / "file").write_text("not a folder")
    path = str(tmp_path / "file") if kind == "file" else str(tmp_path / "file" / "xla")
    monkeypatch.setenv(compile_cache.ENV, path)
    assert compile_cache.enable() is None
    assert os.environ["TF_XLA_FLAGS"] == "--xla_x=1"
    line = compile_cache.report()
    assert line.startswith(f"tputrain: XLA compilation cache off: {path} ") and "TPUTRAIN_COMPILE_CACHE" in line
    assert compile_cache.report() is None  # once


def _first_entry_of_a_run(tmp_path) -> tuple[str, list]:
    cache = str(tmp_path / "cache")
    weights, _ = _train(tmp_path, "first", "relu", TPUTRAIN_COMPILE_CACHE=cache)
    entries = [name for name in os.listdir(cache) if name.endswith(".pb")]
    assert len(entries) == 1
    return os.path.join(cache, entries[0]), weights


def _rerun_with_a_damaged_entry(tmp_path, damage: str) -> None:
    entry, first = _first_entry_of_a_run(tmp_path)
    with open(entry, "rb") as file:
        content = file.read()
    with open(entry, "wb") as file:
        file.write(DAMAGES[damage](content))
    again, log = _train(tmp_path, "again", "relu", TPUTRAIN_COMPILE_CACHE=str(tmp_path / "cache"))
    assert again == first
    assert [line for line in log.splitlines() if entry in line] == [
        f"tputrain: XLA compilation cache entry {entry} is damaged or another program's "
        f"({_WHY[damage]}): removed; its program compiles again and is rewritten"]
    assert "corrupt" not in log and "Traceback" not in log
    assert compile_cache.entry_problem(entry) is None  # rewritten


_WHY = {"garbage": "not an entry", "truncated": "not an entry", "foreign": "another key",
        "empty": "not an entry"}


# Two training processes each (tens of seconds on 2 busy cores): the in-process tests
# above check every damage in the default tier.
@pytest.mark.slow
def test_garbage_in_an_entry_is_not_a_data_error_and_the_run_trains(tmp_path):
    _rerun_with_a_damaged_entry(tmp_path, "garbage")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_truncated_or_foreign_entry_is_recompiled_and_the_run_trains(tmp_path, damage):
    _rerun_with_a_damaged_entry(tmp_path, damage)


@pytest.mark.slow
def test_a_cache_path_that_is_a_file_trains_without_the_cache(tmp_path):
    (tmp_path / "cache").write_text("not a folder")
    _, log = _train(tmp_path, "run", "relu", TPUTRAIN_COMPILE_CACHE=str(tmp_path / "cache"))
    lines = [line for line in log.splitlines() if str(tmp_path / "cache") in line]
    assert len(lines) == 1 and lines[0].startswith(
        f"tputrain: XLA compilation cache off: {tmp_path / 'cache'} ")


def test_a_cache_path_that_is_a_file_does_not_stop_help(tmp_path):
    (tmp_path / "cache").write_text("not a folder")
    env = child_env()
    env.pop("TF_XLA_FLAGS", None)
    env[compile_cache.ENV] = str(tmp_path / "cache")
    helped = subprocess.run([sys.executable, "-m", "tputrain.cli", "--help"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "Traceback" not in helped.stderr


# An entry damaged after the Trainer checked the cache (another process wrote it).
DAMAGED_AFTER_THE_CHECK = SCRIPT.replace("trainer.train()\n", """
import os
cache = os.environ["TPUTRAIN_COMPILE_CACHE"]
for name in os.listdir(cache):
    if name.endswith(".pb"):
        with open(os.path.join(cache, name), "wb") as entry:
            entry.write(os.urandom(4096))
try:
    trainer.train()
except Exception as error:
    print(f"FAILED {type(error).__name__}: {error}")
    sys.exit(1)
""")


@pytest.mark.slow
def test_a_cache_read_failing_mid_run_is_named_as_the_cache_not_the_data(tmp_path):
    entry, first = _first_entry_of_a_run(tmp_path)
    env = child_env()
    env.pop("TF_XLA_FLAGS", None)
    env[compile_cache.ENV] = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", DAMAGED_AFTER_THE_CHECK,
                             str(tmp_path / "damaged"), "relu", "0"], env=env,
                            capture_output=True, encoding="utf-8", errors="replace",
                            timeout=300)  # TensorFlow's parse line quotes the garbage
    assert result.returncode == 1
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 1 and "corrupt" not in failed[0], result.stdout + result.stderr[-3000:]
    assert failed[0].startswith(f"FAILED CompileCacheError: tputrain: XLA compilation cache "
                                f"entry {entry} ") and "rerun" in failed[0]
    assert not os.path.exists(entry)  # removed: the rerun compiles it again
    again, _ = _train(tmp_path, "again", "relu", TPUTRAIN_COMPILE_CACHE=str(tmp_path / "cache"))
    assert again == first


def test_only_a_cache_read_error_is_named_as_the_cache(monkeypatch, tmp_path):
    import tensorflow as tf

    entry = _one_entry(tmp_path / "cache")
    with open(entry, "rb") as file:
        content = file.read()
    with open(entry, "wb") as file:
        file.write(_foreign_key(content))
    monkeypatch.setattr(compile_cache, "_state", dict(compile_cache._state))
    compile_cache._state["directory"] = str(tmp_path / "cache")
    data = tf.errors.DataLossError(None, None, "corrupted record at 162")
    assert compile_cache.read_error(data) is None
    foreign = tf.errors.InvalidArgumentError(
        None, None, "Graph execution error:\n\nSerialized cache key does not match.\n\t [[{{node x}}]]")
    error = compile_cache.read_error(foreign)
    assert isinstance(error, compile_cache.CompileCacheError)
    assert str(error) == (
        f"tputrain: XLA compilation cache entry {entry} could not be read back (Serialized "
        "cache key does not match.; damaged while this run used the cache): the cache, not "
        "the data; removed: rerun the same command, its program compiles again")
    assert not os.path.exists(entry)
