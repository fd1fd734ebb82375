"""Weighted mixtures of several sources, drawn example by example before packing.

Training on several corpora at once (code and prose, languages, tasks) means
drawing each next example from one source at random with fixed weights.
`mix_datasets` does it with tf.data's own `sample_from_datasets` and a seed,
so the order is deterministic and the iterator's checkpoint (which holds the
sampler's random state and every source's position) resumes it bitwise. Each
example gets a `source_id` feature (the source's index), which packing
carries per token, so a batch says how many examples and real tokens each
source gave (`source_counts`). `MixtureInput` is the input builder: every
source is read per host like `TFRecordInput` (its share of the files), mixed,
made static (`to_static`, e.g. `PackSequences`) and batched; its dataset
names its sources (`mixture_sources`), so the Trainer counts the examples of
each (`tputrain.loop.source_counts`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tputrain.data.batching import BatchedInput, split_label
from tputrain.data.context import InputContext
from tputrain.data.empty_input import NO_BATCH, EmptyInputError, count, yields
from tputrain.data.manifest import MANIFEST_SUFFIX
from tputrain.data.mixture_positions import choices, counts_at, quotas, source_positions
from tputrain.data.packed_rows import tagged
from tputrain.data.options import InputOptions
from tputrain.data.packing import LOSS_WEIGHTS, POSITIONS, SEGMENT_IDS
from tputrain.data.tfrecord import TFRecordInput

SOURCE_ID = "source_id"
_SOURCES_ATTRIBUTE = "_tputrain_mixture_sources"


@dataclasses.dataclass(frozen=True)
class MixtureSources:
    """What a mixture's batches say of their sources: each one's name, in index
    order, and the feature that holds the index."""

    names: tuple[str, ...]
    key: str = SOURCE_ID


def mixture_sources(dataset: tf.data.Dataset) -> MixtureSources | None:
    """The sources of a `MixtureInput` dataset, None for any other dataset (or one
    transformed after `MixtureInput` returned it: tf.data makes a new dataset)."""
    return getattr(dataset, _SOURCES_ATTRIBUTE, None)


def without_source_ids(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """A `MixtureInput` dataset with the source id left out of its features: what eval
    and predict feed the model, which never gets the id (only the train step counts
    it); any other dataset unchanged."""
    sources = mixture_sources(dataset)
    if sources is None:
        return dataset
    key = sources.key
    return dataset.map(lambda *batch: without_source(batch if len(batch) > 1 else batch[0],
                                                     key))


def without_source(batch: Any, key: str | tuple[str, ...]) -> Any:
    """`(features, labels, ...)` or features alone (tensors or specs) with `features[key]`
    (each of a tuple of keys) left out."""
    keys = (key,) if isinstance(key, str) else tuple(key)
    if isinstance(batch, Mapping):
        return {name: value for name, value in batch.items() if name not in keys}
    if not (isinstance(batch, tuple) and batch and isinstance(batch[0], Mapping)
            and any(k in batch[0] for k in keys)):
        return batch
    return ({name: value for name, value in batch[0].items() if name not in keys},
            *batch[1:])


def source_name(source: Any, index: int) -> str:
    """A readable default name: the manifest's or the file pattern's stem."""
    path = source if isinstance(source, str) else (
        getattr(getattr(source, "manifest", None), "location", None)
        or next(iter(getattr(source, "file_patterns", ())), None))
    if not isinstance(path, str):
        return f"source{index}"
    stem = re.split(r"[*?\[.]", os.path.basename(path))[0].rstrip("-_")
    return stem or f"source{index}"


def check_names(where: str, sources: Sequence[Any],
                names: Sequence[str] | None) -> tuple[str, ...]:
    """The sources' names (given, or `source_name`s made unique by their index)."""
    if names is None:
        names = [source_name(source, i) for i, source in enumerate(sources)]
        if len(set(names)) < len(names):
            names = [f"{name}{i}" for i, name in enumerate(names)]
    names = tuple(str(name) for name in names)
    if len(names) != len(sources):
        raise ValueError(f"{where}: {len(sources)} sources but {len(names)} names: give "
                         "one name a source")
    if len(set(names)) < len(names) or not all(names):
        raise ValueError(f"{where}: source names must be unique and non-empty, got {names}")
    return names


def check_weights(where: str, num_sources: int, weights: Sequence[float]) -> list[float]:
    """The weights normalised to sum to 1; fails naming the problem, quoting the
    weights as given (not normalised: `[inf, 1]` would read `[nan, 0.0]`)."""
    given = list(weights)
    if num_sources < 1:
        raise ValueError(f"{where}: give at least one source")
    if len(given) != num_sources:
        raise ValueError(f"{where}: {num_sources} sources but {len(given)} weights: give "
                         "one weight a source")
    try:
        values = [float(w) for w in given]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: weights must be numbers, got {given}") from None
    if not all(math.isfinite(w) for w in values) or not math.isfinite(sum(values)):
        raise ValueError(f"{where}: weights must be finite numbers with a finite sum "
                         f"(relative shares, e.g. [0.7, 0.3]), got {given}")
    if any(w < 0 for w in values) or sum(values) <= 0:
        raise ValueError(f"{where}: weights must be >= 0 with a positive sum, got {given}")
    return [w / sum(values) for w in values]


def _features(spec: Any) -> dict[str, tf.DType]:
    return {name: s.dtype for name, s in spec.items()} if isinstance(spec, Mapping) else {}


def _tagged(datasets: Sequence[tf.data.Dataset], source_key: str) -> list[tf.data.Dataset]:
    """Each source with its index as `source_key`, after checking they hold the same features."""
    first = _features(datasets[0].element_spec)
    for index, dataset in enumerate(datasets):
        features = _features(dataset.element_spec)
        if not features:
            raise TypeError(f"mix_datasets: source {index} yields {dataset.element_spec}, not "
                            "a dict of features: map it to one dict first")
        if source_key in features:
            raise ValueError(f"mix_datasets: source {index} already has a {source_key!r} "
                             "feature: rename it or pass another source_key")
        if features != first:
            raise ValueError(
                f"mix_datasets: source {index} has features "
                f"{ {k: v.name for k, v in features.items()} } but source 0 has "
                f"{ {k: v.name for k, v in first.items()} }: every source needs the same "
                "features (names and dtypes)")
    return [dataset.map(_with_source(source_key, index)) for index, dataset in enumerate(datasets)]


def _with_source(source_key: str, index: int) -> Callable[[dict], dict]:
    def tag(example: dict) -> dict:
        return {**example, source_key: tf.constant(index, tf.int64)}
    return tag


def mix_datasets(datasets: Sequence[tf.data.Dataset], weights: Sequence[float],
                 seed: int | None = 0, source_key: str = SOURCE_ID) -> tf.data.Dataset:
    """Draws each next example from source i with probability weights[i] / sum(weights).

    Args:
        datasets: unbatched datasets of dicts with the same features (names,
            dtypes; shapes may differ where variable-length). Mix before
            packing, so a packed row holds examples of several sources.
        weights: one non-negative weight a source (normalised).
        seed: the sampler's seed: the same seed, the same order. None: random.
        source_key: the int64 feature that names each example's source index.

    When a finite source runs out the others go on (their share grows), so a
    finite mixture yields every example once; repeat the sources for training.
    """
    normalised = check_weights("mix_datasets", len(datasets), weights)
    return tf.data.Dataset.sample_from_datasets(
        _tagged(list(datasets), source_key), weights=normalised, seed=seed,
        stop_on_empty_dataset=False)


def source_counts(batch: Mapping[str, tf.Tensor], num_sources: int,
                  source_key: str = SOURCE_ID) -> dict[str, tf.Tensor]:
    """`{"examples": int64 [num_sources], "tokens": float32 [num_sources]}` of a batch.

    Packed rows (the source id per token) count segments and real tokens per
    source; a long example split over several rows counts once a piece.
    Unpacked examples (a scalar source id each) count once each, and their
    real tokens are the sum of their `loss_weights` (or 0 without them).
    """
    ids = tf.cast(batch[source_key], tf.int32)
    weights = batch.get(LOSS_WEIGHTS)
    if SEGMENT_IDS in batch and ids.shape.rank == batch[SEGMENT_IDS].shape.rank:
        starts = (batch[POSITIONS] == 0) & (batch[SEGMENT_IDS] > 0)
        examples = tf.math.bincount(tf.boolean_mask(ids, starts), minlength=num_sources,
                                    maxlength=num_sources, dtype=tf.int64)
        tokens = tf.math.unsorted_segment_sum(tf.reshape(weights, [-1]), tf.reshape(ids, [-1]),
                                              num_sources)
    else:
        examples = tf.math.bincount(ids, minlength=num_sources, maxlength=num_sources,
                                    dtype=tf.int64)
        per_example = (tf.zeros(tf.shape(ids), tf.float32) if weights is None else
                       tf.reduce_sum(tf.reshape(weights, [tf.shape(ids)[0], -1]), axis=1))
        tokens = tf.math.unsorted_segment_sum(per_example, ids, num_sources)
    return {"examples": examples, "tokens": tokens}


class MixtureInput(BatchedInput):
    """One host's batches from a weighted mixture of TFRecord sources.

    Every source is read as `TFRecordInput` reads (this host's share of its
    files, shuffled and repeated as set here), then the sources are mixed
    example by example (`mix_datasets`, seeded per host so hosts draw
    differently but reproducibly), made static by `to_static` (packing, say)
    and batched. Each example carries `source_id`, which the Trainer's step
    strips from the features and counts: each source's examples so far show in
    the progress line and TensorBoard (`examples/<name>`), checkpointed.

    Args:
        sources: manifests (`*.manifest.json`), globs of TFRecord files (then
            give `features`), or `TFRecordInput`s (their own file, shuffle and
            seed settings are used; their `to_static` and batch are not).
        weights: one non-negative weight a source.
        features: the feature spec for glob sources (see `parse_feature_spec`).
        to_static: applied after mixing, before batching: `PackSequences(length)`,
            `PadSequences(length)`, or None for fixed-length features.
        label_key, global_batch_size, shuffle, shuffle_buffer, repeat,
            deterministic, options: as for `TFRecordInput`.
        seed: shuffles source i with seed + i and mixes with seed + the host's
            input pipeline id.
        source_key: the name of the source-index feature.
        names: one name a source, for the progress line's and TensorBoard's
            per-source counts (`examples/<name>`); None: each manifest's or file
            pattern's stem (`wiki.manifest.json` -> `wiki`).
        positional, window_blocks: read every source as `TFRecordInput(positional=
            True)` and draw the sources in blocks of exact quotas, in a stateless
            order the same on every host (`tputrain.data.mixture_positions`): the
            mixture then starts at `InputContext.examples_consumed` across its
            `layout_history`, each source at its own position. With `to_static` each
            block is made static on its own and its rows start at the pipeline's
            `InputContext.row_places` (`tputrain.data.packed_rows`; one host count).
            TFRecordInput sources must be positional.
    """

    def __init__(self, sources: Sequence[str | TFRecordInput], weights: Sequence[float], *,
                 features: Mapping[str, Any] | None = None,
                 to_static: Callable[[tf.data.Dataset], tf.data.Dataset] | None = None,
                 label_key: str | None = None, global_batch_size: int | None = None,
                 shuffle: bool = True, shuffle_buffer: int = 10_000, seed: int | None = 0,
                 repeat: bool = True, deterministic: bool | None = True,
                 options: InputOptions | None = None, source_key: str = SOURCE_ID,
                 names: Sequence[str] | None = None, positional: bool = False,
                 window_blocks: int = 40):
        self.weights = check_weights("MixtureInput", len(sources), weights)
        self.names = check_names("MixtureInput", sources, names)
        self._set_batching(label_key=label_key, global_batch_size=global_batch_size,
                           shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed,
                           repeat=repeat, deterministic=deterministic, cache=False,
                           options=options, pad_remainder=False)
        if to_static is not None and not callable(to_static):
            raise TypeError(f"MixtureInput: to_static must be callable, got {to_static!r}")
        self.to_static = to_static
        self.source_key = source_key
        self.positional, self.window_blocks = positional, window_blocks
        self.sources = [self._source(index, source, features)
                        for index, source in enumerate(sources)]

    def _source(self, index: int, source: str | TFRecordInput,
                features: Mapping[str, Any] | None) -> TFRecordInput:
        if isinstance(source, TFRecordInput):
            if self.positional and not source.positional:
                raise ValueError(f"MixtureInput(positional=True): source {index} is a "
                                 "TFRecordInput with positional=False: build it with "
                                 "positional=True, or set positional=False here")
            return source
        if not isinstance(source, str) or not source:
            raise TypeError(f"MixtureInput: source {index} must be a manifest path, a glob or "
                            f"a TFRecordInput, got {source!r}")
        where = ({"manifest": source} if source.endswith(MANIFEST_SUFFIX)
                 else {"file_pattern": source, "features": features})
        return TFRecordInput(**where, shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer,
                             seed=None if self.seed is None else self.seed + index,
                             repeat=self.repeat, deterministic=self.deterministic,
                             to_static=self.to_static, positional=self.positional,
                             window_blocks=self.window_blocks)

    def __call__(self, input_context: tf.distribute.InputContext | None = None
                 ) -> tf.data.Dataset:
        """Returns this pipeline's dataset of per-replica batches (per host)."""
        context = InputContext.from_tf(input_context)
        batch_size = self._per_replica_batch(context)
        seed = None if self.seed is None else self.seed + context.input_pipeline_id
        mixed = self._positioned(context) if self.positional else mix_datasets(
            [self._examples(index, context) for index in range(len(self.sources))],
            self.weights, seed=seed, source_key=self.source_key)
        if self.to_static is not None:
            self._check_static(context, seed)
            mixed = mixed if self.positional else self.to_static(mixed)
        batches = mixed.batch(batch_size, drop_remainder=True)
        batches = batches.map(lambda batch: split_label(batch, self.label_key))
        finished = self._finish(batches, context)
        setattr(finished, _SOURCES_ATTRIBUTE, MixtureSources(self.names, self.source_key))
        return finished

    def _positioned(self, context: InputContext) -> tf.data.Dataset:
        """Positional: every source at its place and the quota choices at the mixture's
        (`tputrain.data.mixture_positions`); with `to_static`, rows (`_packed`)."""
        quota = quotas(self.weights)
        seed = self.seed if self.seed is not None else int(np.random.randint(2**31))
        if self.to_static is not None:
            return self._packed(context, seed, quota)
        consumed = context.examples_consumed
        history = context.layout_history or ((0, context.num_input_pipelines),)
        places, start = source_positions(seed, quota, history, max(consumed, history[-1][0]))
        streams = [self._examples(index, InputContext.from_tf(
            context, examples_consumed=examples, layout_history=layouts), at_position=True)
            for index, (examples, layouts) in enumerate(places)]
        if self.to_static is None:
            context.positional, context.position_honoured = True, consumed > 0
        return tf.data.Dataset.choose_from_datasets(
            _tagged(streams, self.source_key), choices(seed, quota, start),
            stop_on_empty_dataset=False)

    def _packed(self, context: InputContext, seed: int, quota: np.ndarray) -> tf.data.Dataset:
        """A positional mixture's rows: each block of quota choices made static on its
        own (`tputrain.data.packed_rows`). The pipeline's place (blocks ended, rows
        into the next) gives its choice index, so each source's records it read."""
        hosts, host = context.num_input_pipelines, context.input_pipeline_id
        if any(entry[1] != hosts for entry in context.layout_history):
            raise ValueError(
                "MixtureInput(positional=True) with to_static: the run's input was split "
                "over another host count before (rows are not examples: their places are "
                "not carried over to other hosts yet): resume on the host count it started "
                "with, or set positional=False")
        ended, rows = context.row_places[host] if context.row_places else (0, 0)
        block = int(quota.sum())
        start = ended * block
        streams = [self._examples(index, InputContext.from_tf(
            context, examples_consumed=int(records) * hosts, layout_history=()),
            at_position=True) for index, records in enumerate(counts_at(seed, quota, start))]
        mixed = tf.data.Dataset.choose_from_datasets(
            _tagged(streams, self.source_key), choices(seed, quota, start),
            stop_on_empty_dataset=False)
        context.positional, context.position_honoured = True, (ended, rows) != (0, 0)
        return mixed.window(block).flat_map(lambda window: tagged(
            self.to_static(tf.data.Dataset.zip(window)), host)).skip(rows)

    def _examples(self, index: int, context: InputContext,
                  at_position: bool = False) -> tf.data.Dataset:
        """Source `index`'s examples; one with none is an error that names it: the
        mixture would draw from it for ever, or silently drop it."""
        try:
            return self.sources[index].examples(context, at_position)
        except EmptyInputError as error:
            raise EmptyInputError(f"MixtureInput: source {index} ({self.names[index]!r}) has "
                                  f"no examples: {error}") from None

    def _check_static(self, context: InputContext, seed: int | None) -> None:
        """One pass of the sources, mixed, must give a row through `to_static` (a filter
        that drops everything would read the repeated mixture for ever)."""
        once = mix_datasets([source.one_pass(context) for source in self.sources],
                            self.weights, seed=seed, source_key=self.source_key)
        if not yields(self.to_static(once)):
            raise EmptyInputError(
                f"MixtureInput: to_static {self.to_static!r} keeps none of the {count(once)} "
                f"examples of its sources {list(self.names)} (a filter that drops "
                f"everything?), so the input {NO_BATCH}: check what it keeps")

    def __repr__(self) -> str:
        return (f"MixtureInput({len(self.sources)} sources {list(self.names)}, "
                f"weights={self.weights}, "
                f"to_static={self.to_static!r})")

