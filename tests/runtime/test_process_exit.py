"""A process that used tputrain ends promptly after its last line (issue 52): what it
guarantees, not how long it takes (benchmarks/exit_time.py measures that)."""

import subprocess
import sys
import textwrap

import pytest

from faults import child_env


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, env=child_env(), timeout=300)


@pytest.mark.start_early(3)
def test_a_trainers_iterators_are_not_freed_at_interpreter_exit(tmp_path):
    # Registered before tputrain's import, so it runs after tputrain's hook (atexit
    # runs last-registered first) and sees what the hook kept: the Trainer's iterator,
    # not one of the script's own.
    result = run("""
        import atexit, sys
        atexit.register(lambda: print("kept", sorted(type(i).__name__ for i in
                                                     sys.modules["tputrain.runtime.process_exit"]._kept)))
        import tputrain
        import tensorflow as tf
        from tiny import TinyTask
        trainer = tputrain.Trainer(TinyTask(), sys.argv[1], train_steps=2, steps_per_loop=2,
                                   global_batch_size=16, eval_steps=1, report_mfu=False)
        trainer.train()
        own = iter(tf.data.Dataset.range(3))
        print("last line", int(next(own)))
    """, str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["last line 0", "kept ['OwnedIterator', 'OwnedIterator']"]


def test_end_process_runs_exit_hooks_and_threads_then_skips_the_teardown(tmp_path):
    # A __del__ that only the interpreter's teardown would run: end_process skips it.
    result = run("""
        import atexit, sys, threading
        from tputrain.runtime.process_exit import end_process

        class Finalized:
            def __del__(self):
                print("torn down", flush=True)

        kept = Finalized()
        atexit.register(lambda: print("atexit hook ran"))
        thread = threading.Thread(target=lambda: open(sys.argv[1], "w").write("done"))
        thread.start()
        print("last line")
        end_process(int(sys.argv[2]))
    """, str(tmp_path / "written"), "3")
    assert result.returncode == 3, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["last line", "atexit hook ran"]
    assert (tmp_path / "written").read_text() == "done"


def test_end_process_exits_as_sys_exit_does_with_a_message():
    result = run("""
        from tputrain.runtime.process_exit import end_process
        end_process("tputrain: error: a message")
    """)
    assert (result.returncode, result.stderr) == (1, "tputrain: error: a message\n")


def test_a_tputrain_command_ends_through_end_process(tmp_path):
    """The CLI's exit code is kept (2: a bad flag) and its teardown is skipped: a
    module imported with --gin_import holds an object whose __del__ prints."""
    (tmp_path / "finalized_module.py").write_text(textwrap.dedent("""
        class Finalized:
            def __del__(self):
                print("torn down", flush=True)
        kept = Finalized()
    """))
    env = dict(child_env(), PYTHONPATH=f"{tmp_path}:{child_env()['PYTHONPATH']}")
    result = subprocess.run([sys.executable, "-m", "tputrain.run", "--gin_import=finalized_module",
                             "--gin_param=Trainer.train_stepz=1"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "train_steps" in result.stderr  # the one-line error naming the fix
    assert "torn down" not in result.stdout
