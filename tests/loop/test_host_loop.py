"""tputrain/loop/host_loop.py: one train program serves every loop length.

A loop's length is a run-time tensor of the program, so a last loop shorter than
`steps_per_loop` (train_steps not a multiple of it, a resume at an odd step) runs
the program already compiled instead of tracing and compiling a new one.
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import tputrain
from faults import child_env
from tiny import TinyTask, TraceCountingTask, strategy_for, weights
from tputrain.loop import compile_cache

# (replicas, Trainer options): the plain loop, the whole step in XLA one step a
# launch, several steps an XLA program launch, and XLA on two replicas.
PATHS = {
    "plain": (1, dict(jit_compile=False)),
    "xla": (1, dict(jit_compile=True, steps_per_program=1)),
    "program": (1, dict(jit_compile=True, steps_per_program=4)),
    "program_auto": (1, dict(jit_compile=True)),  # 20 steps a launch: the loop's length
    "plain_2": (2, dict(jit_compile=False)),
    "xla_2": (2, dict(jit_compile=True)),
}


def _trainer(tmp_path, name: str, path: str, train_steps: int) -> tputrain.Trainer:
    replicas, options = PATHS[path]
    return tputrain.Trainer(TinyTask(), str(tmp_path / name), strategy=strategy_for(replicas),
                            train_steps=train_steps, steps_per_loop=20, global_batch_size=16,
                            checkpoint_every=10**6, eval_steps=1, **options)


def _programs(trainer: tputrain.Trainer) -> int:
    """The train programs the Trainer's host loop traced (`HostLoop.traced_programs`)."""
    return trainer._train_loop_fn.__self__.traced_programs()  # pylint: disable=protected-access


@pytest.mark.parametrize("path", [
    "program",  # the path that compiled a second program (one step a launch) before
    *(pytest.param(p, marks=pytest.mark.slow) for p in ("plain", "xla", "program_auto",
                                                        "plain_2", "xla_2"))])
def test_82_steps_in_loops_of_20_compile_one_program_also_after_a_resume_at_41(tmp_path, path):
    """Loops of 20, 20, 20, 20, 2; then a run stopped at 41 (20, 20, 1) and resumed
    (20, 20, 1): each process traces one train program, and the resumed weights are
    the uninterrupted run's."""
    straight = _trainer(tmp_path, "straight", path, 82)
    straight.train()
    assert int(straight.step.numpy()) == 82 and _programs(straight) == 1
    first = _trainer(tmp_path, "resumed", path, 41)
    first.train()
    assert int(first.step.numpy()) == 41 and _programs(first) == 1
    resumed = _trainer(tmp_path, "resumed", path, 82)
    resumed.train()
    assert int(resumed.step.numpy()) == 82 and _programs(resumed) == 1
    assert all(np.array_equal(a, b) for a, b in zip(weights(straight), weights(resumed)))


# Trains TinyTask with 4 steps an XLA program launch in loops of 20 to `train_steps`
# (resuming from `model_dir`'s checkpoint), with XLA's persistent cache in `cache`.
SCRIPT = r"""
import sys
import tensorflow as tf
import tputrain
from tiny import TinyTask
model_dir, train_steps = sys.argv[1], int(sys.argv[2])
trainer = tputrain.Trainer(TinyTask(), model_dir, train_steps=train_steps, steps_per_loop=20,
                           global_batch_size=16, checkpoint_every=10**6, eval_steps=1,
                           jit_compile=True, steps_per_program=4, report_mfu=False,
                           strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
trainer.train()
"""


@pytest.mark.slow
def test_a_short_last_loop_compiles_no_xla_program_a_whole_loop_did_not(tmp_path):
    """XLA's own count, with the compiled programs kept on disk: a run of 82 steps (its
    last loop 2) and a run of 41 (its last loop 1) write no program a run of 80 (loops
    of 20 only) did not; resumed at 41, a run to 82 writes none a run from 41 to 81
    (whole loops) did not."""
    cache = str(tmp_path / "xla_cache")

    def train(name: str, train_steps: int) -> set[str]:
        env = child_env()
        env.pop("TF_XLA_FLAGS", None)  # not the suite's own cache
        env[compile_cache.ENV] = cache
        result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / name),
                                 str(train_steps)], env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return {name for _, _, names in os.walk(cache) for name in names
                if name != compile_cache.CHECKED}

    whole_loops = train("eighty", 80)
    assert whole_loops, "the run of 80 wrote its compiled programs"
    assert train("straight", 82) == whole_loops
    assert train("stopped", 41) == whole_loops
    shutil.copytree(tmp_path / "stopped", tmp_path / "stopped_too")
    resumed_whole_loops = train("stopped", 81)
    assert train("stopped_too", 82) == resumed_whole_loops


def _matmuls(trainer: tputrain.Trainer) -> int:
    """MatMul ops in the host loop's traced graph, its function library included."""
    loop = trainer._train_loop_fn.__self__.loop  # pylint: disable=protected-access
    count = 0
    for function in loop._list_all_concrete_functions():  # pylint: disable=protected-access
        graph = function.graph.as_graph_def()
        count += sum(node.op == "MatMul" for node in graph.node)
        count += sum(node.op == "MatMul" for f in graph.library.function for node in f.node_def)
    return count


@pytest.mark.parametrize("steps_per_fetch", [1, 2])
def test_the_loop_holds_the_step_once_a_replica_on_two_replicas(tmp_path, steps_per_fetch):
    """Compile time on N replicas (issue 55): the step is inlined on several replicas,
    so the loop's graph (traced, optimized and instantiated before the first step)
    holds it once a replica, as one replica's loop holds its one traced step, not once
    for a peeled first step and again for the steps after it."""
    matmuls = {}
    for replicas in (1, 2):
        trainer = tputrain.Trainer(TinyTask(), str(tmp_path / str(replicas)),
                                   strategy=strategy_for(replicas), train_steps=4,
                                   steps_per_loop=4, steps_per_fetch=steps_per_fetch,
                                   global_batch_size=16, jit_compile=False, report_mfu=False)
        trainer.run_loop(4)
        matmuls[replicas] = _matmuls(trainer)
        trainer.close()
    assert matmuls[1] > 0
    assert matmuls[2] == 2 * matmuls[1]


@pytest.mark.parametrize("steps_per_fetch", [1, 2])
def test_two_replicas_trace_the_step_once_each(tmp_path, steps_per_fetch):
    """On several replicas the step is inlined, each replica's copy traced in the loop;
    the loop's sums need no other trace of it for their structure (`CarriedSums`)."""
    task = TraceCountingTask()
    trainer = tputrain.Trainer(task, str(tmp_path), strategy=strategy_for(2), train_steps=4,
                               steps_per_loop=4, steps_per_fetch=steps_per_fetch,
                               global_batch_size=16, jit_compile=False, report_mfu=False)
    logs, steps, _ = trainer.run_loop(4)
    assert steps == 4 and np.isfinite(logs["loss"])
    assert task.traces == 2
    trainer.run_loop(4)
    assert task.traces == 2
    trainer.close()


def _launch_sites(trainer: tputrain.Trainer) -> tuple[int, int]:
    """(calls of the XLA program, batches read) in the program loop's traced graph,
    its function library included."""
    host = trainer._train_loop_fn.__self__  # pylint: disable=protected-access
    traced = host.program._list_all_concrete_functions()  # pylint: disable=protected-access
    assert len(traced) == 1
    program = traced[0].name.decode()
    calls = reads = 0
    for function in host.program_loop._list_all_concrete_functions():  # pylint: disable=protected-access
        graph = function.graph.as_graph_def()
        nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
        calls += sum(node.op in ("StatefulPartitionedCall", "PartitionedCall")
                     and node.attr["f"].func.name == program for node in nodes)
        reads += sum(node.op == "IteratorGetNextAsOptional" for node in nodes)
    return calls, reads


def test_the_program_loop_holds_one_launch_for_every_loop_length(tmp_path):
    """A Trainer's start-up traces, optimizes and instantiates the program loop's graph:
    the first, the middle and a loop's shorter last launch are one launch in one while
    loop (its `want` a tensor), not three copies of the reads and the program call.
    A length the program does not divide, then a whole one, run that one graph."""
    trainer = tputrain.Trainer(TinyTask(), str(tmp_path), strategy=strategy_for(1),
                               train_steps=12, steps_per_loop=4, global_batch_size=16,
                               jit_compile=True, steps_per_program=4, report_mfu=False)
    logs, steps, _ = trainer.run_loop(6)
    assert steps == 6 and np.isfinite(logs["loss"])
    trainer.run_loop(4)
    assert trainer._train_loop_fn.__self__.traced_programs() == 1  # pylint: disable=protected-access
    calls, reads = _launch_sites(trainer)
    trainer.close()
    assert calls == 1
    # a full launch's reads and a shorter one's, once each
    assert reads == 2 * 4
