"""Batch inference: every example's outputs, exactly once and in input order.

`predict_weights(trainer, source)` runs `Task.predict_step` (by default
`model(features, training=False)`) with the weights in memory, on the run's
strategy and precision, and returns float32 NumPy arrays: one array for a
model with one output, else a dict (a list or tuple of outputs becomes
`output_0`, `output_1`...).

What is read (`source`):

* a split name ("eval", a named eval set of `Trainer.eval_splits`, or a finite
  "train"): what `Task.build_inputs` yields
  on this host, in its order. Padding rows of a padded split (weight 0, e.g.
  `TFRecordInput(pad_remainder=True)`) are dropped; a split batched with
  `drop_remainder=True` has already lost its last examples: a warning says how
  many (`dropped_remainder`, a second count of the split) and how to keep them.
* NumPy arrays (a dict by input name), one example a row, or a finite
  `tf.data.Dataset` of batches of features or of (features, labels[, weights]),
  as Keras `predict` takes them. With several hosts, host h predicts the h-th
  contiguous block of rows; a dataset is refused there (pass arrays or a glob).
* any other string is a TFRecord glob (as `write_tfrecords` writes them): the
  matched shards in sorted order, each read start to end, parsed as the eval
  split's features by name (no label needed, the task's own preprocessing in
  `build_inputs` is not applied), compressed as their manifest says (or GZIP,
  by its header, without one). With several hosts, host h reads the shards
  h, h + H, ...

Exactly once and in order: this host's examples are cut into steps of
`local replicas x per-replica batch` rows; the last step's missing rows are
zeros with mask False, and a host with fewer steps than another runs
all-padding steps (the step count is agreed first), so every host runs the same
steps. Local replica i of a step takes rows `i*B .. (i+1)*B - 1`. One host: the
local results, stacked in replica order, are the rows in order. Several hosts:
each step's outputs and masks are gathered over all replicas (`strategy.gather`);
replica r is host `r // local`'s local replica `r % local` (the placement
`Inputs.distribute` assumes too), so the rows go back in host order:
[steps, hosts, local, B] -> [hosts, steps, local, B], then the masked rows
(`in_input_order`, unit-tested; on 2 worker processes through the same steps,
`gathered_steps`, in tests/jobs/test_aggregation.py). The same pass gathers
`Task.eval_outputs` for `Task.aggregate_eval` (tputrain/jobs/aggregation.py).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.data.bad_records import register_files
from tputrain.data.batching import dropped_remainder
from tputrain.data.feature_check import manifests_next_to
from tputrain.data.mixture import without_source_ids
from tputrain.data.stages import repeats_forever
from tputrain.data.tfrecord import list_shards
from tputrain.optim.ema import averaged_weights
from tputrain.precision import to_float32
from tputrain.runtime.run_view import RunView, view_of
from tputrain.runtime.validate import reading_input

Outputs = np.ndarray | dict[str, np.ndarray]
SPLITS = ("train", "eval")


def predict(view: RunView, source: Any = "eval", log_every: int = 100) -> Outputs:
    """`Trainer.predict`: restores the latest checkpoint (as `Trainer.evaluate`), then
    `predict_weights`."""
    view = view_of(view)  # a Trainer, an action's context or a view
    if view.checkpointer.restore_latest() is None:
        logging.warning("tputrain: no checkpoint in %s: predicting with the initial "
                        "(untrained) weights", view.model_dir)
    return predict_weights(view, source, log_every)


def predict_weights(view: RunView, source: Any = "eval", log_every: int = 100) -> Outputs:
    """Every example of `source` (a split, a TFRecord glob or data in memory, see the
    module docstring) through the weights in memory (their EMA with `Trainer.ema_decay`,
    as evaluation): float32 arrays, one row per example, in order."""
    view = view_of(view)  # a Trainer, an action's context or a view
    if not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"predict: log_every must be an int >= 1, got {log_every!r}")
    with averaged_weights(view.ema) as averaged:
        if averaged:
            logging.info("tputrain: predicting with the EMA weights")
        with reading_input(_described(source), "mid-prediction"):  # the file named
            return _predicted(view, source, log_every)


def _predicted(view: RunView, source: Any, log_every: int) -> Outputs:
    """`predict_weights` with the model's variables as they are."""
    task, model = view.task, view.model
    batches = split_batches(view, source)
    examples = (source_examples(view, source) if batches is None
                else split_examples(batches, source))
    gathered, masks = gathered_steps(view, examples,
                                     lambda features: task.predict_step(features, model),
                                     log_every, "predict", _described(source))
    if batches is not None:
        warn_dropped(batches, source)
    return _as_outputs(gathered, masks, view.num_hosts)


def warn_dropped(batches: tf.data.Dataset, split: str) -> None:
    """One warning when `batches` (a split's) dropped its last partial batch: how many
    examples were never read, and how to keep them."""
    dropped = dropped_remainder(batches)
    if dropped is None or not dropped[1]:
        return
    total, left_out = dropped
    logging.warning(
        "tputrain: predict: the %r split batches with drop_remainder=True, which left out "
        "%d of the %d examples it holds (%d predicted): to keep them, build it with "
        "pad_remainder=True (TFRecordInput, TFDSInput), or batch without dropping and pad "
        "with tputrain.data.pad_to_batch (padding rows are not predicted), or predict its "
        "files (--input=GLOB)", split, left_out, total, total - left_out)


def _described(source: Any) -> str:
    """`source` for the log: a split or glob by name, data in memory by its kind."""
    if isinstance(source, str):
        return repr(source)
    return "a tf.data.Dataset" if isinstance(source, tf.data.Dataset) else "arrays in memory"


def gathered_steps(view: RunView, examples: tf.data.Dataset, compute: Callable[[Any], Any],
                   log_every: int, what: str,
                   source: str) -> tuple[list[Any], list[np.ndarray]]:
    """`compute` (replica context) over this host's single `examples` (of `source`),
    every host running the same steps: each step's outputs and masks, `[replicas, B,
    ...]` NumPy arrays of every replica (all hosts' gathered), for `in_input_order`;
    `what` names the pass in the log ("predict")."""
    local, hosts = view.local_replicas, view.num_hosts
    per_replica = view.plan.batch.per_replica
    steps = None
    if hosts > 1:  # every host runs the most steps any host needs
        count = int(examples.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
        steps = view.agree(-(-count // (local * per_replica)))
    run = _step_function(view, compute)
    gathered, masks, seen, start = [], [], 0, time.monotonic()
    for number, (group, mask) in enumerate(step_batches(examples, per_replica, local, steps), 1):
        outputs, step_mask = run(group, mask)
        gathered.append(tf.nest.map_structure(np.asarray, outputs))
        masks.append(np.asarray(step_mask).astype(bool))
        seen += int(np.sum(mask))
        if number % log_every == 0:
            logging.info("tputrain: %s: %d batches, %d examples | %.0f examples/s", what,
                         number, seen, seen / max(time.monotonic() - start, 1e-9))
    if not masks:
        raise ValueError(f"{what}: {source} holds no examples")
    logging.info("tputrain: %s: %d examples of %s in %.1fs", what, seen, source,
                 time.monotonic() - start)
    return gathered, masks


def _as_outputs(gathered: list[Any], masks: list[np.ndarray], hosts: int) -> Outputs:
    """The steps' outputs as one array (or a dict of them) of real rows, in order."""
    structure = gathered[0]
    flat = [in_input_order([tf.nest.flatten(g)[i] for g in gathered], masks, hosts)
            for i in range(len(tf.nest.flatten(structure)))]
    if isinstance(structure, np.ndarray):
        return flat[0]
    if isinstance(structure, dict):
        return dict(zip(sorted(structure), flat))  # tf.nest flattens dicts by sorted key
    return {f"output_{i}": array for i, array in enumerate(flat)}


def in_input_order(steps: Sequence[np.ndarray], masks: Sequence[np.ndarray],
                   hosts: int, dtype: Any = np.float32) -> np.ndarray:
    """Real rows, host by host in order, from each step's `[hosts * local, B, ...]`
    outputs and `[hosts * local, B]` masks (see the module docstring); `dtype` None
    keeps the outputs' own (e.g. integer labels)."""
    rows, mask = np.stack(steps), np.stack(masks)
    count, replicas, batch = mask.shape
    shape = (count, hosts, replicas // hosts, batch)
    rows = np.swapaxes(rows.reshape(shape + rows.shape[3:]), 0, 1)
    mask = np.swapaxes(mask.reshape(shape), 0, 1)
    return np.ascontiguousarray(rows[mask], dtype=dtype)


def _step_function(view: RunView, compute: Callable[[Any], Any]) -> Any:
    """A compiled step: a group `[local, B, ...]` in, (`compute`'s outputs, masks) of
    every replica out, `[replicas, B, ...]` (this host's, or all hosts' gathered)."""
    strategy = view.strategy
    local, gather = view.local_replicas, view.num_hosts > 1

    def replica_step(batch: tuple[Any, tf.Tensor]) -> tuple[Any, tf.Tensor]:
        features, mask = batch  # int32: a collective gather takes no bool
        return to_float32(compute(features)), tf.cast(mask, tf.int32)

    @tf.function
    def run(group: Any, mask: tf.Tensor) -> tuple[Any, tf.Tensor]:
        batches = [tf.nest.map_structure(lambda t, r=r: t[r], (group, mask))
                   for r in range(local)]
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: batches[ctx.replica_id_in_sync_group % local])
        results = strategy.run(replica_step, args=(values,))
        if gather:
            return tf.nest.map_structure(lambda v: _by_replica(strategy.gather(v, axis=0),
                                                               mask.shape[1]), results)
        return tf.nest.map_structure(
            lambda v: tf.stack(strategy.experimental_local_results(v)), results)
    return run


def _by_replica(rows: tf.Tensor, batch: int) -> tf.Tensor:
    """`[replicas * B, ...]` gathered rows as `[replicas, B, ...]`."""
    return tf.reshape(rows, tf.concat([[-1, batch], tf.shape(rows)[1:]], 0))


def step_batches(examples: tf.data.Dataset, per_replica: int, local: int,
                 steps: int | None = None) -> tf.data.Dataset:
    """Single examples -> per step `(features [local, B, ...], mask [local, B])`, the
    last step's missing rows zeros with mask False; `steps`: topped up with
    all-padding steps to that many."""
    spec = examples.element_spec
    padding = tf.data.Dataset.from_tensors((_blank(spec), False)).repeat()
    rows = per_replica * local
    batched = (examples.map(lambda f: (f, True)).concatenate(padding)
               .batch(rows, drop_remainder=True).take_while(lambda f, m: m[0]))
    if steps is not None:
        empty = padding.batch(rows, drop_remainder=True)
        batched = batched.concatenate(empty).take(steps)

    def split(features: Any, mask: tf.Tensor) -> tuple[Any, tf.Tensor]:
        return tf.nest.map_structure(
            lambda t: tf.reshape(t, [local, per_replica] + t.shape[1:]), (features, mask))
    return batched.map(split).prefetch(2)


def _blank(spec: Any) -> Any:
    """A zero (or empty-string) example shaped like `spec`: a padding row."""
    return tf.nest.map_structure(
        lambda s: tf.fill(s.shape, tf.constant("", tf.string)) if s.dtype == tf.string
        else tf.zeros(s.shape, s.dtype), spec)


def source_examples(view: RunView, source: Any) -> tf.data.Dataset:
    """This host's single examples (features only) of a split, a TFRecord glob, NumPy
    arrays or a dataset of batches."""
    splits = _splits(view)
    if isinstance(source, (tf.data.Dataset, np.ndarray, dict, list, tuple)):
        return memory_examples(source, view.num_hosts, view.host_id)
    if not isinstance(source, str) or not source:
        raise ValueError(f"predict: the input must be a split {splits}, a TFRecord glob, "
                         f"NumPy arrays or a tf.data.Dataset of batches, got {source!r}")
    if source in splits:
        return split_examples(split_batches(view, source), source)
    try:
        return tfrecord_examples(source, view.inputs.eval_dataset.element_spec,
                                 view.num_hosts, view.host_id)
    except FileNotFoundError as error:  # perhaps a split's name mistyped: say which there are
        raise FileNotFoundError(f"{error}; or name a split of the task: "
                                f"{', '.join(map(repr, splits))}") from error


def split_batches(view: RunView, source: Any) -> tf.data.Dataset | None:
    """This host's batches of the split `source` names, as the task builds them;
    None when `source` names no split."""
    if not isinstance(source, str) or source not in _splits(view):
        return None
    return view.task.build_inputs(source, view.inputs.input_context())


def _splits(view: RunView) -> tuple[str, ...]:
    """The split names predict reads: train, eval and the named eval sets."""
    return tuple(dict.fromkeys((*SPLITS, *view.plan.options.eval_splits)))


def memory_examples(source: Any, hosts: int, host: int) -> tf.data.Dataset:
    """Single feature examples of what Keras's `predict` takes: NumPy arrays (a dict by
    input name, or a list), one example a row, or a finite `tf.data.Dataset` of batches
    of features or of (features, labels[, weights]). With several hosts, host h takes
    the h-th contiguous block of rows (host order is input order); a dataset cannot be
    cut so without reading it, so it is refused there."""
    if isinstance(source, tf.data.Dataset):
        if hosts > 1:
            raise ValueError("predict: a tf.data.Dataset on several hosts cannot be dealt "
                             "to them in order: pass NumPy arrays or a TFRecord glob")
        return split_examples(source, "input")
    arrays = tf.nest.map_structure(np.asarray, source)
    rows = {len(a) for a in tf.nest.flatten(arrays)}
    if len(rows) != 1:
        raise ValueError(f"predict: the arrays have different numbers of rows: {sorted(rows)}")
    total = rows.pop()
    start = host * (total // hosts) + min(host, total % hosts)  # as np.array_split cuts
    stop = start + total // hosts + (host < total % hosts)
    block = tf.nest.map_structure(lambda a: a[start:stop], arrays)
    return tf.data.Dataset.from_tensor_slices(block)


def split_examples(dataset: tf.data.Dataset, split: str) -> tf.data.Dataset:
    """Per-replica batches -> single feature examples, padding (weight 0) dropped, a
    mixture's source id left out (the model never gets it, as in evaluation)."""
    if repeats_forever(dataset):
        raise ValueError(f"predict: the {split} split repeats forever: predict a finite "
                         "split or a TFRecord glob")
    dataset = without_source_ids(dataset)
    spec = dataset.element_spec
    if not isinstance(spec, tuple):
        return dataset.unbatch()
    if len(spec) == 3:
        return dataset.map(_features_and_weights).unbatch().filter(_real).map(_features)
    return dataset.map(lambda f, *_: f).unbatch()


# Named functions, not lambdas: AutoGraph cannot tell two lambdas on one line apart
# and warns that it runs them as they are.
def _features_and_weights(features: Any, labels: Any, weights: tf.Tensor) -> tuple[Any, tf.Tensor]:
    del labels
    return features, weights


def _real(features: Any, weight: tf.Tensor) -> tf.Tensor:
    del features
    return weight > 0


def _features(features: Any, weight: tf.Tensor) -> Any:
    del weight
    return features


def tfrecord_examples(pattern: str, eval_spec: Any, hosts: int,
                      host: int) -> tf.data.Dataset:
    """The shards of `pattern` in sorted order, each read start to end, parsed as the
    eval split's features (by name; cast to their dtypes)."""
    features = eval_spec[0] if isinstance(eval_spec, tuple) else eval_spec
    if not isinstance(features, dict):
        raise ValueError("predict: reading TFRecords needs a task whose eval features are a "
                         f"dict of named features, got {features}")
    parse = {name: tf.io.FixedLenFeature(spec.shape[1:], _parse_dtype(spec.dtype))
             for name, spec in features.items()}
    every = list_shards([pattern], None, parse)
    compression, files = shard_compression(pattern, every), every[host::hosts]
    if not files:
        raise ValueError(f"predict: {pattern!r} has fewer shards than the {hosts} hosts")
    register_files(files, compression)  # a corrupt record's error names its file
    # sequential: file order, then record order
    records = tf.data.TFRecordDataset(files, compression_type=compression)

    def parse_one(record: tf.Tensor) -> dict[str, tf.Tensor]:
        parsed = tf.io.parse_single_example(record, parse)
        return {name: tf.cast(parsed[name], features[name].dtype) for name in features}
    return records.map(parse_one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def shard_compression(pattern: str, files: Sequence[str]) -> str:
    """How `pattern`'s shards are compressed ("" none, "GZIP", "ZLIB"): as the manifest
    beside a shard says, else GZIP when the file starts as a gzip file does (ZLIB has no
    such mark: it needs the manifest `write_tfrecords` writes)."""
    listed = {path: manifest.compression_type or ""
              for manifest in manifests_next_to(files) for path in manifest.files()}
    kinds = {listed[path] if path in listed else _gzip_or_none(path) for path in files}
    if len(kinds) > 1:
        raise ValueError(f"predict: the shards of {pattern!r} are compressed in different "
                         f"ways ({sorted(k or 'none' for k in kinds)}): predict each kind "
                         "with its own glob")
    return kinds.pop() if kinds else ""


def _gzip_or_none(path: str) -> str:
    """"GZIP" if the file begins with gzip's magic bytes, else "" (uncompressed)."""
    with tf.io.gfile.GFile(path, "rb") as file:
        return "GZIP" if file.read(2) == b"\x1f\x8b" else ""


def _parse_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype tf.io.parse_example can read a feature of `dtype` as."""
    if dtype == tf.string:
        return tf.string
    return tf.float32 if dtype.is_floating else tf.int64
