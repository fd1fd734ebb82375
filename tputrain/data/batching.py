"""Per-replica batching shared by the input builders (TFRecordInput, TFDSInput).

Every builder resolves the per-replica batch from the `InputContext`, batches
with `drop_remainder=True` (static shapes), optionally splits off the label and
checks that every shape is static. For datasets that fit in memory,
`in_memory_batches` serves batches by index from tensors held in RAM: one
gather per batch instead of per-example shuffle and batch work, which matters
on hosts with few cores, where tf.data threads compete with the train step.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Callable, Mapping

import keras
import tensorflow as tf
from absl import logging

from tputrain.core import tracing
from tputrain.core.checks import check_bool, check_int
from tputrain.data.context import InputContext
from tputrain.data.epochs import by_epoch, shuffle_epoch
from tputrain.data.file_cache import cache_file, written_cache
from tputrain.data.options import InputOptions
from tputrain.data.pipeline_facts import mark_in_memory

_CHUNK_BYTES = 16 * 2**20  # in-memory batches are gathered this much at a time
_NOT_STATIC = "pad or resize every example to one shape before batching"


def resolve_per_replica_batch(builder: str, configured: int | None,
                              context: InputContext) -> int:
    """The per-replica batch, from the builder's own global batch or the context's."""
    global_batch = configured
    if global_batch is None:
        global_batch = context.global_batch_size
    elif context.global_batch_size not in (None, global_batch):
        logging.warning(
            "%s.global_batch_size=%d overrides the input context's global batch %d: set it "
            "in one place (usually the Trainer)", builder, global_batch,
            context.global_batch_size)
    if global_batch is None:
        raise ValueError(
            f"{builder} has no global batch size: set {builder}.global_batch_size or pass an "
            "InputContext with global_batch_size (the Trainer does this)")
    return context.get_per_replica_batch_size(global_batch)


@tracing.graph_helper
def split_label(features: dict[str, Any], label_key: str | None):
    """`features` itself, or `(features without the label, label)`."""
    if label_key is None:
        return features
    features = dict(features)
    label = features.pop(label_key)
    return features, label


@tracing.graph_helper
def pad_to_batch(batch: Any, batch_size: int) -> tuple[Any, Any, tf.Tensor]:
    """`(features, labels)` of up to `batch_size` rows -> `(features, labels, weights)`.

    Rows past the real ones are zeros with weight 0, so an eval split of any size
    keeps the static batch shape TPUs need without dropping its last examples:
    losses and metrics weighted by `weights` count only the real rows.
    """
    if not (isinstance(batch, tuple) and len(batch) == 2):
        raise ValueError("pad_remainder needs (features, labels) batches: set label_key")
    rows = tf.shape(tf.nest.flatten(batch)[0])[0]

    def pad(t: tf.Tensor) -> tf.Tensor:
        padding = [[0, batch_size - rows]] + [[0, 0]] * (t.shape.rank - 1)
        return tf.ensure_shape(tf.pad(t, padding), [batch_size] + t.shape[1:])

    weights = tf.sequence_mask(rows, batch_size, dtype=tf.float32)
    return (*tf.nest.map_structure(pad, batch), weights)


def check_pad_remainder(builder: str, pad_remainder: bool, repeat: bool,
                        label_key: str | None) -> None:
    """Padding with weights is for a finite, labelled (eval) split."""
    if pad_remainder and (repeat or label_key is None):
        raise ValueError(f"{builder}: pad_remainder is for evaluation: it needs repeat=False "
                         "and a label_key")


_ROLES = ("features", "labels", "sample weights")


def _described(path: tuple, roles: bool) -> str:
    """How an error names an element: `feature 'pixels'`, `the labels`... when the
    spec is a `(features, labels[, weights])` tuple; else `feature 'a/b'` by path."""
    if not roles:
        return f"feature {'/'.join(map(str, path)) or '<root>'!r}"
    role, rest = _ROLES[path[0]], "/".join(map(str, path[1:]))
    if not rest:
        return f"the {role}"
    return f"{'feature' if role == 'features' else role} {rest!r}"


def drops_remainder(dataset: tf.data.Dataset) -> bool | None:
    """Whether the last batch op under `dataset` drops the remainder; None when no
    batch op is found. Walks tf.data's private `_input_dataset` chain: an error
    message's hint, never a decision about the data."""
    node = dataset
    while node is not None:
        flag = getattr(node, "_drop_remainder", None)
        if flag is not None:
            value = tf.get_static_value(flag)
            return None if value is None else bool(value)
        node = getattr(node, "_input_dataset", None)
    return None


# Datasets `in_memory_batches` returned without repeat -> (examples, examples left
# out): they batch by index, with no batch op a walk could find.
_IN_MEMORY_REMAINDERS: "weakref.WeakKeyDictionary[tf.data.Dataset, tuple[int, int]]" = (
    weakref.WeakKeyDictionary())


def dropped_remainder(dataset: tf.data.Dataset) -> tuple[int, int] | None:
    """(examples batched, examples the dropped last partial batch left out) of a finite
    `dataset` whose last batch op drops its remainder; None for any other dataset.

    Counts the batch op's input, a second pass over it (serialized records for
    `TFRecordInput`, no parsing): call it once a pass is done, to report the loss
    (`tputrain predict`), never on the hot path.
    """
    node = dataset
    while node is not None:
        if node in _IN_MEMORY_REMAINDERS:
            return _IN_MEMORY_REMAINDERS[node]
        flag = getattr(node, "_drop_remainder", None)
        if flag is not None:
            batch = tf.get_static_value(getattr(node, "_batch_size", None))
            examples = getattr(node, "_input_dataset", None)
            if not tf.get_static_value(flag) or batch is None or examples is None:
                return None
            count = int(examples.cardinality())
            if count == int(tf.data.INFINITE_CARDINALITY):
                return None
            if count < 0:  # unknown: count them
                count = int(examples.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
            return count, count % int(batch)
        node = getattr(node, "_input_dataset", None)
    return None


# Datasets the builders returned -> their label_key: the feature a label error names.
_LABEL_KEYS: "weakref.WeakKeyDictionary[tf.data.Dataset, str]" = weakref.WeakKeyDictionary()


def label_key_of(dataset: tf.data.Dataset) -> str | None:
    """The `label_key` of the builder (TFRecordInput, MixtureInput, TFDSInput) under
    `dataset`, walking tf.data's private `_input_dataset` chain; None if not found."""
    node = dataset
    while node is not None:
        if node in _LABEL_KEYS:
            return _LABEL_KEYS[node]
        node = getattr(node, "_input_dataset", None)
    return None


def _lost_batch_fix(shape: tf.TensorShape, per_replica_batch: int,
                    drops: bool | None) -> str:
    """The remedy for an unknown batch dimension, given how the dataset batches."""
    rest = list(shape)[1:] if shape.rank is not None else ["..."]
    ensure = (f"end that map with tf.ensure_shape(value, [{per_replica_batch}"
              f"{''.join(f', {d}' for d in rest)}])")
    if drops:
        return ("the batch dimension was lost after batch(drop_remainder=True), by a "
                f"later map (a boolean_mask, py_function or reshape to -1 does that): {ensure}")
    if drops is False:
        return "batch with drop_remainder=True"
    return ("batch with drop_remainder=True; if you already do, a later map lost the batch "
            f"dimension: {ensure}")


def check_static(where: str, element_spec: Any, fix: str = _NOT_STATIC,
                 per_replica_batch: int | None = None,
                 dataset: tf.data.Dataset | None = None) -> None:
    """Fails naming the first feature whose shape is not fully known, or, given
    `per_replica_batch`, whose leading dimension is another batch: XLA compiles one
    shape, so this fails before anything is traced. `where` names the pipeline
    ("TFRecordInput", "train input"); `fix` is the remedy in its terms; given
    `per_replica_batch`, an unknown batch dimension gets its own remedy (`dataset`
    tells whether the batch already drops its remainder)."""
    roles = isinstance(element_spec, tuple) and len(element_spec) in (2, 3)
    for path, spec in keras.tree.flatten_with_path(element_spec):
        name = _described(path, roles)
        shape = getattr(spec, "shape", None)
        if shape is None:
            continue
        if not shape.is_fully_defined():
            lost_batch = per_replica_batch is not None and (
                shape.rank is None or (shape.rank and shape[0] is None))
            remedy = (_lost_batch_fix(shape, per_replica_batch, dataset is not None
                                      and drops_remainder(dataset)) if lost_batch else fix)
            raise ValueError(f"{where}: {name} has dynamic shape {shape}: TPUs and "
                             f"compiled loops need static shapes; {remedy}")
        if per_replica_batch is not None and shape.rank and shape[0] != per_replica_batch:
            raise ValueError(
                f"{where}: {name} has batch dimension {shape[0]} but the per-replica "
                f"batch is {per_replica_batch}: batch with "
                "input_context.get_per_replica_batch_size(input_context.global_batch_size)")


def random_seed() -> int:
    """A seed for `seed=None` (a different order per run, fixed within the run)."""
    return random.SystemRandom().randrange(2**31)


def in_memory_batches(examples: Mapping[str, tf.Tensor], batch_size: int, *, shuffle: bool,
                      seed: int | None, repeat: bool,
                      finish: Callable[[dict[str, tf.Tensor]], Any] | None = None
                      ) -> tf.data.Dataset:
    """Batches of `batch_size` rows of `examples` (a dict of [N, ...] tensors in RAM).

    Like `repeat -> batch(drop_remainder=True)` over the examples, with a full
    permutation per epoch when `shuffle` (the same `seed` gives the same
    orders) and batches that carry on across epoch ends, so every example is
    seen once per epoch. Without `repeat` the last partial batch is dropped.
    `finish` (e.g. splitting off the label) is applied to whole chunks of
    batches. Batches are gathered a chunk (up to ~16 MB) at a time and then
    sliced, so the per-batch cost is one slice: a gather's fixed host cost is
    paid once a chunk instead of once a batch, which dominates for small batches.
    """
    sizes = {name: int(t.shape[0]) for name, t in examples.items()}
    num_examples = next(iter(sizes.values()))
    if len(set(sizes.values())) != 1:
        raise ValueError(f"in-memory features have different lengths: {sizes}")
    if num_examples < batch_size and not repeat:
        raise ValueError(f"{num_examples} examples make no batch of {batch_size}: use a smaller "
                         "batch or more data")
    if num_examples == 0:
        raise ValueError("no examples to batch: the input is empty")
    seed = random_seed() if (shuffle and seed is None) else (seed or 0)
    row_bytes = sum((t.dtype.size or 64) * max(1, t.shape[1:].num_elements() or 1)
                    for t in examples.values())
    batches_per_chunk = int(max(1, min(256, _CHUNK_BYTES // max(1, row_bytes * batch_size))))
    tensors = dict(examples)
    finish = finish or (lambda batch: batch)

    @tracing.graph_helper
    def one_epoch(leftover: tf.Tensor, epoch: tf.Tensor):
        order = tf.range(num_examples, dtype=tf.int32)
        if shuffle:
            order = tf.random.experimental.stateless_shuffle(
                order, seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
        pool = tf.concat([leftover, order], axis=0)
        num_batches = tf.size(pool) // batch_size
        used = num_batches * batch_size
        return pool[used:], tf.reshape(pool[:used], [num_batches, batch_size])

    @tracing.graph_helper  # `finish` too runs unconverted: tputrain's own splits
    def gathered(chunk: tf.Tensor) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices(
            finish({name: tf.gather(t, chunk) for name, t in tensors.items()}))

    epochs = tf.data.Dataset.range(2**62 if repeat else 1)
    index_batches = epochs.scan(tf.zeros([0], tf.int32), one_epoch)
    batches = mark_in_memory(index_batches.flat_map(tracing.graph_helper(
        lambda matrix: tf.data.Dataset.from_tensor_slices(matrix).batch(batches_per_chunk)
        .flat_map(gathered))))
    if not repeat:
        _IN_MEMORY_REMAINDERS[batches] = (num_examples, num_examples % batch_size)
    return batches


def check_cache(builder: str, cache: Any) -> bool | str:
    """`cache` as False, "memory" or a file path prefix (True means "memory")."""
    if cache is None or cache is False:
        return False
    if cache is True or cache == "memory":
        return "memory"
    if isinstance(cache, str) and cache:
        return cache
    raise ValueError(f"{builder}: cache must be False, True/'memory' or a file path prefix, "
                     f"got {cache!r}")


class BatchedInput:
    """What every input builder (TFRecordInput, TFDSInput) shares, written once: the
    checked batching settings, cache -> shuffle -> repeat -> batch, and the tail
    (InputOptions, tf.data options, the static-shape check)."""

    label_key: str | None
    global_batch_size: int | None
    shuffle: bool
    shuffle_buffer: int
    seed: int | None
    repeat: bool
    deterministic: bool | None
    cache: bool | str
    pad_remainder: bool
    options: InputOptions
    static_fix: str = _NOT_STATIC  # the remedy for a dynamic shape, in the builder's terms

    def _set_batching(self, *, label_key: str | None, global_batch_size: int | None,
                      shuffle: bool, shuffle_buffer: int, seed: int | None, repeat: bool,
                      deterministic: bool | None, cache: bool | str,
                      options: InputOptions | None, pad_remainder: bool) -> None:
        """Checks (naming the builder) and stores the shared constructor arguments."""
        owner = type(self).__name__
        self.label_key = label_key
        self.global_batch_size = check_int(owner, "global_batch_size", global_batch_size, 1,
                                           allow_none=True)
        self.shuffle = check_bool(owner, "shuffle", shuffle)
        self.shuffle_buffer = check_int(owner, "shuffle_buffer", shuffle_buffer, 1)
        self.seed = check_int(owner, "seed", seed, 0, allow_none=True)
        self.repeat = check_bool(owner, "repeat", repeat)
        self.deterministic = check_bool(owner, "deterministic", deterministic, allow_none=True)
        self.pad_remainder = check_bool(owner, "pad_remainder", pad_remainder)
        check_pad_remainder(owner, pad_remainder, repeat, label_key)
        self.cache = check_cache(owner, cache)
        if options is not None and not isinstance(options, InputOptions):
            raise TypeError(f"{owner}: options must be an InputOptions, got {options!r}")
        self.options = options or InputOptions()

    def _per_replica_batch(self, context: InputContext) -> int:
        return resolve_per_replica_batch(type(self).__name__, self.global_batch_size, context)

    def _stream(self, examples: tf.data.Dataset | Callable[..., tf.data.Dataset],
                batch_size: int, context: InputContext) -> tf.data.Dataset:
        """cache -> shuffle -> repeat -> batch, for data not held in RAM as tensors.

        `drop_remainder` keeps the batch dimension static: TPUs compile one shape,
        and a partial batch would leave some replicas empty (NaN losses);
        pad_remainder keeps the last partial batch for `pad_to_batch` instead.
        """
        examples = self._shuffled(examples, context)
        return examples.batch(batch_size, drop_remainder=not self.pad_remainder)

    def _shuffled(self, examples: tf.data.Dataset | Callable[..., tf.data.Dataset],
                  context: InputContext) -> tf.data.Dataset:
        """cache -> shuffle -> repeat, as configured.

        `examples` may be a function of the epoch (an int64 tensor; None for no
        epoch) for input that orders its own files. Seeded, each epoch is then
        built from its index and shuffled with a seed of (seed, epoch) only
        (`tputrain.data.epochs`): no iterator made before changes the order.
        """
        if callable(examples):
            if self.shuffle and self.seed is not None:
                return self._by_epoch(examples, context)
            examples = examples(None)
        examples = self._cached(examples, context)
        if self.shuffle:
            examples = examples.shuffle(self.shuffle_buffer, seed=self.seed,
                                        reshuffle_each_iteration=True)
        if self.repeat:
            examples = examples.repeat()
        return examples

    def _by_epoch(self, make: Callable[..., tf.data.Dataset],
                  context: InputContext) -> tf.data.Dataset:
        """Epoch e: make(e) (a cache: epoch 0's, read again) through a buffer seeded
        with (seed, e)."""
        if self.cache:
            cached = self._cached(make(tf.constant(0, tf.int64)), context)
            make = lambda epoch: cached  # noqa: E731 (the cache holds epoch 0's order)
        seed, buffer = self.seed, self.shuffle_buffer
        return by_epoch(lambda epoch: shuffle_epoch(make(epoch), buffer, seed, epoch),
                        self.repeat)

    def _cached(self, examples: tf.data.Dataset, context: InputContext) -> tf.data.Dataset:
        """`examples` cached as configured (in RAM or in this pipeline's file)."""
        if self.cache == "memory":
            return examples.cache()
        if self.cache:  # one cache file per pipeline: tf.data allows one reader per file
            path = cache_file(type(self).__name__, self.cache, self._cache_identity(), context)
            return written_cache(examples.cache(path), path, type(self).__name__)
        return examples

    def _cache_identity(self) -> Any:
        """What a file cache holds (JSON-able): it names the cache file (`file_cache`),
        so changed data or another split gets its own."""
        raise NotImplementedError(f"{type(self).__name__} has no file cache: use "
                                  "cache=False or 'memory'")

    def _finish(self, dataset: tf.data.Dataset, context: InputContext) -> tf.data.Dataset:
        """InputOptions, determinism, no second sharding by tf.distribute (each pipeline
        shards itself), then the static-shape check."""
        dataset = self.options.apply(dataset)
        options = tf.data.Options()
        if self.deterministic is not None:
            options.deterministic = self.deterministic
        if context.num_input_pipelines > 1:
            options.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.OFF)
        dataset = dataset.with_options(options)
        check_static(type(self).__name__, dataset.element_spec, self.static_fix)
        if self.label_key is not None:
            _LABEL_KEYS[dataset] = self.label_key
        return dataset
