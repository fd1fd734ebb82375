"""From a checkpoint to a SavedModel that serving systems load (TF Serving, Vertex AI).

`export_checkpoint(trainer)` builds a fresh copy of the Task's model *outside*
the training strategy (so TPU or mirrored variables never reach the SavedModel),
reads a checkpoint's weights into it and writes a SavedModel with:

* `serving_default`: the model's own inputs (the features of the train split,
  batch dimension free; one plain tensor is named by the model's `keras.Input`,
  "input_layer" when that has no name, as in keras.applications' models)
  -> its outputs, **always float32** (a mixed_bfloat16
  model computes in bfloat16 and is cast at the end): a client never sees
  bfloat16, which most serving stacks cannot encode;
* `serving_examples`: serialized `tf.Example` strings, parsed with the Task's
  feature spec, -> the same outputs; only when the Task has one (see
  `feature_spec_of`).

Outputs are named by the model's: a dict keeps its keys, a list gives
`output_0`, `output_1`..., one tensor is `outputs`.

Where: `model_dir/export/<step>/` (a numbered version folder, as TF Serving
expects), written to a temporary folder and renamed, so a watcher never loads
half a model; on Vertex AI `$AIP_MODEL_DIR` itself (its prebuilt serving
containers want `saved_model.pb` at the root of the model's artifact URI).
Which checkpoint: the best one kept by a `BestCheckpoint` action when the run
has one, else the latest (or `step=N`). The `Export` action
(`tputrain/actions/export.py`) does it at the end of training; `tputrain export` for
any checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import logging as pylogging
import os
import re
import socket
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import keras
import tensorflow as tf
from absl import logging

from tputrain.core import tracing
from tputrain.actions.best import BestCheckpoint, best_record
from tputrain import _compat
from tputrain.checkpointing.atomic import TEMP_MARK, atomic_path, left_by_dead_writer
from tputrain.checkpointing.files import first_line, list_checkpoints, step_of
from tputrain.checkpointing.model_variables import model_trackables
from tputrain.checkpointing.recovery import UNREADABLE_ERRORS, read_newest
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.data import parse_feature_spec
from tputrain.data.manifest import is_var_len
from tputrain.optim.ema import load_averages
from tputrain.runtime.keras_clone import has_lora, mirror_lora_and_trainable
from tputrain.precision.layers import override_layer_dtypes
from tputrain.precision.policy import run_policy
from tputrain.runtime.model_state import ensure_built
from tputrain.runtime.trainable_change import checkpoint_has_lora
from tputrain.runtime.run_view import RunView, view_of
from tputrain.tasks.digits import FEATURES as DIGITS_FEATURES, DigitsTask

if TYPE_CHECKING:  # annotations only: the Trainer imports the actions
    from tputrain.task import Task

EXPORT_DIR = RunDirectory.EXPORT
VERTEX_MODEL_DIR = "AIP_MODEL_DIR"  # set by Vertex AI: where the model artifacts go


def feature_spec_of(task: "Task") -> dict[str, tf.io.FixedLenFeature] | None:
    """The Task's tf.Example feature spec, for the `serving_examples` signature.

    Looked up, in order: a `feature_spec` attribute or method of the Task (add one
    to your Task to get the signature), the built-in DigitsTask's, and the
    `features` of input builders in `task.inputs` (MLPClassifierTask over
    `TFRecordInput`s). None: the Task has none, or it has variable-length features
    (serving them would need the inputs' packing or padding); only
    `serving_default` is written.
    """
    spec = getattr(task, "feature_spec", None)
    spec = spec() if callable(spec) else spec
    if spec is None and isinstance(task, DigitsTask):
        spec = DIGITS_FEATURES
    if spec is None and isinstance(getattr(task, "inputs", None), Mapping):
        found = [b.features for b in task.inputs.values() if isinstance(
            getattr(b, "features", None), Mapping)]
        spec = found[0] if found else None
    if not spec:
        return None
    parsed = parse_feature_spec(spec, var_len=True)
    if any(is_var_len(feature) for feature in parsed.values()):
        logging.info("export: no serving_examples signature: the features %s are variable-length",
                     sorted(name for name, f in parsed.items() if is_var_len(f)))
        return None
    return parsed


_AUTOMATIC_NAME = re.compile(r"keras_tensor(_\d+)?")  # Keras's name for an unnamed input


def serving_inputs(view: RunView, model: keras.Model) -> Any:
    """The signature's inputs: the features the model trains on (`signature_inputs`)."""
    view = view_of(view)  # a Trainer, an action's context or a view
    return signature_inputs(model, view.inputs.micro_batch_spec()[0])


def signature_inputs(model: keras.Model, features: Any) -> Any:
    """The `TensorSpec`s a SavedModel of `model` takes for `features` (the train split's
    feature specs): any batch size, named after the model's inputs, restricted to the
    named inputs of a functional model (it ignores the rest); a list of inputs keeps
    its order, each served under its `keras.Input` name."""
    if isinstance(features, tf.TensorSpec):
        return tf.TensorSpec([None, *features.shape[1:]], features.dtype,
                             name=_single_input_name(model))
    if isinstance(features, (list, tuple)) and all(isinstance(s, tf.TensorSpec)
                                                   for s in features):
        return [tf.TensorSpec([None, *spec.shape[1:]], spec.dtype, name=name)
                for spec, name in zip(features, _input_names(model, len(features)))]
    if not (isinstance(features, Mapping)
            and all(isinstance(s, tf.TensorSpec) for s in features.values())):
        raise ValueError("export needs the model's features to be one tensor or a dict of "
                         f"tensors, got {features}: export your model by hand "
                         "(tf.saved_model.save) for other structures")
    try:
        names = set(model.input) if isinstance(model.input, Mapping) else set(features)
    except (AttributeError, ValueError):  # a subclassed model has no declared inputs
        names = set(features)
    return {name: tf.TensorSpec([None, *spec.shape[1:]], spec.dtype, name=name)
            for name, spec in sorted(features.items()) if name in names}


def _input_names(model: keras.Model, count: int) -> list[str]:
    """A list of inputs' names: each `keras.Input`'s `name=`, else "input_<i>" (its
    place: the automatic `keras_tensor_N` changes with every model built)."""
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError, TypeError):  # a subclassed model declares none
        inputs = []
    names = [getattr(inputs[i], "name", None) if i < len(inputs) else None
             for i in range(count)]
    return [name if isinstance(name, str) and name and not name.startswith("keras_tensor")
            else f"input_{i}" for i, name in enumerate(names)]


def _single_input_name(model: keras.Model) -> str:
    """What a client knows a functional model's one `keras.Input` by: its `name=`, else
    "input_layer", Keras's name for the layer of an unnamed input (keras.applications'
    models), never the automatic `keras_tensor_N`, which changes with every model built
    in the process; "inputs" for a subclassed model (it declares none)."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    name = getattr(inputs[0], "name", None) if inputs and len(inputs) == 1 else None
    if not (isinstance(name, str) and name):
        return "inputs"
    return "input_layer" if _AUTOMATIC_NAME.fullmatch(name) else name


@tracing.graph_helper
def _float32_outputs(outputs: Any) -> dict[str, tf.Tensor]:
    """Named outputs, floating point ones cast to float32 (bfloat16 never leaves)."""
    if isinstance(outputs, Mapping):
        items = list(outputs.items())
    elif isinstance(outputs, (list, tuple)):
        items = [(f"output_{i}", output) for i, output in enumerate(outputs)]
    else:
        items = [("outputs", outputs)]
    return {name: tf.cast(value, tf.float32) if value.dtype.is_floating else value
            for name, value in items}


def restored_model(view: RunView, checkpoint: str) -> keras.Model:
    """A new model from the Task, built outside any strategy under the training
    precision, holding the weights of `checkpoint` (the optimizer is not read); with
    `Trainer.ema_decay`, its EMA weights (`tputrain.optim.ema`) where it has them."""
    view = view_of(view)  # a Trainer, an action's context or a view
    with run_policy(view.plan.precision):
        model = view.task.build_model()
    ensure_built(model, view.inputs.micro_batch_spec()[0])
    if has_lora(view.model) and not has_lora(model):  # enabled on trainer.model
        mirror_lora_and_trainable(view.model, model)
    elif not has_lora(model) and checkpoint_has_lora(checkpoint):
        raise ValueError(f"checkpoint {checkpoint} holds LoRA factors and the Task's model has "
                         "none: export from the Trainer whose model has LoRA enabled "
                         "(tputrain.serving.keras_saving.export_for_serving(trainer)), or enable it in "
                         "Task.build_model")
    override_layer_dtypes(model, view.options.precision.keep_float32_layers)  # as trained
    tf.train.Checkpoint(**model_trackables(model, checkpoint)).read(checkpoint).expect_partial() \
        .assert_existing_objects_matched()
    if view.options.ema_decay is not None and load_averages(model, checkpoint):
        logging.info("tputrain: exporting the EMA weights of %s", checkpoint)
    return model


def save_serving_model(model: keras.Model, inputs: Any, path: str,
                       examples: Mapping[str, tf.io.FixedLenFeature] | None = None) -> list[str]:
    """Writes `model` as a SavedModel at `path`; returns the signature names."""
    @tf.function(input_signature=[inputs])
    @tracing.graph_helper  # the model's call is Keras's: AutoGraph converts none of it
    def serve(features):
        return _float32_outputs(model(features, training=False))

    signatures = {"serving_default": serve}
    if examples is not None and isinstance(inputs, Mapping):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")])
        @tracing.graph_helper
        def serve_examples(serialized):
            parsed = tf.io.parse_example(serialized, dict(examples))
            features = {name: tf.cast(parsed[name], spec.dtype) for name, spec in inputs.items()}
            return _float32_outputs(model(features, training=False))

        signatures["serving_examples"] = serve_examples
    module = tf.Module()
    module.model = model  # tracks the variables
    with _log_levels_kept():
        tf.saved_model.save(module, path, signatures=signatures)
    return sorted(signatures)


@contextlib.contextmanager
def _log_levels_kept() -> Iterator[None]:
    """Hides the SavedModel writer's INFO lines (renamed inputs, assets, fingerprint),
    then puts the levels back: the writer itself leaves the absl logger at WARNING,
    which would silence the progress lines that follow."""
    loggers = [pylogging.getLogger(name) for name in ("absl", "tensorflow")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(max(logger.getEffectiveLevel(), pylogging.WARNING))
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def checkpoint_to_export(view: RunView, step: int | None = None,
                         best: bool | None = None) -> tuple[str, int, str]:
    """(checkpoint prefix, its step, which: "best"/"latest"/"step N") to export.

    `best` None: the best checkpoint if the run has a `BestCheckpoint` action and
    it kept one, else the latest; True: the best one or an error; False: never.
    """
    view = view_of(view)  # a Trainer, an action's context or a view
    action = next((a for a in view.actions if isinstance(a, BestCheckpoint)), None)
    best_dir = action.directory_of(view) if action else None
    record = best_record(view.model_dir, best_dir) if best is not False else None
    if step is None and record is not None and (best or action is not None):
        return record["checkpoint"], int(record["step"]), f"best {record['metric']} {record['value']:.4g}"
    if best and step is None:
        raise ValueError(f"no best checkpoint in {best_dir or RunDirectory(view.model_dir).best}: "
                         "train with a BestCheckpoint action, or export the latest (--nobest)")
    if action is not None and best is None and step is None:
        logging.warning("tputrain: BestCheckpoint kept no checkpoint yet: exporting the latest")
    listed = list_checkpoints(RunDirectory(view.model_dir).checkpoints).paths
    if step is None:
        if not listed:
            raise ValueError(f"no checkpoint in {view.model_dir}: train first")
        return listed[-1], step_of(listed[-1]), "latest"
    found = [p for p in listed if step_of(p) == step]
    if not found and record is not None and int(record["step"]) == step:
        found = [record["checkpoint"]]
    if not found:
        raise ValueError(f"no checkpoint of step {step} in {view.model_dir}: it has steps "
                         f"{[step_of(p) for p in listed]}")
    return found[0], step, f"step {step}"


def read_for_export(view: RunView, checkpoint: str, fall_back: bool
                    ) -> tuple[keras.Model, str]:
    """(model, the checkpoint read): `checkpoint`, or with `fall_back` (the latest
    was asked for) the newest readable one, as training resumes (`read_newest`). A
    checkpoint that cannot be read is a ValueError naming its files."""
    view = view_of(view)  # a Trainer, an action's context or a view
    directory = os.path.dirname(checkpoint)
    if fall_back:
        older = [p for p in list_checkpoints(directory).paths
                 if step_of(p) <= step_of(checkpoint)] or [checkpoint]
        try:
            path, model = read_newest(older, lambda p: restored_model(view, p), directory)
        except RuntimeError as error:
            raise ValueError(str(error)) from None
        return model, path
    try:
        return restored_model(view, checkpoint), checkpoint
    except UNREADABLE_ERRORS as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(f"cannot read the checkpoint {checkpoint} ({type(error).__name__}: "
                         f"{first}): its files are damaged or truncated; export another step "
                         "(--step)") from None


def export_complete(path: str) -> bool:
    """Whether `path` holds a whole SavedModel: a new folder is renamed into place
    whole, and the writer writes saved_model.pb after the variables."""
    return tf.io.gfile.exists(os.path.join(path, "saved_model.pb"))


def export_destination(view: RunView, step: int, export_dir: str | None = None) -> str:
    """`export_dir`, else $AIP_MODEL_DIR (Vertex AI), else model_dir/export/<step>."""
    view = view_of(view)  # a Trainer, an action's context or a view
    return (export_dir or os.environ.get(VERTEX_MODEL_DIR)
            or RunDirectory(view.model_dir).export_version(step))


def export_checkpoint(view: RunView, step: int | None = None, export_dir: str | None = None,
                      best: bool | None = None, examples: bool = True) -> str:
    """Exports a checkpoint of `trainer`'s model_dir as a SavedModel; returns its path.

    Args:
      view: the run: a Trainer or its `view()` (its Task builds the model; its
        model_dir has the checkpoints).
      step: the checkpoint's step; None: the best (see `checkpoint_to_export`) or latest.
      export_dir: the SavedModel's folder; None: $AIP_MODEL_DIR when set (Vertex AI),
        else model_dir/export/<step>.
      best: export the BestCheckpoint's checkpoint (None: when the run keeps one).
      examples: also write `serving_examples` when the Task has a feature spec.
    """
    view = view_of(view)  # a Trainer, an action's context or a view
    view.checkpointer.sync()  # an async save of the last step may still be writing
    checkpoint, step, which = checkpoint_to_export(view, step, best)
    model, checkpoint = read_for_export(view, checkpoint, which == "latest")
    step = step_of(checkpoint)
    path = export_destination(view, step, export_dir)
    inputs = serving_inputs(view, model)
    spec = feature_spec_of(view.task) if examples else None
    if spec is not None and not (isinstance(inputs, Mapping) and set(inputs) <= set(spec)):
        logging.info("tputrain: no serving_examples signature: the feature spec lacks inputs %s",
                     sorted(set(inputs) - set(spec)) if isinstance(inputs, Mapping) else inputs)
        spec = None
    if spec is not None:  # the inputs only: a request carries no label
        spec = {name: spec[name] for name in inputs}
    names = write_saved_model(model, inputs, spec, path, reusable=export_dir is None
                              and not os.environ.get(VERTEX_MODEL_DIR))
    logging.info("tputrain: exported step %d (%s) to %s, signatures %s", step, which, path,
                 ", ".join(names) if names else "(already there)")
    return path


def remove_stale_temps(path: str) -> None:
    """Removes `path.tmp-*` folders of exports killed on this host (their pid is gone;
    the temp's name says whose it is: `tputrain.checkpointing.atomic.left_by_dead_writer`)."""
    parent, name = os.path.split(path.rstrip("/"))
    host = socket.gethostname()
    for temp in tf.io.gfile.glob(os.path.join(parent, f"{name}{TEMP_MARK}{host}-*")):
        if left_by_dead_writer(temp):
            logging.warning("tputrain: removing %s, left by an export that was killed", temp)
            tf.io.gfile.rmtree(temp)


# How this module's messages name the way to choose the export folder: `tputrain
# export`'s flag; `export_folder_message` puts another there (the Export action's binding).
EXPORT_DIR_FLAG = "--export_dir=DIR"


def export_folder_message(error: BaseException, setting: str) -> str:
    """`error`'s first line, naming `setting` instead of `EXPORT_DIR_FLAG` as the way to
    choose the export folder (for a caller that has no such flag: `tputrain run`)."""
    text = first_line(error)
    return text.replace(EXPORT_DIR_FLAG, setting)


def _existing(path: str, reusable: bool) -> bool:
    """Whether `path` already holds this export (True: nothing to write). Writing into
    an existing folder would change, in place and half-way, a model a server may be
    loading: a file, or another SavedModel not known to be this one, is an error."""
    if not tf.io.gfile.exists(path):
        return False
    if not tf.io.gfile.isdir(path):
        raise NotADirectoryError(f"the export folder {path} is a file: remove the file, or "
                                 f"export to a new folder ({EXPORT_DIR_FLAG})")
    if not tf.io.gfile.listdir(path):
        tf.io.gfile.rmtree(path)  # empty: replaced by the rename below
        return False
    if reusable and tf.io.gfile.exists(os.path.join(path, "saved_model.pb")):
        return True  # model_dir/export/<step> of this step's checkpoint: same weights
    raise FileExistsError(f"{path} already exists: exporting over it would change the model a "
                          f"server may be loading, in place; export to a new folder "
                          f"({EXPORT_DIR_FLAG}), or remove it first")


def write_saved_model(model: keras.Model, inputs: Any, spec: Any, path: str,
                      reusable: bool) -> list[str]:
    """Writes the SavedModel to a temp folder renamed to `path` (it appears whole: TF
    Serving loads any numbered folder it sees); returns the signatures, [] when
    `path` already held this export (`reusable`: model_dir/export/<step>, also when
    a concurrent export of the same step renamed first). A failed write removes its
    temp folder and is one OSError naming the folder and the fix."""
    remove_stale_temps(path)
    if _existing(path, reusable):
        return []
    try:
        with atomic_path(path, overwrite=False) as temp:
            names = save_serving_model(model, inputs, temp, spec)
    except (OSError, tf.errors.OpError) as error:
        if reusable and tf.io.gfile.exists(os.path.join(path, "saved_model.pb")):
            return []  # another export of this step renamed first
        raise _write_error(path, error) from None
    return names


def _write_error(path: str, error: BaseException) -> OSError:
    """One line: why the export could not be written, and what to do."""
    text = first_line(error)
    lowered, code = text.lower(), getattr(error, "errno", None)
    if code == errno.ENOSPC or "no space left" in lowered:
        return OSError(f"no room to export to {path} ({text}): free some space, or export to "
                       f"a folder on a larger disk ({EXPORT_DIR_FLAG})")
    if (code in (errno.EROFS, errno.EACCES, errno.EPERM) or "read-only" in lowered
            or "permission" in lowered or isinstance(error, (PermissionError,
                                                             tf.errors.PermissionDeniedError))):
        return OSError(f"cannot write the export to {path} ({text}): fix the permissions, or "
                       f"export to a writable folder ({EXPORT_DIR_FLAG})")
    return OSError(f"cannot write the export to {path} ({type(error).__name__}: {text}): "
                   f"export to another folder ({EXPORT_DIR_FLAG})")


def __getattr__(name: str) -> Any:
    """`Export`, the action, moved to `tputrain.actions.export` (`_compat.MOVED_NAMES`)."""
    return _compat.moved_name(__name__, name)
