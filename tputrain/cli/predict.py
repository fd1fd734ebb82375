"""`tputrain predict --model_dir=DIR --output=FILE [--input=eval|GLOB]`: batch inference.

Builds the run's model from its config (by default the `operative_config.gin`
that `tputrain run` left in model_dir) as a `ReadOnlyTrainer`, which neither
locks model_dir nor writes to it, reads the latest checkpoint (or `--step`'s),
and writes every example's outputs of `--input` (a split of the task, default
"eval", or a TFRecord glob: `tputrain.jobs.predict`), exactly once and in input
order, as float32 whatever the training precision. A line every --log_every
batches shows the examples/s.

The file's type is its extension: `.npz` holds one array per output (a model
with one output: `outputs`); `.npy` the one output of a single-output model.
It is written to a temp file in the same folder, then renamed over `--output`,
so a failure never leaves a partial file (local paths).

Exits 0 when written; 2 (one line on stderr) when there is no such checkpoint,
the input matches nothing or fails to read, the output's folder is missing, or
the config is bad.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from absl import flags, logging

from tputrain.checkpointing.atomic import atomic_path
from tputrain.cli.common import (EXIT_BAD_INPUT, GIN_FLAGS, build_trainer,
                                 default_operative_config, define_gin_flags, error_message, fail,
                                 list_in_help, parse_gin_flags, reject_arguments, run_command)
from tputrain.jobs.predict import Outputs
from tputrain.jobs.sidecar import ReadOnlyTrainer

FLAGS = flags.FLAGS
FORMATS = (".npz", ".npy")
SINGLE_KEY = "outputs"  # a single-output model's array in a .npz


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("input", "eval", "What to predict: a split of the task ('eval') or a "
                        "TFRecord glob (as write-tfrecords writes them).", **fv)
    flags.DEFINE_string("output", None, "The file to write: .npz (one array per output) or "
                        ".npy (a single-output model), written atomically.", **fv)
    flags.DEFINE_integer("step", None, "Predict with the checkpoint of this step; default: "
                         "the latest.", **fv)
    flags.DEFINE_integer("log_every", 100, "A progress line every this many batches.", **fv)
    flags.register_validator("log_every", lambda n: n >= 1, "must be >= 1", **fv)
    flags.mark_flag_as_required("output", **fv)
    list_in_help((*GIN_FLAGS, "model_dir", "input", "output", "step", "log_every"),
                 flag_values)


def check_output(path: str) -> None:
    """Before any work: a known extension and an existing folder (ValueError)."""
    if os.path.splitext(path)[1] not in FORMATS:
        raise ValueError(f"--output={path}: name a {' or '.join(FORMATS)} file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output={path}: the folder {folder} does not exist: create it first")


def write_outputs(path: str, outputs: Outputs) -> None:
    """Writes `outputs` to `path` (see the module docstring): a temp file beside it,
    renamed over it, or removed on failure."""
    check_output(path)
    if os.path.splitext(path)[1] == ".npy" and isinstance(outputs, dict):
        raise ValueError(f"--output={path}: a .npy file holds one output, the model has "
                         f"{len(outputs)} ({', '.join(sorted(outputs))}): write a .npz")
    with atomic_path(os.path.abspath(path)) as temporary, open(temporary, "wb") as file:
        if path.endswith(".npy"):
            np.save(file, outputs)
        else:
            np.savez(file, **(outputs if isinstance(outputs, dict) else {SINGLE_KEY: outputs}))


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    parse_gin_flags(default_operative_config())
    try:
        check_output(FLAGS.output)
        trainer = build_trainer(FLAGS.model_dir, ReadOnlyTrainer)
        outputs = trainer.predict(FLAGS.input, step=FLAGS.step, log_every=FLAGS.log_every)
        write_outputs(FLAGS.output, outputs)
    except (ValueError, TypeError, OSError, tf.errors.OpError) as error:
        logging.debug("tputrain: predict failed", exc_info=True)
        fail(error_message(error), EXIT_BAD_INPUT)
    rows = len(next(iter(outputs.values())) if isinstance(outputs, dict) else outputs)
    logging.info("tputrain: wrote the outputs of %d examples to %s", rows, FLAGS.output)


def console_main() -> None:
    """`tputrain predict`."""
    define_flags()
    run_command(main)
