"""`tputrain goodput --model_dir=DIR`: where a job's wall-clock time went.

Reads the run records that training keeps in `DIR/goodput/` (one per process,
rewritten after every loop, so a running job or one killed mid-run is accounted
up to its last loop) and prints, for every run and in total: start-up by phase,
compilation, productive steps, input stall, communication, evaluation, checkpoint
saves, the steps recomputed after a restart, restart overhead, the time between
runs and the rest, as seconds and shares of the wall time that add up to 100%
(tputrain/observe/goodput.py; docs/performance.md#goodput). Instead of --model_dir, the
gin config that trained the job names it (`Trainer.model_dir`).
"""

from __future__ import annotations

import json

import gin
from absl import flags, logging

from tputrain.cli.common import (GIN_FLAGS, define_gin_flags, fail, list_in_help, parse_gin_flags,
                                 reject_arguments, run_command)
from tputrain.config.parsing import ConfigError, require_bound
from tputrain.observe.goodput import account, format_account

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)  # --model_dir, or the config's Trainer.model_dir
    flags.DEFINE_bool("json", False, "Print the account as one JSON object.",
                      flag_values=flag_values)
    list_in_help((*GIN_FLAGS, "model_dir", "json"), flag_values)


def model_dir_from_flags() -> str:
    """--model_dir, else the gin config's Trainer.model_dir."""
    if FLAGS.model_dir:
        return FLAGS.model_dir
    if not FLAGS.gin_file and not FLAGS.gin_param:
        fail("pass --model_dir=DIR (or the --gin_file=CONFIG that trained it)")
    parse_gin_flags()
    try:
        require_bound("Trainer.model_dir")
    except ConfigError as error:
        fail(str(error))
    return gin.query_parameter("Trainer.model_dir")


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    result = account(model_dir_from_flags())
    if not result["runs"]:
        fail(format_account(result))
    print(json.dumps(result, indent=1) if FLAGS.json else format_account(result))


def console_main() -> None:
    """`tputrain goodput`."""
    define_flags()
    logging.set_verbosity(logging.WARNING)
    run_command(main)
