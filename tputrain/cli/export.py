"""`tputrain export --model_dir=DIR [--gin_file=F] [--step=N]`: a checkpoint to a SavedModel.

Builds the run's Trainer from its config (by default the `operative_config.gin`
that `tputrain run` left in model_dir) as a `ReadOnlyTrainer` (tputrain/jobs/sidecar.py),
so it also exports beside a running training job; reads a checkpoint into a fresh copy of
the model and writes a SavedModel (`tputrain.serving.export`): the best checkpoint if
the config has a `BestCheckpoint` action, else the latest, or `--step`. The
SavedModel goes to `--export_dir`, else `$AIP_MODEL_DIR` (Vertex AI), else
`model_dir/export/<step>/`; its path is printed on stdout. Exits 2 when there
is no such checkpoint or the config is bad.

For a LoRA fine-tuned model (docs/keras_hub.md), `--lora=merge` merges the LoRA
factors into the kernels, `--keras` also writes a `.keras` file, and
`--quantize=int8` also writes the int8 model and prints the eval metrics of
float32 and int8 (`tputrain.serving.keras_saving.export_for_serving`).
"""

from __future__ import annotations

from absl import flags, logging

from tputrain.cli.common import (EXIT_BAD_INPUT, GIN_FLAGS, build_trainer, default_operative_config,
                                 define_gin_flags, error_message, fail, list_in_help,
                                 parse_gin_flags, reject_arguments, run_command)
from tputrain.serving.export import export_checkpoint
from tputrain.serving.keras_saving import LORA_CHOICES, QUANTIZE_CHOICES, export_for_serving
from tputrain.jobs.sidecar import ReadOnlyTrainer

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
    flags.DEFINE_enum("lora", None, LORA_CHOICES, "A LoRA model's SavedModel: merge the LoRA "
                      "factors into the kernels (to MODEL_DIR/export_merged/STEP by default), "
                      "or keep them apart as trained.", **fv)
    flags.DEFINE_bool("keras", False, "Also write a .keras file (LoRA merged; with --lora=keep "
                      "a Keras-Hub model's base and its factors' STEP.lora.h5 beside it), "
                      "MODEL_DIR/keras/STEP.keras by default.", **fv)
    flags.DEFINE_string("keras_file", None, "The .keras file's path (implies --keras).", **fv)
    flags.DEFINE_enum("quantize", None, QUANTIZE_CHOICES, "Also write the quantized model "
                      "(MODEL_DIR/export_int8/STEP, and beside the .keras file) and print the "
                      "eval metrics of float32 and the quantized model.", **fv)
    list_in_help((*GIN_FLAGS, "model_dir", "step", "best", "export_dir", "examples", "lora",
                  "keras", "keras_file", "quantize"), flag_values)


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    parse_gin_flags(default_operative_config())
    try:
        trainer = build_trainer(FLAGS.model_dir, ReadOnlyTrainer)  # runs beside training
        if FLAGS.lora or FLAGS.keras or FLAGS.keras_file or FLAGS.quantize:
            lines = export_for_serving(
                trainer, step=FLAGS.step, best=FLAGS.best, lora=FLAGS.lora or "keep",
                keras_lora=FLAGS.lora or "merge", export_dir=FLAGS.export_dir,
                keras_file=FLAGS.keras_file or FLAGS.keras or None,
                quantize=FLAGS.quantize, examples=FLAGS.examples).report()
        else:
            lines = [export_checkpoint(trainer, step=FLAGS.step, export_dir=FLAGS.export_dir,
                                       best=FLAGS.best, examples=FLAGS.examples)]
    except (ValueError, TypeError, OSError, ImportError) as error:  # no checkpoint, bad config
        logging.debug("tputrain: export failed", exc_info=True)
        fail(error_message(error), EXIT_BAD_INPUT)
    print("\n".join(lines))


def console_main() -> None:
    """`tputrain export`."""
    define_flags()
    run_command(main)
