"""Pre-flight checks: bad inputs fail in one line that names the fix, before compute.

The Trainer runs these after building its inputs and before writing anything
to model_dir: the first batch can be read (a corrupt or truncated TFRecord fails
here, not an hour in), model_dir is writable and has room for checkpoints, and
a gs:// bucket exists and accepts writes.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
import uuid
from typing import Any, Iterable, Iterator, Mapping, Sequence

import keras
import tensorflow as tf
from absl import logging

from tputrain.checkpointing.files import first_line, readable_sizes
from tputrain.checkpointing.run_directory import ModelDirError, RunDirectory  # noqa: F401  (ModelDirError: its old place)
from tputrain.data import (FeatureSpecError, InputStateError, explain_data_loss,
                           explain_parse_error)
from tputrain.data.external_state import not_checkpointable
from tputrain.data.stages import repeats_forever
from tputrain.data.options import without_autotune
from tputrain.loop import compile_cache
from tputrain.runtime.gcs import check_bucket_writable  # google-cloud-storage itself loads lazily there

_MIB = 1 << 20


class InputDataError(ValueError):
    """The input data cannot be read (corrupt or truncated records)."""


def corrupt_data_message(error: tf.errors.OpError, split: str, where: str) -> str:
    return (f"the {split} data is corrupt {where} ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0]}): a TFRecord file is damaged or "
            "truncated; rewrite it (tputrain.data.write_tfrecords), remove it, or set "
            "TFRecordInput.skip_corrupt=True to skip bad records")


def input_data_error(error: tf.errors.OpError, split: str, where: str) -> Exception:
    """The one-line error for unreadable input: the file and record when
    `tputrain.data` can locate them (`CorruptRecordError`), else `InputDataError`."""
    explained = explain_data_loss(error)
    if explained is not error:
        return explained
    return InputDataError(corrupt_data_message(error, split, where))


@contextlib.contextmanager
def reading_input(split: str, where: str) -> Iterator[None]:
    """Around reading a split outside the train loop (counting an eval set, evaluating,
    predicting): a corrupt record is `input_data_error`'s one line naming the file and
    the fix, not TensorFlow's `corrupted record at N` traceback (a damaged compile-cache
    entry read by the step is `compile_cache.read_error`'s)."""
    try:
        yield
    except tf.errors.DataLossError as error:  # the compile cache's, or the data's
        raise (compile_cache.read_error(error) or input_data_error(error, split, where)) from None


def probe_inputs(dataset: tf.data.Dataset, split: str) -> Any:
    """Reads one element through a throwaway iterator and returns it (the first
    batch, whose labels `tputrain.loop.labels` checks); raises the input error.

    Costs one batch of reading at start-up: the price of failing before any
    training (or compilation) time is spent.
    Corrupt records raise `CorruptRecordError`/`InputDataError`; records that do
    not match the feature spec raise `tputrain.data.FeatureSpecError` (naming the
    file, feature and what the record holds) instead of TF's parse error.
    """
    try:
        first = next(iter(without_autotune(dataset.take(1))), None)
        if first is None:  # training would end in StopIteration
            raise InputDataError(
                f"the {split} data yields no batch: its files are empty (0-byte shards?) or "
                "hold fewer examples than one batch: check the file pattern or manifest, or "
                "lower Trainer.global_batch_size")
    except tf.errors.DataLossError as error:
        raise input_data_error(error, split, "in its first batch") from None
    except tf.errors.InvalidArgumentError as error:
        raise _feature_spec_error(error, split) from None
    return first


def check_eval_split(dataset: tf.data.Dataset, eval_steps: int | None,
                     split: str = "eval") -> None:
    """Without `eval_steps` the eval split is counted to its end: refuse one that
    has no end before training starts (counting it would never return)."""
    if eval_steps is None and repeats_forever(dataset):
        raise ValueError(
            f"the {split} split repeats forever (build_inputs({split!r}, ...) returns a repeated "
            f"dataset): set eval_steps=N (batches per evaluation) or do not repeat the {split} "
            "split")


def check_splits(inputs: Any, eval_splits: Sequence[str], eval_steps: int | None
                 ) -> dict[str, Any]:
    """Reads a batch of the train split and of each eval set (`probe_inputs`: corrupt
    records and missing files fail here, before anything is built), and refuses an
    endless eval set that would be counted to its end (`check_eval_split`). The
    train split is left unread for a Task that says so (`Task.probe_train_inputs`)."""
    probe_train = getattr(inputs.task, "probe_train_inputs", True)
    first = {split: probe_inputs(inputs.dataset(split), split)
             for split in (("train", *eval_splits) if probe_train else eval_splits)}
    for split in eval_splits:
        check_eval_split(inputs.dataset(split), eval_steps, split)
    return first


def _unknown_split(task: Any, eval_splits: Sequence[str], name: str,
                   known: Sequence[str] | None) -> ValueError:
    task_name = type(task).__name__
    fix = (f"its splits are {tuple(known)}" if known is not None else
           f"{task_name}.build_inputs({name!r}) raised KeyError: name a split it builds "
           f"(a Task lists them in `{task_name}.splits`)")
    return ValueError(f"Trainer.eval_splits={tuple(eval_splits)} names {name!r}, which "
                      f"{task_name} has no data for: {fix}")


def check_split_names(task: Any, eval_splits: Sequence[str]) -> None:
    """A Task that lists its splits (`Task.splits`): each eval set must be one of them."""
    known = getattr(task, "splits", None)
    for name in eval_splits if known is not None else ():
        if name not in known:
            raise _unknown_split(task, eval_splits, name, known)


@contextlib.contextmanager
def named_splits(task: Any, eval_splits: Sequence[str]) -> Iterator[None]:
    """Around building the inputs: a KeyError naming an eval set (a Task's dict of
    splits has no such key) is one line naming the set, not a traceback."""
    try:
        yield
    except KeyError as error:
        name = error.args[0] if len(error.args) == 1 else None
        if not isinstance(name, str) or name not in eval_splits:
            raise
        raise _unknown_split(task, eval_splits, name, getattr(task, "splits", None)) from None


def _shapes(structure: Any) -> dict[str, tuple]:
    """{feature path: shape past the batch axis} of a nest of specs or Keras inputs."""
    return {"/".join(map(str, path)): tuple(tf.TensorShape(leaf.shape)[1:])
            for path, leaf in keras.tree.flatten_with_path(structure)}


def _model_inputs(model: Any, train_features: Any) -> tuple[dict[str, tuple], str, bool]:
    """(shapes the model takes by feature path, where from, whether a missing feature
    is an error): a functional model's inputs (by name for a list of them, as Keras
    matches a dict of features), else the train features the model was built on."""
    try:
        structure = model.input
    except (AttributeError, ValueError, TypeError):  # a subclassed model declares none
        return _shapes(train_features), "the train features", False
    if isinstance(structure, (list, tuple)) and isinstance(train_features, Mapping):
        structure = {getattr(t, "name", str(i)): t for i, t in enumerate(structure)}
    return _shapes(structure), "the model's input", isinstance(structure, Mapping)


def check_eval_features(model: Any, train_features: Any, eval_features: Mapping[str, Any]
                        ) -> None:
    """Each eval set's features against what the model takes, before anything is
    written: a mismatch was a long Keras traceback at the first evaluation."""
    expected, source, named = _model_inputs(model, train_features)
    for split, features in eval_features.items():
        shapes = _shapes(features)
        for path, shape in expected.items():
            label = repr(path) if path else "features"
            if path not in shapes and named:
                raise ValueError(f"the {split} split has no feature {label}, which {source} "
                                 f"has (shaped {shape} an example): make build_inputs"
                                 f"({split!r}) yield the train split's features")
            if path in shapes and not tf.TensorShape(shapes[path]).is_compatible_with(shape):
                raise ValueError(f"the {split} split's feature {label} is shaped "
                                 f"{shapes[path]} an example, but {source} is {shape}: make "
                                 f"build_inputs({split!r}) yield the train split's shapes")


def _feature_spec_error(error: tf.errors.InvalidArgumentError, split: str) -> Exception:
    """The parse error explained by `tputrain.data`, with the split named, or `error`."""
    explained = explain_parse_error(error)
    if isinstance(explained, FeatureSpecError):
        return FeatureSpecError(f"the {split} data does not match its feature spec: {explained}")
    return error


def variable_bytes(variables: Iterable[Any]) -> int:
    """Bytes of the given variables (an estimate of one checkpoint's size)."""
    total = 0
    for variable in variables:
        total += int(tf.TensorShape(variable.shape).num_elements() or 0) * tf.as_dtype(
            variable.dtype).size
    return total


def _named(error: Exception, pattern: str) -> str:
    """What `pattern`'s group names in TensorFlow's message, else its first line."""
    found = re.search(pattern, str(error))
    return found.group(1) if found else str(error).strip().splitlines()[0]


def iterator_state_bytes(dataset: tf.data.Dataset) -> int:
    """Bytes a checkpoint of an iterator over `dataset` takes once it has started.

    Measured, not guessed: a throwaway iterator takes one element (which fills
    shuffle and prefetch buffers, the bulk of the state) and is written to memory
    (`ram://`). Costs one element of reading and its state's size in RAM. State
    tf.data refuses to save raises `InputStateError`, before the first checkpoint.
    """
    iterator = iter(dataset)
    next(iterator)
    prefix = f"ram://tputrain-size-probe-{uuid.uuid4().hex[:8]}/iterator"
    try:
        tf.train.Checkpoint(iterator=iterator).write(prefix)
    except tf.errors.FailedPreconditionError as error:
        # State tputrain.data.external_state did not find (it saves around what it finds).
        op = _named(error, r"(\w+) is stateful")
        raise InputStateError(
            f"the train input pipeline holds state tf.data cannot checkpoint (the op {op}): set "
            "InputOptions.external_state_policy='ignore' to save the iterator without it "
            "(a resumed run then restarts that state), or use Trainer.input_mode="
            "'distributed', which resumes by skipping batches") from None
    except tf.errors.UnimplementedError as error:  # e.g. "GeneratorDataset does not support"
        raise not_checkpointable(_named(error, r"(\w+Dataset) does not support checkpointing")
                                 ) from None
    files = tf.io.gfile.glob(f"{prefix}*")
    size = sum(tf.io.gfile.stat(f).length for f in files)
    for path in files:
        tf.io.gfile.remove(path)
    return size




def check_model_dir(model_dir: str, checkpoint_bytes: int = 0, keep: int = 2,
                    best_copy: bool = False) -> None:
    """Fails with the fix if model_dir cannot take this run's checkpoints and logs.

    Creates model_dir, writes and deletes a probe file there and in each of its
    existing `checkpoints/`, `train/`, `eval/` folders, and for local paths checks
    the free space against `keep + 1` checkpoints (keep-N holds N while the next
    one is written), one more with `best_copy` (a BestCheckpoint copies a new best
    into best/ before it deletes the previous one). gs:// buckets are checked with
    google-cloud-storage first.
    """
    if model_dir.startswith("gs://"):
        check_bucket_writable(model_dir)
    if tf.io.gfile.exists(model_dir) and not tf.io.gfile.isdir(model_dir):
        raise ModelDirError(f"model_dir {model_dir} is a file, not a directory: pass a "
                            "directory path as --model_dir")
    directory = model_dir
    try:
        tf.io.gfile.makedirs(model_dir)
        # model_dir and what tputrain writes inside it; each existing one must take writes.
        for directory in RunDirectory(model_dir).written():
            if directory == model_dir or tf.io.gfile.isdir(directory):
                _write_probe(directory, checkpoint_bytes)
    except (tf.errors.OpError, OSError) as error:
        raise ModelDirError(_explain_write_error(directory, error)) from None
    if "://" not in model_dir and checkpoint_bytes:
        free = shutil.disk_usage(model_dir).free
        copies = keep + 1 + int(best_copy)
        needed = copies * checkpoint_bytes
        if free < needed:
            best = " and the copy of a new best" if best_copy else ""
            shown_free, shown_one, shown_needed = readable_sizes(free, checkpoint_bytes, needed)
            raise ModelDirError(
                f"model_dir {model_dir} has {shown_free} free but a checkpoint needs "
                f"{shown_one} (x{copies} = {shown_needed}: keep_checkpoints={keep} "
                f"plus the one being written{best}): free some space, lower "
                "Trainer.keep_checkpoints or choose a --model_dir on a larger disk")
        logging.debug("tputrain: model_dir %s has %.0f MiB free", model_dir, free / _MIB)


def _write_probe(directory: str, checkpoint_bytes: int) -> None:
    write_probe(directory, min(max(checkpoint_bytes, 1), _MIB))


def write_probe(directory: str, size: int = 1) -> None:
    """Writes and deletes a probe file of `size` bytes in `directory` (raises the store's
    error: `write_failure` says which kind)."""
    probe = f"{directory.rstrip('/')}/.tputrain-write-test-{uuid.uuid4().hex[:8]}"
    with tf.io.gfile.GFile(probe, "wb") as f:
        f.write(b"\0" * size)
    tf.io.gfile.remove(probe)


def write_failure(error: Exception) -> tuple[str, str]:
    """(kind, first line) of a failed write: "full", "not writable", "not a directory"
    or "other"."""
    text = first_line(error)
    code = getattr(error, "errno", None)
    lowered = text.lower()
    if code == errno.ENOSPC or "no space left" in lowered:
        return "full", text
    if (code in (errno.EROFS, errno.EACCES, errno.EPERM)
            or isinstance(error, (tf.errors.PermissionDeniedError, PermissionError))
            or "read-only" in lowered or "permission" in lowered):
        return "not writable", text
    if code == errno.ENOTDIR or "not a directory" in lowered:
        return "not a directory", text
    return "other", text


def _explain_write_error(model_dir: str, error: Exception) -> str:
    kind, text = write_failure(error)
    if kind == "full":
        return (f"model_dir {model_dir} is full ({text}): free some space or "
                "choose a --model_dir on a larger disk")
    if kind == "not writable":
        return (f"model_dir {model_dir} is not writable ({text}): choose a "
                "writable --model_dir or fix its permissions")
    if kind == "not a directory":
        return (f"model_dir {model_dir} is inside a file, not a directory "
                f"({text}): choose another --model_dir")
    return (f"cannot write to model_dir {model_dir} ({type(error).__name__}: "
            f"{text}): choose a writable --model_dir")
