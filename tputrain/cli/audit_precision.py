"""`tputrain audit-precision --gin_file=F`: which layers drift in bf16/fp16, and does it matter?

Runs `tputrain.audit_precision` on the config's task (`audit_precision.task`
if bound, else `Trainer.task`, with batches of `Trainer.global_batch_size`):
the same weights in float32, under the target policy, and with one layer at a
time at the target policy. It prints one row per layer (its cumulative error
and the local error it adds itself, flagged above `tolerance`) and the eval
metrics both ways. Keep a flagged layer in float32 with
`PrecisionOptions.keep_float32_layers = ['name']` and rerun. The exit
status is 1 when a metric moves by more than `metric_tolerance`, 2 for bad input
(a flag, a binding, a missing checkpoint or output folder). Without
`--model_dir` or `--checkpoint` (or with a model_dir that has no checkpoint yet)
it audits the initial, untrained weights, and its report says so.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import gin
import tensorflow as tf
from absl import flags

from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.config.registry import audit_precision  # the gin-configured one
from tputrain.cli.common import (GIN_FLAGS, configured_task, define_gin_flags, error_message, fail,
                                 list_in_help, parse_gin_flags, reject_arguments, run_command)
from tputrain.config.parsing import ConfigError
from tputrain.precision.policy import VALID_POLICIES
from tputrain.task import Task

FLAGS = flags.FLAGS
AUDITED_POLICIES = tuple(name for name in VALID_POLICIES if name != "float32")


def task_from_gin() -> Task:
    """`audit_precision.task` if bound, else the training config's `Trainer.task`:
    the audit runs on a training config unchanged."""
    return configured_task(("audit_precision.task", "Trainer.task"))


def defaults_from_gin() -> dict[str, Any]:
    """`audit_precision` arguments the training config implies and the audit's own
    bindings leave open: the audit reads batches of `Trainer.global_batch_size`."""
    kwargs: dict[str, Any] = {}
    for binding in ("global_batch_size",):
        try:
            gin.query_parameter(f"audit_precision.{binding}")
        except ValueError:
            try:
                kwargs[binding] = gin.query_parameter(f"Trainer.{binding}")
            except ValueError:
                pass
    return kwargs


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)
    flags.DEFINE_string("policy", None, "Target policy (default: audit_precision.policy, "
                        "mixed_bfloat16).", flag_values=flag_values)
    flags.DEFINE_string("checkpoint", None, "Checkpoint folder or prefix to load weights from; "
                        "default: --model_dir's checkpoints if given, else initial weights.",
                        flag_values=flag_values)
    flags.DEFINE_string("output", None, "Also write the report as JSON to this path.",
                        flag_values=flag_values)
    list_in_help((*GIN_FLAGS, "model_dir", "policy", "checkpoint", "output"), flag_values)


def check_flags(policy: str | None, checkpoint: str | None, output: str | None) -> None:
    """Bad flags in one line and exit 2, before the audit builds the model and reads
    the data (exit 1 is this command's "a metric moved")."""
    if policy is not None and policy not in AUDITED_POLICIES:
        fail(f"--policy={policy!r} is no mixed precision policy: use one of "
             f"{', '.join(AUDITED_POLICIES)}")
    if checkpoint and tf.io.gfile.isdir(checkpoint):
        if not tf.train.latest_checkpoint(checkpoint):
            fail(f"--checkpoint={checkpoint}: no checkpoint in {checkpoint}: pass a "
                 "model_dir/checkpoints folder or a checkpoint prefix (.../ckpt-400)")
    elif checkpoint and not tf.io.gfile.exists(checkpoint + ".index"):
        fail(f"--checkpoint={checkpoint} does not exist: pass a model_dir/checkpoints folder "
             "or a checkpoint prefix (.../ckpt-400), or leave it out to audit the initial "
             "weights")
    folder = os.path.dirname(output or "") or "."
    if output and not tf.io.gfile.isdir(folder):
        fail(f"--output={output}: the folder {folder} does not exist: create it first")


def _arguments() -> dict[str, Any]:
    """`audit_precision` keyword arguments from the config and the flags."""
    kwargs = defaults_from_gin()
    if FLAGS.policy:
        kwargs["policy"] = FLAGS.policy
    checkpoint = FLAGS.checkpoint
    if not checkpoint and FLAGS.model_dir:
        checkpoint = RunDirectory(FLAGS.model_dir).checkpoints
        if not tf.train.latest_checkpoint(checkpoint):  # not trained yet: say so, audit anyway
            print(f"tputrain: no checkpoint in {checkpoint}: auditing the initial weights")
            checkpoint = None
    if checkpoint:
        kwargs["checkpoint"] = checkpoint
    return kwargs


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    check_flags(FLAGS.policy, FLAGS.checkpoint, FLAGS.output)
    parse_gin_flags()
    try:
        task = task_from_gin()
    except ConfigError as error:
        fail(str(error))
    try:  # a bad binding, unreadable data or checkpoint: exit 2, not 1 ("a metric moved")
        report = audit_precision(task, **_arguments())
    except (ValueError, TypeError, OSError, tf.errors.OpError) as error:
        fail(error_message(error))
    print(report.format())
    if FLAGS.output:
        try:
            with tf.io.gfile.GFile(FLAGS.output, "w") as f:
                json.dump(report.to_dict(), f, indent=1)
        except (OSError, tf.errors.OpError) as error:
            fail(f"--output={FLAGS.output}: {error_message(error)}")
    sys.exit(0 if report.metrics_ok else 1)


def console_main() -> None:
    """`tputrain audit-precision`."""
    define_flags()
    run_command(main)
