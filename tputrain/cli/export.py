"""`tputrain export --model_dir=DIR [--gin_file=F] [--step=N]`: a checkpoint to a SavedModel.

Builds the run's Trainer from its config (by default the `operative_config.gin`
that `tputrain run` left in model_dir) as a `ReadOnlyTrainer` (tputrain/sidecar.py),
so it also exports beside a running training job; reads a checkpoint into a fresh copy of
the model and writes a SavedModel (`tputrain.export`): the best checkpoint if
the config has a `BestCheckpoint` action, else the latest, or `--step`. The
SavedModel goes to `--export_dir`, else `$AIP_MODEL_DIR` (Vertex AI), else
`model_dir/export/<step>/`; its path is printed on stdout. Exits 2 when there
is no such checkpoint or the config is bad.
"""

from __future__ import annotations

from absl import flags, logging

from tputrain.cli.common import (EXIT_BAD_INPUT, GIN_FLAGS, build_trainer, default_operative_config,
                                 define_gin_flags, error_message, fail, list_in_help,
                                 parse_gin_flags, reject_arguments, run_command)
from tputrain.export import export_checkpoint
from tputrain.sidecar import ReadOnlyTrainer

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values)
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("step", None, "Export the checkpoint of this step; default: the best "
                         "(with a BestCheckpoint action) or the latest.", **fv)
    flags.DEFINE_bool("best", None, "Export the BestCheckpoint's checkpoint (--nobest: the "
                      "latest); default: the best when the config keeps one.", **fv)
    flags.DEFINE_string("export_dir", None, "The SavedModel's folder; default $AIP_MODEL_DIR "
                        "when set, else MODEL_DIR/export/STEP.", **fv)
    flags.DEFINE_bool("examples", True, "Also write the serving_examples signature "
                      "(serialized tf.Example) when the Task has a feature spec.", **fv)
    list_in_help((*GIN_FLAGS, "model_dir", "step", "best", "export_dir", "examples"),
                 flag_values)


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    parse_gin_flags(default_operative_config())
    try:
        trainer = build_trainer(FLAGS.model_dir, ReadOnlyTrainer)  # runs beside training
        path = export_checkpoint(trainer, step=FLAGS.step, export_dir=FLAGS.export_dir,
                                 best=FLAGS.best, examples=FLAGS.examples)
    except (ValueError, TypeError, OSError) as error:  # no such checkpoint, bad config
        logging.debug("tputrain: export failed", exc_info=True)
        fail(error_message(error), EXIT_BAD_INPUT)
    print(path)


def console_main() -> None:
    """`tputrain export`."""
    define_flags()
    run_command(main)
