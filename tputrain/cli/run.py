"""`tputrain --gin_file=F [--gin_param=...]`: train a gin config.

`tputrain run` and `python -m tputrain.run` are the same command. It exits 0
when training is done; 1 when training failed (a non-finite loss, corrupt data
or a full disk found mid-run, a lost worker); 2 for a bad config or input, found
before any training; 3 when a multi-worker task never joined; 42 when preempted
(SIGTERM: rerun the same command to resume).
"""

from __future__ import annotations

import signal
import sys

import tensorflow as tf
from absl import flags, logging

from tputrain.checkpointing.integrity import CheckpointMismatchError, NonFiniteStateError
from tputrain.checkpointing.recovery import UnreadableCheckpointError
from tputrain.cli.common import (EXIT_BAD_INPUT, EXIT_TRAINING_FAILED, GIN_FLAGS, build_trainer,
                                 define_gin_flags, error_message, fail, list_in_help,
                                 parse_gin_flags, reject_arguments, run_command)
from tputrain.loop.compile_cache import CompileCacheError
from tputrain.config.registry import join_watchdog  # the gin-configurable one
from tputrain.config.parsing import write_operative_config
from tputrain.data import CorruptRecordError, FeatureSpecError
from tputrain.fault_tolerance.guard import NonFiniteError
from tputrain.distribution.launch import watch_launcher
from tputrain.fault_tolerance.preemption import PREEMPTED_EXIT_CODE, ExitOnSignal, set_stop_signals
from tputrain.trainer import Trainer
from tputrain.tuning.vertex_job import hyperparameter_args
from tputrain.checkpointing.run_directory import ModelDirError
from tputrain.runtime.preflight import finished
from tputrain.runtime.validate import InputDataError

FLAGS = flags.FLAGS
# What `tputrain run` stops on, saving first: a scheduler's SIGTERM and a user's Ctrl-C.
CLI_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)
    flags.DEFINE_enum("progress_bar", None, ["auto", "on", "off"], "Overrides "
                      "Trainer.progress_bar: a live bar between the loop lines on a terminal "
                      "or in Jupyter (auto), always (on) or never (off).",
                      flag_values=flag_values)
    list_in_help((*GIN_FLAGS, "model_dir", "deterministic", "progress_bar"), flag_values)


def _exit_preempted_before_training() -> ExitOnSignal:
    """SIGTERM while the Trainer is built (the inputs read, the model compiled): nothing
    to save yet; exit 42 all the same, so a scheduler sees a preemption (rerun resumes)
    and not a crash (-15). Acted on at once, even while the main thread waits inside
    TensorFlow for an input (`ExitOnSignal`)."""
    return ExitOnSignal(f"tputrain: signal {{signum}} before training started; nothing to "
                        "save: rerun the same command to resume (exit code "
                        f"{PREEMPTED_EXIT_CODE})", signals=CLI_STOP_SIGNALS)


def _train(trainer: Trainer) -> dict[str, float]:
    """Runs training; known failures end in one line (preemption exits 42 by itself)."""
    try:
        return trainer.train()
    except (CheckpointMismatchError, UnreadableCheckpointError) as error:  # at restore,
        fail(error_message(error), EXIT_BAD_INPUT)  # before any step
    except (CorruptRecordError, InputDataError, FeatureSpecError, ModelDirError,
            NonFiniteError, NonFiniteStateError, CompileCacheError) as error:  # found mid-run
        fail(error_message(error), EXIT_TRAINING_FAILED)
    except tf.errors.UnavailableError as error:
        if trainer.num_hosts == 1:
            raise
        # A peer died: TF aborts the collectives (heartbeats stop) rather than hang.
        fail(f"lost a worker ({error_message(error).splitlines()[0]}): rerun the job to "
             "resume from the last checkpoint", EXIT_TRAINING_FAILED)


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    set_stop_signals(*CLI_STOP_SIGNALS)  # Ctrl-C saves at the next step, as SIGTERM does
    # Until train() installs its own watcher (and after it restores this one).
    _exit_preempted_before_training().install()
    watch_launcher()  # a worker of `tputrain launch` stops when the launcher dies
    if FLAGS.progress_bar:  # after the config's bindings: the flag wins
        FLAGS.gin_param = [*FLAGS.gin_param, f"Trainer.progress_bar = '{FLAGS.progress_bar}'"]
    parse_gin_flags()
    if FLAGS.deterministic:
        tf.config.experimental.enable_op_determinism()
    try:
        with join_watchdog():  # multi-worker: a task that never starts is named, not waited on
            trainer = build_trainer(FLAGS.model_dir)
    except (ValueError, TypeError, OSError) as error:  # bad input: one line naming the fix
        logging.debug("tputrain: building the trainer failed", exc_info=True)
        fail(error_message(error), EXIT_BAD_INPUT)
    # The config of the run that made the checkpoints: a rerun that trains nothing
    # (already at train_steps, or a train_steps below) leaves it as it is.
    writes = trainer.is_chief and will_train(trainer)
    if writes:
        write_operative_config(trainer.model_dir)
    results = _train(trainer)
    if writes:
        write_operative_config(trainer.model_dir)
    logging.info("tputrain: done at step %d: %s", int(trainer.step.numpy()),
                 " | ".join(f"{k} {v:.4g}" for k, v in results.items()))


def will_train(trainer: Trainer) -> bool:
    """Whether `trainer.train()` will train a step: its newest listed checkpoint (read
    before it restores) is below `train_steps` (the pre-flight's `finished`)."""
    return not finished(trainer.context)


def console_main() -> None:
    """`tputrain [run] --gin_file=...`."""
    # A Vertex AI tuning trial's values come as --<parameterId>=<value> (tuning/vertex_job.py).
    sys.argv = hyperparameter_args(sys.argv)
    define_flags()
    run_command(main)
