"""`TFDSInput`: per-host, statically shaped batches from a TensorFlow Datasets split.

The same contract as `TFRecordInput`: called once per input pipeline (one per
host), outside any replica context, with the `InputContext`; returns that
pipeline's dataset of per-replica batches with static shapes. Each pipeline
reads its own files (`tfds.ReadConfig(input_context=...)`), or, when the split
has fewer files than pipelines, its own even sub-split (`tfds.even_splits`).
`tensorflow_datasets` is imported on first use only: importing it takes seconds.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf
from absl import logging

from tputrain.core.checks import check_bool, check_int
from tputrain.data.batching import (BatchedInput, check_static, in_memory_batches, pad_to_batch,
                                    split_label)
from tputrain.data.context import InputContext
from tputrain.data.file_cache import callable_identity
from tputrain.data.options import InputOptions

_STATIC_FIX = ("resize or pad each example with TFDSInput.preprocess_example, or keep only "
               "fixed-shape features with TFDSInput.features")


class TFDSInput(BatchedInput):
    """Builds one host's dataset of per-replica batches from a TFDS split.

    Pipeline: tfds.load (this pipeline's files, shuffled file order, decoding)
    -> keep `features` -> preprocess_example -> [cache] -> shuffle -> repeat ->
    batch(drop_remainder) -> preprocess_batch -> [tf.data service] -> prefetch.

    Args:
        name: TFDS name, e.g. "mnist" or "mnist:3.*.*".
        split: TFDS split, e.g. "train", "test" or "train[:90%]".
        data_dir: where the prepared data lives (TFDS's default if None).
        download: prepare the data if it is missing; False fails instead, so a
            training job never downloads by surprise.
        features: feature names to keep (e.g. ("image", "label")); None keeps all.
        label_key: that feature is returned separately as the label; None
            returns the feature dict only.
        global_batch_size: examples per step over all replicas; None takes it
            from the `InputContext` (the Trainer sets it).
        shuffle: shuffle files and examples (training); False for a fixed order.
        shuffle_buffer: examples in the shuffle buffer.
        seed: shuffle seed; reshuffled each epoch. None: random.
        repeat: repeat forever (training); False for one pass (evaluation).
        cycle_length, block_length: files read concurrently and examples taken
            from each in turn (TFDS's interleave); None: TFDS's defaults.
        deterministic: keep the order of parallel work (`tf.data.Options`).
        cache: False; True or "memory": decoded examples of this pipeline are
            read once and kept in RAM (each epoch fully reshuffled); a path prefix:
            decoded examples are cached in local files after the first pass, named by
            the data set, split and options (`tputrain.data.file_cache`).
        preprocess_example: per-example function (dict -> dict) before batching,
            e.g. to resize images to one shape.
        preprocess_batch: per-batch function (dict -> dict) after batching,
            vectorized: prefer it for anything that can work on a whole batch.
        options: `InputOptions` (threads, autotune, prefetch, tf.data service).
        pad_remainder: for evaluation (needs repeat=False and label_key): keep
            the last partial batch, padded with zeros, as `(features, label,
            weights)` with weight 0 on the padding (`tputrain.data.pad_to_batch`).
    """

    static_fix = _STATIC_FIX

    def __init__(
        self,
        name: str,
        split: str,
        *,
        data_dir: str | None = None,
        download: bool = False,
        features: Sequence[str] | None = None,
        label_key: str | None = "label",
        global_batch_size: int | None = None,
        shuffle: bool = True,
        shuffle_buffer: int = 10_000,
        seed: int | None = 0,
        repeat: bool = True,
        cycle_length: int | None = None,
        block_length: int | None = None,
        deterministic: bool | None = True,
        cache: bool | str = False,
        preprocess_example: Callable[[dict], dict] | None = None,
        preprocess_batch: Callable[[dict], dict] | None = None,
        options: InputOptions | None = None,
        pad_remainder: bool = False,
    ):
        if not isinstance(name, str) or not name:
            raise ValueError(f"TFDSInput: name must be a TFDS name such as 'mnist', got {name!r}")
        if not isinstance(split, str) or not split:
            raise ValueError(f"TFDSInput: split must be a TFDS split such as 'train', got {split!r}")
        self._set_batching(label_key=label_key, global_batch_size=global_batch_size,
                           shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed,
                           repeat=repeat, deterministic=deterministic, cache=cache,
                           options=options, pad_remainder=pad_remainder)
        self.download = check_bool("TFDSInput", "download", download)
        self.cycle_length = check_int("TFDSInput", "cycle_length", cycle_length, 1,
                                      allow_none=True)
        self.block_length = check_int("TFDSInput", "block_length", block_length, 1,
                                      allow_none=True)
        if features is not None:
            features = tuple(features)
            if not features or not all(isinstance(f, str) for f in features):
                raise ValueError(f"TFDSInput: features must be feature names, got {features!r}")
            if label_key is not None and label_key not in features:
                raise ValueError(f"TFDSInput: label_key {label_key!r} is not in features "
                                 f"{features}: add it or set label_key=None")
        for hook_name, hook in (("preprocess_example", preprocess_example),
                                ("preprocess_batch", preprocess_batch)):
            if hook is not None and not callable(hook):
                raise TypeError(f"TFDSInput: {hook_name} must be callable, got {hook!r}")
        self.name = name
        self.split = split
        self.data_dir = data_dir
        self.features = features
        self.preprocess_example = preprocess_example
        self.preprocess_batch = preprocess_batch

    def _num_files(self, tfds) -> int | None:
        """Files behind this split, or None if TFDS does not know (e.g. mock data)."""
        try:
            builder = tfds.builder(self.name, data_dir=self.data_dir)
            return len(builder.info.splits[self.split].file_instructions)
        except Exception:  # Not prepared, mocked, or an unusual split: let tfds.load decide.
            return None

    def _load(self, context: InputContext) -> tf.data.Dataset:
        import tensorflow_datasets as tfds  # Slow to import: only when used.

        split = self.split
        read_kwargs: dict[str, Any] = {}
        num_pipelines = context.num_input_pipelines
        if num_pipelines > 1:
            num_files = self._num_files(tfds)
            if num_files is not None and num_files < num_pipelines:
                logging.warning(
                    "TFDSInput: %s[%s] has %d file(s) for %d input pipelines: each pipeline "
                    "reads an even sub-split instead", self.name, split, num_files, num_pipelines)
                split = tfds.even_splits(split, n=num_pipelines)[context.input_pipeline_id]
            else:
                read_kwargs["input_context"] = context
        if self.cycle_length is not None:
            read_kwargs["interleave_cycle_length"] = self.cycle_length
        if self.block_length is not None:
            read_kwargs["interleave_block_length"] = self.block_length
        read_config = tfds.ReadConfig(
            shuffle_seed=self.seed, shuffle_reshuffle_each_iteration=True,
            try_autocache=False, **read_kwargs)
        try:
            return tfds.load(self.name, split=split, data_dir=self.data_dir,
                             download=self.download, shuffle_files=self.shuffle,
                             read_config=read_config)
        except AssertionError as error:  # tfds's "Dataset ... not found" when not prepared
            raise FileNotFoundError(
                f"TFDSInput: {self.name}[{split}] is not prepared in "
                f"{self.data_dir or 'the TFDS data dir'} ({error}): run `tfds build "
                f"{self.name}` or set TFDSInput.download=True") from None

    def _select(self, example: dict) -> dict:
        if self.features is None:
            return example
        missing = [f for f in self.features if f not in example]
        if missing:
            raise ValueError(f"TFDSInput: {self.name} has no feature(s) {missing}: use some "
                             f"of {sorted(example)}")
        return {f: example[f] for f in self.features}

    def __call__(self, input_context: tf.distribute.InputContext | None = None
                 ) -> tf.data.Dataset:
        """Returns this pipeline's dataset of per-replica batches (per host)."""
        context = InputContext.from_tf(input_context)
        per_replica_batch = self._per_replica_batch(context)
        examples = self._load(context).map(self._select)
        if self.preprocess_example is not None:
            examples = examples.map(self.preprocess_example, num_parallel_calls=tf.data.AUTOTUNE,
                                    deterministic=self.deterministic)
        check_static("TFDSInput", examples.element_spec, _STATIC_FIX)
        if self.cache == "memory" and not self.pad_remainder:
            everything = examples.batch(2**31 - 1).get_single_element()
            dataset = in_memory_batches(everything, per_replica_batch, shuffle=self.shuffle,
                                        seed=self.seed, repeat=self.repeat)
        else:  # with pad_remainder, cache="memory" is tf.data's in-memory cache
            dataset = self._stream(examples, per_replica_batch, context)
        if self.preprocess_batch is not None:
            dataset = dataset.map(self.preprocess_batch, num_parallel_calls=tf.data.AUTOTUNE,
                                  deterministic=self.deterministic)
        dataset = dataset.map(lambda batch: split_label(batch, self.label_key))
        if self.pad_remainder:
            dataset = dataset.map(lambda *batch: pad_to_batch(batch, per_replica_batch))
        return self._finish(dataset, context)

    def _cache_identity(self) -> list[Any]:
        """What a file cache holds: the data set, its split and the options that select,
        order or change its examples (a preprocess function by its code and closed-over values)."""
        return [self.name, self.split, self.data_dir, self.features,
                callable_identity(self.preprocess_example), self.label_key, self.shuffle,
                self.seed, self.repeat, self.pad_remainder, self.cycle_length, self.block_length]

    def __repr__(self) -> str:
        return (f"TFDSInput({self.name!r}, {self.split!r}, label_key={self.label_key!r}, "
                f"global_batch_size={self.global_batch_size})")
