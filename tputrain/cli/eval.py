"""`tputrain eval --model_dir=DIR [--gin_file=F] [--step=N | --continuous]`: evaluation alone.

Builds the run's model from its config (by default the `operative_config.gin`
that `tputrain run` left in model_dir; a side-car started with the training
passes the run's own --gin_file and --gin_param) as a `ReadOnlyTrainer`, which
neither locks model_dir nor writes to it except `eval/` (tputrain/jobs/sidecar.py),
and evaluates the latest checkpoint, `--step`'s, or with `--continuous` each new
one once as it appears, until the one at `Trainer.train_steps`. Eval summaries
go to `model_dir/eval/` at the checkpoint's step (`eval/<set>/` for each of
`Trainer.eval_splits`' named sets, every set evaluated); stdout gets one JSON line
per evaluated checkpoint as soon as it is evaluated: {"step": N, "loss": ...,
metrics...} ("<set>/loss", ... with named sets).
Without --step, a truncated latest checkpoint falls back to the newest readable one.

Ctrl-C or SIGTERM stops it with one line, exit 42 (as `tputrain run`'s): what was
evaluated is recorded; rerun the same command to carry on.

Exits 0 when done; 1 when `--continuous` saw no new checkpoint for
--timeout_seconds (the training stopped: the lines so far are printed); 2 when
there is no such checkpoint, the config is bad, or model_dir/eval/ takes no writes
(a read-only model_dir: said before anything is evaluated).
"""

from __future__ import annotations

import json
import signal
import sys

import tensorflow as tf
from absl import flags, logging

from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.cli.common import (EXIT_BAD_INPUT, EXIT_TRAINING_FAILED, GIN_FLAGS, build_trainer,
                                 default_operative_config, define_gin_flags, error_message, fail,
                                 list_in_help, parse_gin_flags, reject_arguments, run_command)
from tputrain.fault_tolerance.preemption_early import PREEMPTED_EXIT_CODE, take_early_signal
from tputrain.jobs.sidecar import Metrics, NoNewCheckpointError, ReadOnlyTrainer, evaluate_checkpoints
from tputrain.tracking import Tracker
from tputrain.trainer import Trainer

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("step", None, "Evaluate the checkpoint of this step; default: the "
                         "latest.", **fv)
    flags.DEFINE_bool("continuous", False, "Evaluate each new checkpoint once as it appears, "
                      "until the one at Trainer.train_steps (a side-car beside training).", **fv)
    flags.DEFINE_float("poll_seconds", 10.0, "--continuous: how often to look for a new "
                       "checkpoint.", **fv)
    flags.DEFINE_float("timeout_seconds", 3600.0, "--continuous: give up (exit 1) after this "
                       "long without a new checkpoint; 0 waits for ever.", **fv)
    flags.register_validator("timeout_seconds", lambda seconds: seconds >= 0,
                             "must be >= 0 seconds (0 waits for ever)", **fv)
    flags.register_validator("poll_seconds", lambda seconds: seconds > 0,
                             "must be > 0 seconds", **fv)
    list_in_help((*GIN_FLAGS, "model_dir", "step", "continuous", "poll_seconds",
                  "timeout_seconds"), flag_values)


def _print(step: int, logs: Metrics) -> None:
    """One JSON line per checkpoint, as it is evaluated (a side-car's output is live)."""
    print(json.dumps({"step": step, **logs}), flush=True)


def _trackers(trainer: Trainer) -> list[Tracker]:
    """The config's trackers (tputrain/tracking/), continuing the training's run: its
    evaluations at steps the run does not hold yet go there too."""
    trackers = [action for action in trainer.actions if isinstance(action, Tracker)]
    for tracker in trackers:
        tracker.start(trainer.model_dir, writer=False)
    return trackers


def _evaluate(trainer: Trainer, timeout: float | None) -> None:
    """Evaluates as the flags ask; each result printed and sent to the trackers."""
    trackers = _trackers(trainer)

    def on_result(step: int, logs: Metrics) -> None:
        _print(step, logs)
        for tracker in trackers:
            tracker.on_eval_end(trainer.context, step, logs)
    try:
        evaluate_checkpoints(trainer, step=FLAGS.step, continuous=FLAGS.continuous,
                             poll_seconds=FLAGS.poll_seconds, timeout=timeout,
                             on_result=on_result)
    finally:
        for tracker in trackers:
            tracker.close()


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    try:
        _stop_on_signals()
        parse_gin_flags(default_operative_config())
        timeout = FLAGS.timeout_seconds if FLAGS.timeout_seconds > 0 else None
        _evaluate(build_trainer(FLAGS.model_dir, ReadOnlyTrainer), timeout)
    except (KeyboardInterrupt, _Stopped) as stop:  # the lock and trackers are let go on the way
        record = RunDirectory(FLAGS.model_dir or "model_dir").eval_record
        print(f"tputrain: stopped by {stop if isinstance(stop, _Stopped) else 'Ctrl-C'}: the "
              f"checkpoints evaluated so far are recorded in {record}: rerun the same "
              f"command to carry on (exit code {PREEMPTED_EXIT_CODE})",
              file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT_CODE)
    except NoNewCheckpointError as error:  # the training stopped before train_steps
        fail(str(error), EXIT_TRAINING_FAILED)  # (its lines are printed already)
    except (ValueError, TypeError, OSError, tf.errors.OpError) as error:
        logging.debug("tputrain: eval failed", exc_info=True)
        fail(error_message(error), EXIT_BAD_INPUT)


class _Stopped(BaseException):
    """SIGTERM (a side-car job preempted): `main` ends it as it ends Ctrl-C."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _stop_on_signals() -> None:
    """Ctrl-C (a KeyboardInterrupt) and SIGTERM end the command in one line (exit 42, as
    `tputrain run`'s): the record is rewritten atomically after each checkpoint, so
    there is nothing to save. A signal that came while TensorFlow was imported, held by
    the CLI's entry (`preemption_early`), is acted on now."""
    replaced = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_stopped)}
    held = take_early_signal(replaced)
    if held == signal.SIGTERM:
        raise _Stopped("SIGTERM")
    if held is not None:
        raise KeyboardInterrupt


def console_main() -> None:
    """`tputrain eval`."""
    define_flags()
    run_command(main)
