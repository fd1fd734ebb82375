"""The run's configuration in TensorBoard, so that a sweep's runs compare by settings.

At the start of each `train()`, the chief writes to the run's root (model_dir,
or `$AIP_TENSORBOARD_LOG_DIR`), beside `train/` and `eval/`:

* the text summary `operative_config`: gin's operative config (what
  `operative_config.gin` holds), or for a Trainer built in Python without gin
  its options as `Trainer.<option> = value` lines;
* an hparams summary (`tensorboard.plugins.hparams`): the scalar-valued bindings
  (bool, int, float, str; a `@reference` as its text) of that config, named as
  in it (`Trainer.train_steps`, `scope/Task.dropout`), and the Trainer's options
  under the same names. Each model_dir is then one session of TensorBoard's
  HParams dashboard, started on the folder above a sweep's model_dirs. No
  experiment summary (`hparams_config`) is written: TensorBoard takes one run's
  as the whole folder's, so runs of other tasks lost their hparams and metrics.
  Without it the dashboard lists every run's hparams and, as metrics, every
  scalar of each run (`eval/loss`, the Task's metrics in `eval/` or
  `eval/<set>/` with named eval sets, `train/...`); a run that has no
  evaluation yet shows no eval value.

Both are written at step 0, so a rerun's replace the earlier ones. No room for them
on the disk is a warning, as for every summary (`tputrain.observe.summary_space`).
"""

from __future__ import annotations

from typing import Mapping, Union

import gin
import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

from tputrain.actions import Action
from tputrain.runtime.context import ActionContext


HParamValue = Union[bool, int, float, str]
TEXT_TAG = "operative_config"


def _scalar(value: object) -> HParamValue | None:
    """An hparams value, or None for one the HParams dashboard cannot hold."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, gin.config.ConfigurableReference):
        return str(value)  # which configurable: e.g. the Task
    return None


def gin_bindings() -> dict[str, HParamValue]:
    """The scalar-valued bindings of gin's operative config, by their config names."""
    # gin has no public reader of its operative config as values (config.py reads
    # its registry the same way).
    operative = gin.config._OPERATIVE_CONFIG  # pylint: disable=protected-access
    registry = gin.config._REGISTRY  # pylint: disable=protected-access
    bindings = {}
    for (scope, selector), parameters in sorted(operative.items()):
        name = registry.minimal_selector(selector)
        for parameter, value in parameters.items():
            if (scalar := _scalar(value)) is not None:
                bindings[f"{scope}/{name}.{parameter}" if scope else f"{name}.{parameter}"] = scalar
    return bindings


def trainer_options(context: ActionContext) -> dict[str, HParamValue]:
    """The Trainer's scalar options, named as gin binds them."""
    return {f"Trainer.{field}": scalar for field, value in sorted(vars(context.options).items())
            if (scalar := _scalar(value)) is not None}


def run_hparams(context: ActionContext) -> dict[str, HParamValue]:
    """The gin bindings and the Trainer's options (the options win: they are in force)."""
    return {**gin_bindings(), **trainer_options(context)}


def config_text(context: ActionContext) -> str:
    """gin's operative config; without gin bindings, the Trainer's options."""
    if gin.config_str().strip():
        return gin.operative_config_str()
    return "\n".join(f"Trainer.{field} = {value!r}"
                     for field, value in sorted(vars(context.options).items())) + "\n"


def write_config_summary(directory: str, text: str,
                         hparams: Mapping[str, HParamValue]) -> None:
    """Writes the config text and the hparams summary into the run at `directory`
    (no experiment summary: the module docstring)."""
    writer = tf.summary.create_file_writer(directory)
    with writer.as_default(step=0):
        # Indented: Markdown shows it verbatim (no '#' headings, no '_' emphasis).
        tf.summary.text(TEXT_TAG, "\n".join("    " + line for line in text.splitlines()))
        hp.hparams(dict(hparams))  # runs with the same settings form one group (repeats)
    writer.close()


class ConfigSummaryAction(Action):
    """Built in: the chief writes the run's configuration for TensorBoard at the start
    of each `train()` (the module docstring)."""

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        directory = context.progress.summary_dir
        if context.is_chief and directory is not None:  # a full disk: one warning, goes on
            text, hparams = config_text(context), run_hparams(context)
            context.progress.summary_space.write(
                directory, lambda: write_config_summary(directory, text, hparams))
