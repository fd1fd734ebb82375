"""XLA's persistent compilation cache (issue 38): a rerun reads its programs back,
and a changed model never runs a stale one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from faults import child_env
from tputrain import compile_cache

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
    env.update(env_vars)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / name), activation,
                             "1" if ops_first else "0"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("WEIGHTS "))
    return json.loads(line[len("WEIGHTS "):]), result.stderr


def _entries(directory) -> set[str]:
    return {name for _, _, names in os.walk(directory) for name in names}


def test_a_rerun_reads_the_programs_back_and_a_changed_model_compiles_anew(tmp_path):
    cache = str(tmp_path / "shared_cache")
    first, log = _train(tmp_path, "a", "relu", TPUTRAIN_COMPILE_CACHE=cache)
    assert f"tputrain: XLA compilation cache {cache}" in log
    written = _entries(cache)
    assert written, "the first run wrote its compiled programs"
    again, _ = _train(tmp_path, "b", "relu", TPUTRAIN_COMPILE_CACHE=cache)  # read back
    assert _entries(cache) == written
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
    monkeypatch.setattr(compile_cache, "_cpu_features", lambda: "fpu sse2 avx2")
    older = compile_cache.default_directory()
    monkeypatch.setattr(compile_cache, "_cpu_features", lambda: "fpu sse2 avx2 avx512f")
    newer = compile_cache.default_directory()
    assert older != newer and os.path.dirname(older) == os.path.dirname(newer)
