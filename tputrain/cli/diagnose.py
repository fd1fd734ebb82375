"""`tputrain diagnose --gin_file=F`: where does a step's time go?

Builds the configured Trainer (in a temporary model_dir: nothing is restored or
written) and measures, on this host, three throughputs in steps per second and
one time:

(a) input only: the train dataset drained by a compiled loop, no step;
(b) compute only: the Trainer's own compiled train loop fed one cached batch
    again and again from memory (`Dataset.from_tensors(batch).repeat()`), so
    the step never waits on real input;
(c) end to end: the same loop on the real input pipeline;
(d) communication: the all-reduce of the gradients alone (the run's dtype and
    collective options, in a compiled loop of many; 0 on one replica).

The stall fraction is `1 - end_to_end / compute_only` (the median over
pairs of loops run back to back, cached and real input in turn): the share of
step time lost to input, whether the step waits on batches that are not ready
or the pipeline slows the step by competing for the host's cores. The rest of
the step is the compute-only step, of which the all-reduce is communication
and the remainder compute. Communication is the bottleneck when it is the
largest share and at least 30%; otherwise input if the stall is 5% or more;
otherwise compute. The advice names the knobs for that case. On several
workers run it through the launcher (`tputrain launch --workers 2 diagnose
--gin_file=F`) or on every host: each host prints its own report.
`python -m tputrain.jobs.diagnose` runs the same.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time

from absl import flags, logging

from tputrain.cli.common import (GIN_FLAGS, build_trainer, define_gin_flags, list_in_help,
                                 parse_gin_flags, reject_arguments, run_command)
from tputrain.jobs.diagnose import diagnose

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)
    flags.DEFINE_bool("json", False, "Print the measurements as one JSON object.",
                      flag_values=flag_values)
    flags.DEFINE_float("seconds", 3.0, "Seconds per measurement (after a warm-up loop).",
                       flag_values=flag_values)
    flags.DEFINE_integer("steps", None, "Steps per measured loop; default "
                         "Trainer.steps_per_loop.", flag_values=flag_values)
    # As find-batch's: a measurement of no time or no step is no measurement.
    flags.register_validator("seconds", lambda value: value > 0, "must be > 0 seconds",
                             flag_values=flag_values)
    flags.register_validator("steps", lambda value: value is None or value > 0,
                             "must be a positive number of steps (leave it out for "
                             "Trainer.steps_per_loop)", flag_values=flag_values)
    # Not model_dir: diagnose always works in a temporary directory.
    list_in_help((*GIN_FLAGS, "json", "seconds", "steps"), flag_values)


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    started = time.perf_counter()
    parse_gin_flags()
    # Never touch the configured model_dir: no restore, no checkpoints, no summaries.
    work_dir = tempfile.mkdtemp(prefix="tputrain-diagnose-")
    try:
        building = time.perf_counter()
        trainer = build_trainer(work_dir)
        build_seconds = time.perf_counter() - building
        result = diagnose(trainer, seconds=FLAGS.seconds, steps=FLAGS.steps)
        host = {"host": trainer.host_id, "num_hosts": trainer.num_hosts}
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    result.seconds["build"] = round(build_seconds, 3)
    result.seconds["total"] = round(time.perf_counter() - started, 3)
    if FLAGS.json:
        print(json.dumps({"gin_file": list(FLAGS.gin_file), "gin_param": list(FLAGS.gin_param),
                          **host, **result.to_json()}, indent=1))
    else:
        if host["num_hosts"] > 1:
            print(f"host {host['host']} of {host['num_hosts']}:")
        print(result.report())
    sys.stdout.flush()


def console_main() -> None:
    """`tputrain diagnose`."""
    define_flags()
    logging.set_verbosity(logging.WARNING)
    run_command(main)
