"""`tputrain find-batch --gin_file=F`: the largest per-replica batch that fits and pays.

Runs `tputrain.find_batch` on the config's task and Trainer bindings: doubles
the per-replica batch from the configured one (or `--start_batch`), compiling
and timing the run's own train loop on the task's own input at each, then
bisects between the last batch that fit and the first that ran out of memory
to `--resolution`. The climb also ends at `--max_batch` or when a doubling
buys less than `--min_gain` more examples/s. It prints a table (per-replica
and global batch, examples/s, MFU, peak device memory where the device
reports it) and the suggestion as gin params: the global batch, the train
steps that see the same examples, and the learning rate scaled from the
configured (batch, rate) by `--lr_rule` with a warmup. Each batch is a
Trainer in a temporary directory: nothing is written to model_dir. Exits 1
when not even the start batch fits.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import gin
from absl import flags, logging

from tputrain.cli.common import (EXIT_TRAINING_FAILED, GIN_FLAGS, configured_task,
                                 define_gin_flags, fail, list_in_help, parse_gin_flags,
                                 reject_arguments, run_command)
from tputrain.config.parsing import ConfigError
from tputrain.jobs.batch_finder import find_batch
from tputrain.optim.schedules import LR_RULES
from tputrain.trainer import Trainer

FLAGS = flags.FLAGS
DEFAULT_GLOBAL_BATCH = 64  # Trainer's own default, when the config binds none


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("start_batch", None, "First per-replica batch tried; default: "
                         "Trainer.global_batch_size / replicas.", **fv)
    flags.DEFINE_integer("max_batch", 4096, "Largest per-replica batch tried.", **fv)
    flags.DEFINE_float("min_gain", 0.05, "Stop when a doubling buys less than this fraction "
                       "more examples/s (negative: never).", **fv)
    flags.DEFINE_integer("resolution", 8, "Bisect between the last batch that fit and the "
                         "first out of memory until they are this close (per replica).", **fv)
    flags.DEFINE_float("seconds", 2.0, "Timed seconds per batch, after compiling.", **fv)
    flags.DEFINE_enum("lr_rule", "linear", LR_RULES, "How the suggested learning rate "
                      "scales with the batch: linear (x ratio) or sqrt (x sqrt(ratio)).", **fv)
    for name in ("start_batch", "max_batch", "resolution"):
        flags.register_validator(name, lambda value: value is None or value > 0,
                                 "must be a positive number of examples per replica", **fv)
    flags.register_validator("seconds", lambda value: value > 0, "must be > 0 seconds", **fv)
    flags.register_validator("min_gain", math.isfinite, "must be a fraction such as 0.05, or "
                             "negative to never stop for it (not nan or inf)", **fv)
    # Not model_dir: the finder only writes temporary directories.
    list_in_help((*GIN_FLAGS, "start_batch", "max_batch", "min_gain", "resolution",
                  "seconds", "lr_rule"), flag_values)


def _configured(binding: str, default: int) -> int:
    try:
        return int(gin.query_parameter(binding))
    except ValueError:
        return default


def _trainer_options() -> dict[str, Any]:
    """A bound integer Trainer.steps_per_program is kept (find_batch's default is 1)."""
    try:
        program = gin.query_parameter("Trainer.steps_per_program")
    except ValueError:
        return {}
    return {"steps_per_program": program} if isinstance(program, int) else {}


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    parse_gin_flags()
    try:
        task = configured_task()
    except ConfigError as error:
        fail(str(error))
    result = find_batch(
        task, global_batch_size=_configured("Trainer.global_batch_size", DEFAULT_GLOBAL_BATCH),
        start_batch=FLAGS.start_batch, max_batch=FLAGS.max_batch,
        min_gain=FLAGS.min_gain if FLAGS.min_gain >= 0 else None,
        resolution=FLAGS.resolution, seconds=FLAGS.seconds, trainer_class=Trainer,
        **_trainer_options())
    print(result.report(FLAGS.lr_rule))
    sys.stdout.flush()
    sys.exit(0 if result.suggested else EXIT_TRAINING_FAILED)


def console_main() -> None:
    """`tputrain find-batch`."""
    define_flags()
    logging.set_verbosity(logging.WARNING)
    run_command(main)
