"""`TFRecordInput`: per-host, sharded, statically shaped batches from TFRecord files.

Called once per input pipeline (one per host), outside any replica context,
with the `InputContext` that says which pipeline this is; it returns that
pipeline's dataset of per-replica batches.

Pipeline: list files (sorted, each once) -> shard files across input pipelines ->
shuffle file order -> interleave reads -> [file cache] -> shuffle records ->
repeat (seeded: each epoch built from its index, `tputrain.data.epochs`) ->
batch -> parse -> [tf.data service] -> prefetch. Note the order
batch-then-parse: one vectorized `tf.io.parse_example` per batch (mapped
with `num_parallel_calls=AUTOTUNE`) pays the per-op cost once a batch
instead of once an example, which matters on a small host, where parsing is
the bottleneck (figures: docs/input_pipeline.md). With
`cache="memory"` the records are read and parsed once, when the dataset is
built, and batches are gathered from RAM (see `in_memory_batches`).

If there are fewer files than input pipelines, every pipeline reads all
files and keeps every n-th record instead (a warning is logged); that costs
n times the reading, so write at least as many shards as hosts.

Which files are read: every file the glob matches, except those
`write_tfrecords` makes besides the shards, skipped by name: its manifest
(`*.manifest.json`) and the temp files of a write in progress or
interrupted (hidden `.*.tmp-<hex>`, `.*.spool-<hex>`, `*.manifest.json.tmp`).
So `write_tfrecords(..., "DIR/train")` reads back with "DIR/train*" or
"DIR/*". While `<prefix>.commit-in-progress` is there (a write renaming its
shards, or killed while it did: the shards may mix two writes) the shards of
that prefix are refused, by the glob and by the manifest, until the write is
rerun. Any other matched file is read as TFRecords; one that is not (a
README, a CSV) stops the pipeline with a `CorruptRecordError` that names the
file and says why it is not a TFRecord: narrow the glob.

The records must hold what `features` asks for. When the shards have a
manifest (given, matched by the glob, or next to writer-named shards) the
spec is compared with it before anything is read; otherwise a mismatch
found by `tputrain.runtime.validate.probe_inputs` (the Trainer's pre-flight) names
the file, record and feature. Either way it is a `FeatureSpecError`.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.data.bad_records import explain_data_loss, read_skipping_corrupt, register_files
from tputrain.core import tracing
from tputrain.core.checks import check_bool, check_int
from tputrain.data.batching import BatchedInput, in_memory_batches, pad_to_batch, split_label
from tputrain.data.context import InputContext
from tputrain.data.empty_input import (NO_BATCH, EmptyInputError, check_not_all_empty, count,
                                      yields)
from tputrain.data.epochs import permuted
from tputrain.data.feature_check import (check_against_manifest, explain_parse_error,
                                         manifests_next_to, register_pipeline)
from tputrain.data.file_cache import files_identity
from tputrain.data.manifest import (COMPRESSION_TYPES, MANIFEST_SUFFIX, Manifest, check_shards_committed,
                                     is_var_len, read_manifest, var_len_feature, writer_side_file)
from tputrain.data.options import InputOptions
from tputrain.data.blocks import block_table
from tputrain.data.positional import PositionalRecords

# The only dtypes tf.io.parse_example can produce.
_PARSE_DTYPES = (tf.float32, tf.int64, tf.string)
# Files read in parallel when cycle_length is None. A fixed number, not AUTOTUNE
# (= the machine's core count), so the record order does not depend on the machine.
_DEFAULT_MAX_CYCLE_LENGTH = 16
_PARSE_CHUNK = 256  # records parsed at once before a to_static transform
_FIXED_LEN = ("use tf.io.FixedLenFeature with a fixed shape (pad in the writer), or read it "
              "as variable-length and make it static: TFRecordInput(to_static=...) with "
              "tputrain.data.PackSequences or PadSequences")
_ONE_DIM = ("a variable-length feature has one dimension per example: store the other "
            "dimensions as fixed-length features")


def _static_shape(name: str, shape: Any) -> list[int]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = [shape]
    try:
        dims = tf.TensorShape(shape).as_list()
    except (TypeError, ValueError) as e:
        raise ValueError(f"feature {name!r}: shape {shape!r} is not a shape ({e}); "
                         f"TPUs need static shapes: {_FIXED_LEN}") from None
    if any(d is None for d in dims):
        raise ValueError(f"feature {name!r} has shape {shape!r} with an unknown dimension: "
                         f"TPUs need static shapes: {_FIXED_LEN}")
    return dims


def _parse_dtype(name: str, dtype: Any) -> tf.DType:
    try:
        dtype = tf.as_dtype(dtype)
    except TypeError:
        raise TypeError(f"feature {name!r}: {dtype!r} is not a dtype: use 'float32', "
                        "'int64' or 'string'") from None
    if dtype not in _PARSE_DTYPES:
        raise ValueError(f"feature {name!r}: tf.io.parse_example cannot produce {dtype.name}: "
                         "use float32, int64 or string (cast after parsing)")
    return dtype


def _default_value(name: str, default: Any, shape: list[int]) -> Any:
    if default is None:
        return None
    value = np.asarray(default)
    size = math.prod(shape)
    if value.size == 1:
        return np.full(shape, value.reshape(()))  # A scalar default fills the shape.
    if value.size != size:
        raise ValueError(f"feature {name!r}: default of {value.size} values does not fit "
                         f"shape {shape}: give a scalar or {size} values")
    return value.reshape(shape)


def _var_len_spec(name: str, value: Any) -> tf.io.RaggedFeature | None:
    """A variable-length form (VarLenFeature, plain RaggedFeature, shape [None]) as
    one `RaggedFeature`; None for a fixed-length form. Other dynamic forms are refused."""
    if isinstance(value, (tf.io.VarLenFeature, tf.io.RaggedFeature)):
        if isinstance(value, tf.io.RaggedFeature) and (value.partitions or value.value_key
                                                      not in (None, name)):
            raise ValueError(f"feature {name!r}: a RaggedFeature with partitions or another "
                             f"value_key is not supported: {_ONE_DIM}")
        return var_len_feature(_parse_dtype(name, value.dtype))
    if isinstance(value, (tf.io.SparseFeature, tf.io.FixedLenSequenceFeature)):
        raise ValueError(f"feature {name!r} is a {type(value).__name__}: use ([None], dtype) "
                         f"or tf.io.VarLenFeature instead; {_ONE_DIM}")
    shape = (value.shape if isinstance(value, tf.io.FixedLenFeature)
             else value[0] if isinstance(value, (tuple, list)) and len(value) in (2, 3) else ())
    try:
        dims = tf.TensorShape(shape).as_list()
    except (TypeError, ValueError):
        return None
    if None not in dims:
        return None
    if dims != [None]:
        raise ValueError(f"feature {name!r} has shape {dims}: {_ONE_DIM}")
    return var_len_feature(_parse_dtype(name, value.dtype if isinstance(
        value, tf.io.FixedLenFeature) else value[1]))


def parse_feature_spec(features: Mapping[str, Any], *, var_len: bool = False
                       ) -> dict[str, tf.io.FixedLenFeature | tf.io.RaggedFeature]:
    """Returns a `{name: tf.io.FixedLenFeature}` spec from a full or short-form one.

    Each value is a `tf.io.FixedLenFeature` or a short form `(shape, dtype)` /
    `(shape, dtype, default)`, so a gin file can write
    `{'image': ([64], 'float32'), 'label': ([], 'int64')}`. A scalar default
    fills the whole shape. dtype must be float32, int64 or string (what
    `tf.io.parse_example` produces). Variable-length features (VarLenFeature,
    RaggedFeature, SparseFeature, FixedLenSequenceFeature, a None dimension)
    are refused: TPUs need static shapes. With `var_len=True`, rank-1
    variable-length forms (`tf.io.VarLenFeature`, a plain `tf.io.RaggedFeature`,
    shape `[None]`) are accepted and returned as one `RaggedFeature` each, for
    a reader that makes them static itself (packing, bucketing, padding).
    """
    if not isinstance(features, Mapping) or not features:
        raise ValueError(f"features must be a non-empty mapping of name -> FixedLenFeature "
                         f"or (shape, dtype[, default]), got {features!r}")
    spec = {}
    for name, value in features.items():
        if not isinstance(name, str):
            raise TypeError(f"feature names must be str, got {name!r}")
        if var_len and (ragged := _var_len_spec(name, value)) is not None:
            spec[name] = ragged
            continue
        # The tf.io feature types are namedtuples: test for them before plain tuples.
        if isinstance(value, (tf.io.VarLenFeature, tf.io.RaggedFeature, tf.io.SparseFeature,
                              tf.io.FixedLenSequenceFeature)):
            raise ValueError(f"feature {name!r} is a {type(value).__name__}: TPUs need static "
                             f"shapes: {_FIXED_LEN}")
        if isinstance(value, tf.io.FixedLenFeature):
            shape, dtype, default = value.shape, value.dtype, value.default_value
        elif isinstance(value, (tuple, list)) and len(value) in (2, 3):
            shape, dtype = value[0], value[1]
            default = value[2] if len(value) == 3 else None
        else:
            raise TypeError(f"feature {name!r}: expected a tf.io.FixedLenFeature or "
                            f"(shape, dtype[, default]), got {value!r}")
        shape = _static_shape(name, shape)
        spec[name] = tf.io.FixedLenFeature(
            shape, _parse_dtype(name, dtype), _default_value(name, default, shape))
    return spec


def _check_to_static(spec: Mapping[str, Any], to_static: Any, pad_remainder: bool,
                     where: str | None) -> Callable[[tf.data.Dataset], tf.data.Dataset] | None:
    """Variable-length features need a to_static; a to_static reads example by example."""
    if to_static is not None and not callable(to_static):
        raise TypeError(f"TFRecordInput: to_static must be callable (dataset -> dataset), e.g. "
                        f"PackSequences(length), got {to_static!r}")
    if to_static is not None and pad_remainder:
        raise ValueError("TFRecordInput: pad_remainder pads whole batches of fixed-length "
                         "examples; with to_static, pad in it (PadSequences) and set "
                         "pad_remainder=False")
    var_len = sorted(name for name, feature in spec.items() if is_var_len(feature))
    if var_len and to_static is None:
        source = f" in {where}" if where else ""
        raise ValueError(f"TFRecordInput: feature {var_len[0]!r} is variable-length ([None]"
                         f"{source}): TPUs need static shapes: pass to_static="
                         "tputrain.data.PackSequences(length) (or PadSequences(length))")
    return to_static


def _sources(file_pattern: str | Sequence[str] | None,
             manifest: str | None) -> tuple[Manifest | None, tuple[str, ...]]:
    """(the manifest read, the globs to read): `file_pattern`'s, or the manifest's
    shards (not both)."""
    if manifest is not None:
        if file_pattern is not None:
            raise ValueError("TFRecordInput: pass file_pattern or manifest, not both: the "
                             "manifest lists the shards")
        read = read_manifest(manifest)
        return read, tuple(read.files())
    if file_pattern is None:
        raise ValueError("TFRecordInput: pass file_pattern (a glob of TFRecord files) "
                         "or manifest (written by write_tfrecords)")
    patterns = (file_pattern,) if isinstance(file_pattern, str) else tuple(file_pattern)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError("TFRecordInput: file_pattern must be a non-empty glob or a "
                         f"non-empty sequence of them, got {file_pattern!r}")
    return None, patterns


def _is_folder(path: str, matched: int) -> bool:
    """Whether a glob match is a folder: a local stat, or one remote request when the
    pattern matched only this path (not one per shard of a large remote glob)."""
    if "://" not in path or matched == 1:
        return tf.io.gfile.isdir(path)
    return False


def _glob_shards(pattern: str) -> tuple[list[str], dict[str, str]]:
    """The files `pattern` matches that are read, and those skipped (-> why)."""
    try:
        matches = tf.io.gfile.glob(pattern)
    except tf.errors.NotFoundError:
        matches = []
    if not matches:
        raise FileNotFoundError(f"no file matches {pattern!r}: check the path, or write the "
                                "data first (tputrain.data.write_tfrecords)")
    folders = [path for path in matches if _is_folder(path, len(matches))]
    if folders and len(folders) == len(matches):
        raise IsADirectoryError(
            f"{pattern!r} matches only folders (e.g. {sorted(folders)[0]}), not TFRecord "
            f"files: glob the shards inside, e.g. '{sorted(folders)[0].rstrip('/')}/*.tfrecord'")
    matches = [path for path in matches if path not in folders]
    skipped = {path: why for path in matches if (why := writer_side_file(path))}
    kept = [path for path in matches if path not in skipped]
    if not kept:
        first = sorted(skipped)[0]
        raise FileNotFoundError(
            f"{pattern!r} matches only files write_tfrecords makes besides the shards "
            f"(e.g. {first}: {skipped[first]}): the shards are named "
            "'<output_prefix>-NNNNN-of-NNNNN.tfrecord'; glob those, or pass "
            "TFRecordInput(manifest=...)")
    if skipped:
        logging.info("TFRecordInput: %r: not reading %d non-shard file(s) of write_tfrecords "
                     "(manifest, temp files): %s", pattern, len(skipped), sorted(skipped))
    return kept, skipped


def _compression(compression_type: str | None) -> str | None:
    if compression_type not in COMPRESSION_TYPES:
        raise ValueError("TFRecordInput: compression_type must be None, 'ZLIB' or "
                         f"'GZIP', got {compression_type!r}")
    return compression_type or None


def _positional_options(positional: bool, window_blocks: int, cache: Any) -> tuple[bool, int]:
    """Checks `positional` and `window_blocks` (a file cache reads everything first)."""
    check_bool("TFRecordInput", "positional", positional)
    window_blocks = check_int("TFRecordInput", "window_blocks", window_blocks, 1)
    if positional and isinstance(cache, str):
        raise ValueError("TFRecordInput: positional=True reads blocks where they are on "
                         "disk; a file cache would read them all first: drop cache, or "
                         "set positional=False")
    return positional, window_blocks


def _file_cache_identity(inputs: "TFRecordInput") -> dict[str, Any]:
    """What a file cache of `inputs` holds: its files as they are now, and the read
    options that order or select their records (`tputrain.data.file_cache`)."""
    files = list_shards(inputs.file_patterns, inputs.manifest, inputs.features)
    return {"files": files_identity(files), "features": sorted(map(repr, inputs.features.items())),
            "options": [inputs.label_key, inputs.shuffle, inputs.seed, inputs.repeat,
                        inputs.pad_remainder, inputs.cycle_length, inputs.block_length,
                        inputs.compression_type, inputs.skip_corrupt]}


class TFRecordInput(BatchedInput):
    """Builds one host's dataset of per-replica batches from sharded TFRecord files.

    Call it with the `InputContext` (per host, outside replica context); it
    returns a `tf.data.Dataset` of per-replica batches: a dict of features, or
    `(features, label)` if `label_key` is set. Every shape is static, batch
    dimension included (`drop_remainder=True`), because TPUs compile for one
    shape and a ragged last batch would leave replicas empty.

    How it reads (pipeline order, which files, the manifest check): the module's
    docstring.

    Args:
        file_pattern: a glob (or several) of TFRecord files; any `tf.io.gfile`
            path (local, gs://, ram://). Leave None to read `manifest`'s shards.
        features: `{name: FixedLenFeature or (shape, dtype[, default])}`; see
            `parse_feature_spec`. None takes the manifest's spec; a given spec
            is checked against the manifest's.
        manifest: path of a `write_tfrecords` manifest (`{prefix}.manifest.json`):
            its shard list, feature spec and compression replace hand-written ones.
        label_key: if set, that feature is returned separately as the label.
        global_batch_size: examples per step over all replicas. None takes it
            from the `InputContext` (the Trainer sets it there), which is the
            usual way: configure it once, on the Trainer.
        shuffle: shuffle file order and records (training); False for a fixed order.
        shuffle_buffer: records in the shuffle buffer (not used with cache="memory",
            which shuffles each epoch fully).
        seed: shuffle seed; the same seed gives the same order, reshuffled each
            epoch. Each epoch's order depends on the seed and the epoch only, not
            on other iterators of the dataset (`tputrain.data.epochs`). None: random.
        repeat: repeat forever (training); False for one pass (evaluation).
        cycle_length: files read concurrently. None: min(files of this
            pipeline, 16), fixed so the order does not depend on the machine.
        block_length: consecutive records taken from a file before moving on.
        deterministic: whether parallel transformations keep their order
            (`tf.data.Options.deterministic`); False can be faster, True gives
            a reproducible order. None leaves tf.data's default.
        cache: False; True or "memory": this pipeline's examples are read and parsed once
            and kept in RAM (data that fits, e.g. evaluation sets); a path prefix: serialized
            records are cached in local files after the first pass (slow or remote sources;
            one iterator a file, a tf.data rule), named by the files' state and the options:
            changed data or another split gets its own (`tputrain.data.file_cache`).
        compression_type: None, "ZLIB" or "GZIP", as written.
        skip_corrupt: skip unreadable records (corrupt or truncated) instead of
            failing, and log how many were skipped; a file is abandoned at its
            first bad record. Without it the error names the file and record.
        read_parallelism: threads reading files at once (at most cycle_length).
            None: tf.data tunes it for remote paths (gs://, where reads wait on
            the network); for local files, the host's core count.
        options: `InputOptions` (threads, autotune, prefetch, tf.data service);
            None uses the defaults.
        pad_remainder: for evaluation (needs repeat=False and label_key): keep
            the last partial batch, padded with zero rows, and yield
            `(features, label, weights)` with weight 0 on the padding, so every
            example is evaluated once with static shapes (the Trainer's eval
            weights losses and metrics by it).
        positional: read blocks at byte offsets, window-shuffled (`tputrain.data.positional`):
            starts at `InputContext.examples_consumed` at once; no buffer in checkpoints.
        window_blocks: with `positional`, blocks (256 records each) permuted together.
        to_static: for variable-length features (shape `[None]` in the spec or
            the manifest): a function from the dataset of single parsed
            examples (after shuffle and repeat) to a dataset of statically
            shaped examples, batched after it: `PackSequences(length)` (several
            examples per row, the least padding), `PadSequences(length)`, or
            your own. Records are still parsed a chunk at a time (cache="memory"
            keeps the serialized records in RAM). Without variable-length
            features it may reshape fixed ones the same way.
    """

    static_fix = _FIXED_LEN
    _cache_identity = _file_cache_identity  # what names a file cache (tputrain.data.file_cache)

    def __init__(
        self,
        file_pattern: str | Sequence[str] | None = None,
        features: Mapping[str, Any] | None = None,
        *,
        manifest: str | None = None,
        label_key: str | None = None,
        global_batch_size: int | None = None,
        shuffle: bool = True,
        shuffle_buffer: int = 10_000,
        seed: int | None = 0,
        repeat: bool = True,
        cycle_length: int | None = None,
        block_length: int = 1,
        deterministic: bool | None = True,
        cache: bool | str = False,
        compression_type: str | None = None,
        skip_corrupt: bool = False,
        read_parallelism: int | None = None,
        options: InputOptions | None = None,
        pad_remainder: bool = False,
        to_static: Callable[[tf.data.Dataset], tf.data.Dataset] | None = None,
        positional: bool = False, window_blocks: int = 40,
    ):
        self.manifest, patterns = _sources(file_pattern, manifest)
        if self.manifest is not None:
            features = self.manifest.features if features is None else features
            if compression_type is None:
                compression_type = self.manifest.compression_type
        elif features is None:
            raise ValueError("TFRecordInput: features is not set: give the feature spec, or "
                             "read a manifest (TFRecordInput(manifest=...)) that has it")
        spec = parse_feature_spec(features, var_len=True)
        if self.manifest is not None:
            check_against_manifest(spec, self.manifest)
        self.to_static = _check_to_static(spec, to_static, pad_remainder,
                                          self.manifest.location if self.manifest else None)
        if label_key is not None:
            if label_key not in spec:
                raise ValueError(f"TFRecordInput: label_key {label_key!r} is not a feature: "
                                 f"use one of {sorted(spec)}")
            if len(spec) == 1:
                raise ValueError(f"TFRecordInput: label_key {label_key!r} is the only "
                                 "feature, which would leave no inputs: add the input "
                                 "features or set label_key=None")
        self._set_batching(label_key=label_key, global_batch_size=global_batch_size,
                           shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed,
                           repeat=repeat, deterministic=deterministic, cache=cache,
                           options=options, pad_remainder=pad_remainder)
        self.cycle_length = check_int("TFRecordInput", "cycle_length", cycle_length, 1,
                                      allow_none=True)
        self.block_length = check_int("TFRecordInput", "block_length", block_length, 1)
        self.skip_corrupt = check_bool("TFRecordInput", "skip_corrupt", skip_corrupt)
        self.read_parallelism = check_int("TFRecordInput", "read_parallelism",
                                          read_parallelism, 1, allow_none=True)
        self.file_patterns, self.features = patterns, spec
        self.compression_type = _compression(compression_type)
        self.positional, self.window_blocks = _positional_options(positional, window_blocks,
                                                                  self.cache)

    def _read_parallelism(self, files: list[str], cycle_length: int) -> int:
        """Files read by parallel threads: remote reads wait on the network, so let
        tf.data tune up to cycle_length; local reads are CPU work, and more threads
        than cores only add hand-offs between them."""
        if self.read_parallelism is not None:
            return min(self.read_parallelism, cycle_length)
        if any("://" in path for path in files):
            return tf.data.AUTOTUNE
        return max(1, min(cycle_length, os.cpu_count() or 1))

    def _parse(self, serialized: tf.Tensor):
        """Parses a whole batch of serialized examples at once (vectorized)."""
        return split_label(tf.io.parse_example(serialized, self.features), self.label_key)

    def _file_reader(self) -> Callable[..., tf.data.Dataset]:
        compression = self.compression_type or ""
        if not self.skip_corrupt:
            return tracing.graph_helper(
                lambda path: tf.data.TFRecordDataset(path, compression_type=compression))
        return tracing.graph_helper(lambda path, size, expected: read_skipping_corrupt(
            path, size, expected, self.compression_type))

    def _records(self, file_list: list[str], context: InputContext, in_memory: bool,
                 epoch: tf.Tensor | None = None) -> tf.data.Dataset:
        """This pipeline's serialized records: its share of the files (or, with fewer
        files than pipelines, of every file's records), read interleaved. Given
        the `epoch` (and a seed), the file order is that epoch's (`tputrain.data.epochs`)."""
        num_files = len(file_list)
        num_pipelines, pipeline_id = context.num_input_pipelines, context.input_pipeline_id
        shard_files = num_files >= num_pipelines
        shard_records = not shard_files

        # What tf.data.Dataset.list_files(shuffle=False) then shard() give.
        local = file_list[pipeline_id::num_pipelines] if shard_files else file_list
        local_files = len(local)
        tensors = _file_tensors(local, self.manifest if self.skip_corrupt else None,
                                self.skip_corrupt)
        files = tf.data.Dataset.from_tensor_slices(tensors if len(tensors) > 1 else tensors[0])
        if not shard_files:
            logging.warning(
                "TFRecordInput: %d file(s) match %s but there are %d input pipelines: every "
                "pipeline reads all files and keeps every %d-th record. Write at least %d "
                "shards to avoid reading everything on every host.",
                num_files, list(self.file_patterns), num_pipelines, num_pipelines,
                num_pipelines)
        # With record sharding every pipeline must see the records in the same
        # order, or the shards overlap: an unseeded file shuffle would break that.
        # In memory, the full per-epoch permutation makes a file shuffle pointless.
        if (self.shuffle and not in_memory and local_files > 1
                and (shard_files or self.seed is not None)):
            files = (permuted(tensors, self.seed, epoch) if epoch is not None else
                     files.shuffle(local_files, seed=self.seed, reshuffle_each_iteration=True))

        reader = self._file_reader()
        cycle_length = self.cycle_length or min(local_files, _DEFAULT_MAX_CYCLE_LENGTH)
        records = files.interleave(
            tracing.graph_helper(lambda *file: reader(*file)),
            cycle_length=cycle_length,
            block_length=self.block_length,
            num_parallel_calls=self._read_parallelism(file_list, cycle_length),
            # Same reason: record sharding needs the same order in every pipeline.
            deterministic=True if (shard_records or in_memory) else self.deterministic)
        if shard_records:
            records = records.shard(num_pipelines, pipeline_id)
        return records

    def __call__(self, input_context: tf.distribute.InputContext | None = None
                 ) -> tf.data.Dataset:
        """Returns this pipeline's dataset of per-replica batches (per host).

        `input_context` is a tputrain or TF `InputContext`; None means one
        pipeline feeding one replica.
        """
        context = InputContext.from_tf(input_context)
        per_replica_batch = self._per_replica_batch(context)
        file_list = list_shards(self.file_patterns, self.manifest, self.features)
        check_yields(self, file_list, context, with_static=True)
        # A padded split takes any batch; to_static makes rows, not examples (packing more).
        if not self.pad_remainder and self.to_static is None:
            check_batch_fits(file_list, self.manifest,
                             per_replica_batch * context.num_replicas_in_sync)
        register_files(file_list, self.compression_type)
        register_pipeline(file_list, self.features, self.compression_type)
        in_memory = self.cache == "memory" and self.to_static is None
        epochs = (_positional(self, file_list, context) if self.positional and not in_memory
                  else functools.partial(self._records, file_list, context, in_memory))
        if self.to_static is not None:
            dataset = _static_rows(self, epochs, per_replica_batch, context)
        elif in_memory and self.pad_remainder:  # a finite (eval) split, its last batch padded
            dataset = self._padded_batches(
                read_all(epochs(), self.features, context, self.file_patterns), per_replica_batch)
        elif in_memory:
            dataset = in_memory_batches(
                read_all(epochs(), self.features, context, self.file_patterns), per_replica_batch,
                shuffle=self.shuffle, seed=self.seed, repeat=self.repeat,
                finish=tracing.graph_helper(lambda batch: split_label(batch, self.label_key)))
        else:  # serialized records are cached (a file cache: on disk), parsed per batch
            dataset = self._stream(epochs, per_replica_batch, context)
            dataset = dataset.map(self._parse, num_parallel_calls=tf.data.AUTOTUNE,
                                  deterministic=self.deterministic)
            if self.pad_remainder:
                dataset = dataset.map(tracing.graph_helper(
                    lambda *batch: pad_to_batch(batch, per_replica_batch)))
        if isinstance(epochs, PositionalRecords):  # records at examples_consumed, rows at places
            _mark_positional(context, rows=self.to_static is not None)
        return self._finish(dataset, context)

    def _shuffled(self, examples: Any, context: InputContext) -> tf.data.Dataset:
        """Positional records start at the context's position, shuffled by window."""
        if isinstance(examples, PositionalRecords):
            return _positioned(self, examples, context)
        return super()._shuffled(examples, context)

    def _static_examples(self, records: Callable[..., tf.data.Dataset], batch_size: int,
                         context: InputContext) -> tf.data.Dataset:
        """Single parsed examples -> to_static -> batch -> split the label."""
        examples = self._parsed_examples(records, context)
        batches = self.to_static(examples).batch(batch_size, drop_remainder=True)
        return batches.map(tracing.graph_helper(lambda batch: split_label(batch, self.label_key)))

    def _parsed_examples(self, records: Callable[..., tf.data.Dataset],
                         context: InputContext) -> tf.data.Dataset:
        """cache -> shuffle -> repeat -> parse a chunk at a time -> single examples.
        Ragged chunks unbatch to rank-1 tensors of any length."""
        examples = self._shuffled(records, context).batch(_PARSE_CHUNK)
        return examples.map(tracing.graph_helper(
                                lambda chunk: tf.io.parse_example(chunk, self.features)),
                            num_parallel_calls=tf.data.AUTOTUNE,
                            deterministic=self.deterministic).unbatch()

    def examples(self, input_context: tf.distribute.InputContext | None = None,
                 at_position: bool = False) -> tf.data.Dataset:
        """This pipeline's single parsed examples, unbatched: its share of the files,
        shuffled and repeated as configured, before `to_static` and batching (what
        `MixtureInput` draws from). Variable-length features are rank-1 tensors. From
        the start, or (`at_position`, positional) at the context's position."""
        context = InputContext.from_tf(input_context, **({} if at_position else dict(
            examples_consumed=0, layout_history=())))
        file_list = list_shards(self.file_patterns, self.manifest, self.features)
        check_yields(self, file_list, context, with_static=False)
        register_files(file_list, self.compression_type)
        register_pipeline(file_list, self.features, self.compression_type)
        return self._parsed_examples(
            _positional(self, file_list, context) if self.positional else
            functools.partial(self._records, file_list, context, False), context)

    def one_pass(self, input_context: tf.distribute.InputContext | None = None
                 ) -> tf.data.Dataset:
        """This pipeline's parsed examples, one pass in file order (emptiness checks)."""
        files = list_shards(self.file_patterns, self.manifest, self.features)
        return parsed_examples(self._records(files, InputContext.from_tf(input_context), True),
                               self.features)

    def _padded_batches(self, examples: dict[str, tf.Tensor], batch_size: int) -> tf.data.Dataset:
        """One pass over parsed examples held in RAM, the last batch padded. Not a
        tf.data `cache()`: an iterator that stops early (the Trainer's one-batch probe,
        `eval_steps`) would make TensorFlow discard it, with a warning each time."""
        dataset = tf.data.Dataset.from_tensor_slices(examples)
        if self.shuffle:
            dataset = dataset.shuffle(int(tf.shape(next(iter(examples.values())))[0]),
                                      seed=self.seed, reshuffle_each_iteration=True)
        dataset = dataset.batch(batch_size).map(
            tracing.graph_helper(lambda batch: split_label(batch, self.label_key)))
        return dataset.map(tracing.graph_helper(lambda *batch: pad_to_batch(batch, batch_size)))

    def __repr__(self) -> str:
        return (f"TFRecordInput({list(self.file_patterns)!r}, features={sorted(self.features)}, "
                f"label_key={self.label_key!r}, global_batch_size={self.global_batch_size})")


def _file_tensors(file_list: list[str], manifest: Manifest | None,
                  skip_corrupt: bool) -> tuple[tf.Tensor, ...]:
    """Paths (plus size and expected records, to check files when skipping)."""
    if not skip_corrupt:
        return (tf.constant(file_list, tf.string),)
    counts = manifest.examples_per_file() if manifest else {}
    sizes = []
    for path in file_list:
        try:
            sizes.append(tf.io.gfile.stat(path).length)
        except tf.errors.OpError:
            sizes.append(-1)
    expected = [counts.get(path, -1) for path in file_list]
    return (tf.constant(file_list, tf.string), tf.constant(sizes, tf.int64),
            tf.constant(expected, tf.int64))


def _positional(inputs: TFRecordInput, file_list: list[str],
                context: InputContext) -> PositionalRecords:
    """A pipeline's positional records (`tputrain.data.positional`)."""
    manifests = [inputs.manifest] if inputs.manifest else manifests_next_to(file_list)
    blocks = block_table(file_list, manifests, compression=inputs.compression_type,
                         cache_dir=context.cache_dir)
    seed = inputs.seed if inputs.seed is not None else int(np.random.randint(2**31))
    return PositionalRecords(
        blocks, num_hosts=context.num_input_pipelines, host=context.input_pipeline_id,
        seed=seed, window_blocks=inputs.window_blocks, shuffle=inputs.shuffle,
        compression=inputs.compression_type,
        read_parallelism=inputs._read_parallelism(file_list, inputs.window_blocks))


def _static_rows(inputs: TFRecordInput, epochs: Any, batch_size: int,
                 context: InputContext) -> tf.data.Dataset:
    """Batches of `to_static` rows: positional ones each window on its own, from the
    pipeline's place in the context (`tputrain.data.packed_rows`)."""
    if not isinstance(epochs, PositionalRecords):
        return inputs._static_examples(epochs, batch_size, context)
    records = epochs

    def to_rows(window: tf.data.Dataset) -> tf.data.Dataset:
        return inputs.to_static(window.batch(_PARSE_CHUNK).map(
            lambda chunk: tf.io.parse_example(chunk, inputs.features)).unbatch())
    rows = records.rows(to_rows, _row_place(context), inputs.repeat,
                        records.ledger(context.layout_history))
    return rows.batch(batch_size, drop_remainder=True).map(
        tracing.graph_helper(lambda batch: split_label(batch, inputs.label_key)))


def _mark_positional(context: InputContext, rows: bool) -> None:
    """The builder's stream is a function of its position, honoured if not the start:
    the examples consumed (records) or the pipeline's row place (`to_static` rows)."""
    context.positional, context.position_honoured = True, (
        _row_place(context) != (0, 0) if rows else context.examples_consumed > 0)


def _row_place(context: InputContext) -> tuple[int, int]:
    """The pipeline's place in its rows (`InputContext.row_places`; none: the start)."""
    places = context.row_places
    return places[context.input_pipeline_id] if places else (0, 0)


def _positioned(inputs: TFRecordInput, records: PositionalRecords,
                context: InputContext) -> tf.data.Dataset:
    """The pipeline's records from its place: the ledger of the context's layout
    history, and its share of the examples consumed since its layout took over.
    (Rows of a `to_static` are not records: they start at their own place,
    `_static_rows`.)"""
    ledger = records.ledger(context.layout_history)
    position = ledger.host_records(max(context.examples_consumed, ledger.start))
    return records.dataset(position, repeat=inputs.repeat, ledger=ledger)


def parsed_examples(records: tf.data.Dataset, features: Mapping[str, Any]) -> tf.data.Dataset:
    """Serialized records -> single parsed examples (parsed a chunk at a time)."""
    return records.batch(_PARSE_CHUNK).map(tracing.graph_helper(
        lambda chunk: tf.io.parse_example(chunk, features))).unbatch()


def check_yields(inputs: TFRecordInput, file_list: list[str], context: InputContext,
                 with_static: bool) -> None:
    """Refuses a pipeline with no record, or (`with_static`) whose records give no
    row through `to_static`: read for ever, it would never yield a batch."""
    records = inputs._records(file_list, context, True)  # one pass, files in order
    patterns = list(inputs.file_patterns) if inputs.manifest is None else inputs.manifest.location
    if not yields(records):
        pipelines = context.num_input_pipelines
        which = (f"input pipeline {context.input_pipeline_id} of {pipelines} reads no "
                 f"record of {patterns}" if pipelines > 1 else
                 f"the {len(file_list)} file(s) of {patterns} hold no records")
        raise EmptyInputError(f"TFRecordInput: {which}, so it {NO_BATCH}: write the data "
                              "again (tputrain.data.write_tfrecords) or fix the pattern"
                              + (f"; write at least {pipelines} non-empty shards"
                                 if pipelines > 1 else ""))
    if with_static and inputs.to_static is not None:
        examples = parsed_examples(records, inputs.features)
        if not yields(inputs.to_static(examples)):
            total = count(examples)
            raise EmptyInputError(
                f"TFRecordInput: to_static {inputs.to_static!r} keeps none of the {total} "
                f"examples of {patterns} (a filter that drops everything?), so the "
                f"input {NO_BATCH}: check what it keeps")


def list_shards(file_patterns: Sequence[str], manifest: Manifest | None,
                features: Mapping[str, Any]) -> list[str]:
    """Globs now, so a typo fails here and not deep inside tf.data.

    Sorted (deterministic, the same on every host) and without duplicates
    (overlapping patterns would otherwise read a file twice). The same list
    feeds the dataset, so the shard decision matches what is read. Checks
    the feature spec against the shards' manifest, if there is one.
    """
    if manifest is not None:
        check_shards_committed(file_patterns)  # a kill mid-rename since it was read?
        missing = [path for path in file_patterns if not tf.io.gfile.exists(path)]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} shard(s) listed in {manifest.location} are missing, "
                f"e.g. {missing[0]!r}: copy the whole directory or rewrite the data")
        return sorted(set(file_patterns))
    files: set[str] = set()
    manifests: set[str] = set()
    for pattern in file_patterns:
        matches, skipped = _glob_shards(pattern)
        check_not_all_empty(pattern, matches)
        files.update(matches)
        manifests.update(path for path in skipped if path.endswith(MANIFEST_SUFFIX))
    files_list = sorted(files)
    check_shards_committed(files_list)  # not a write stopped half-way through its renames
    for found in manifests_next_to(files_list, sorted(manifests)):
        check_against_manifest(features, found)
    return files_list


def check_batch_fits(files: list[str], manifest: Manifest | None, global_batch: int) -> None:
    """A batch larger than the whole data set, when a manifest gives its size:
    batching a repeated data set would read it over and over into one batch
    (gigabytes, and the first read never returns), without repeat no batch at all."""
    manifests = [manifest] if manifest is not None else manifests_next_to(files)
    counts: dict[str, int] = {}
    for found in manifests:
        counts.update(found.examples_per_file())
    if not files or not set(files) <= set(counts):
        return  # some file's count is unknown
    examples = sum(counts[path] for path in files)
    if global_batch > examples:
        where = manifests[0].location or "its manifest"
        raise ValueError(
            f"the global batch of {global_batch} is larger than the {examples} examples "
            f"the data holds ({where} counts them): lower Trainer.global_batch_size to "
            f"at most {examples}")


def read_all(records: tf.data.Dataset, features: Mapping[str, Any], context: InputContext,
             file_patterns: Sequence[str]) -> dict[str, tf.Tensor]:
    """Reads and parses all of this pipeline's records now (cache="memory")."""
    try:
        serialized = records.batch(2**31 - 1).get_single_element()
    except tf.errors.InvalidArgumentError:  # "Dataset was empty"
        raise EmptyInputError(f"TFRecordInput: pipeline {context.input_pipeline_id} of "
                              f"{context.num_input_pipelines} has no records in "
                              f"{list(file_patterns)}: it {NO_BATCH}") from None
    except tf.errors.DataLossError as error:
        raise explain_data_loss(error) from None
    try:
        examples = tf.io.parse_example(serialized, features)
    except tf.errors.InvalidArgumentError as error:
        raise explain_parse_error(error) from None
    count = int(tf.shape(serialized)[0])
    logging.info("TFRecordInput: cached %d parsed examples (%.1f MB) in memory", count,
                 sum(t.numpy().nbytes for t in examples.values()) / 1e6)
    return examples
