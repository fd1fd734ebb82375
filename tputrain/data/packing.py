"""Packing: several variable-length examples per fixed-length row, for TPUs' static shapes.

TPUs compile one shape, so variable-length sequences must become fixed-length
rows. Padding every example to the longest wastes the accelerator on padding
tokens; packing fills each row of `length` positions with several examples
one after another (next-fit: an example that does not fit the row's rest
starts a new row), so nearly every position is a real token. Each row carries:

* the packed features (every rank-1 feature of the example), 0 on padding;
* `segment_ids`: 1, 2, ... for the examples in the row, 0 on padding. A model
  must not attend across segments (attend where the ids are equal);
* `positions`: the position within the segment, restarting at 0;
* `loss_weights`: 1.0 on real tokens, 0.0 on padding (normalise a per-token
  loss by their sum, not by the row length);
* each scalar feature (e.g. a mixture's `source_id`), repeated on its
  segment's tokens, 0 on padding.

An example longer than `length` is split into pieces of `length` (the last
shorter), each its own segment, rather than dropped; empty examples have no
tokens and no segment. The order is kept, so the output is deterministic,
and it is a plain tf.data transformation (map, unbatch, scan, filter) applied
before batching: the input iterator's checkpoint holds the partly filled row,
so resuming from it continues bitwise.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import tensorflow as tf

SEGMENT_IDS = "segment_ids"
POSITIONS = "positions"
LOSS_WEIGHTS = "loss_weights"
WRITTEN = (SEGMENT_IDS, POSITIONS, LOSS_WEIGHTS)
# Limits checked at construction: a row of `length` positions (about 4 million) and
# `bins` rows open at once; beyond them a value is a typo (10**12), not a plan.
MAX_LENGTH = 2**22
MAX_BINS = 1024
_LENGTH = "_piece_length"  # internal: real tokens of a piece; length + 1 marks the end


def sequence_features(element_spec: Any, keys: Iterable[str] | None, where: str
                      ) -> tuple[list[str], list[str]]:
    """(the rank-1 features to pack, the scalar features to carry) of a dict dataset.

    Fails naming the feature for anything else: a name packing writes, a rank
    above 1, a string sequence, a `keys` entry that is not a rank-1 feature.
    """
    if not isinstance(element_spec, Mapping):
        raise TypeError(f"{where} needs a dataset of dicts of features, got elements "
                        f"{element_spec}: map them to a dict first")
    for name in WRITTEN:
        if name in element_spec:
            raise ValueError(f"{where}: {name!r} is a name packing writes: rename that feature")
    wanted = None if keys is None else list([keys] if isinstance(keys, str) else keys)
    for name in wanted or ():
        spec = element_spec.get(name)
        if spec is None or spec.shape.rank != 1:
            raise ValueError(f"{where}: keys names {name!r}, which is not a rank-1 feature: use "
                             f"some of {sorted(element_spec)}")
    sequences, scalars = [], []
    for name, spec in element_spec.items():
        rank = spec.shape.rank
        if rank == 0:
            scalars.append(name)
        elif rank == 1 and (wanted is None or name in wanted):
            if spec.dtype == tf.string:
                raise ValueError(f"{where}: feature {name!r} is a string sequence: tokenize it "
                                 "to integer ids first")
            sequences.append(name)
        else:
            raise ValueError(f"{where}: feature {name!r} has rank {rank} ({spec.shape}): "
                             "sequences are rank 1 (one value a token) and scalars are "
                             "carried; drop, flatten or list it in keys")
    if not sequences:
        raise ValueError(f"{where}: no rank-1 feature to pack in {sorted(element_spec)}")
    return sequences, scalars


def check_same_lengths(example: Mapping[str, tf.Tensor], sequences: Sequence[str],
                       where: str) -> tf.Tensor:
    """The example's sequence length, asserting every packed feature has it."""
    length = tf.size(example[sequences[0]])
    for name in sequences[1:]:
        tf.debugging.assert_equal(
            tf.size(example[name]), length,
            message=f"{where}: features {sequences[0]!r} and {name!r} need the same length "
                    "in every example")
    return length


def check_length(where: str, length: Any) -> int:
    """A row length of 1 to `MAX_LENGTH` positions: every row, packed or padded, holds
    `length` values a feature, so a larger one is a typo, not a row that would fit."""
    if (isinstance(length, bool) or not isinstance(length, int) or length < 1
            or length > MAX_LENGTH):
        raise ValueError(f"{where}: length must be a positive int of at most {MAX_LENGTH:,} "
                         f"(positions a row), got {length!r}")
    return length


def check_bins(where: str, bins: Any) -> int:
    """Rows open at once, 1 to `MAX_BINS`: each example is placed by a pass over every
    open row, so a larger number costs time for no fuller rows."""
    if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= MAX_BINS:
        raise ValueError(f"{where}: bins must be a positive int of at most {MAX_BINS:,} "
                         f"(rows open at once), got {bins!r}")
    return bins


def _pieces(dataset: tf.data.Dataset, length: int, sequences: list[str], scalars: list[str],
            where: str) -> tf.data.Dataset:
    """Each example as pieces of at most `length` tokens (padded to it), in order."""

    def split(example):
        n = check_same_lengths(example, sequences, where)
        count = (n + length - 1) // length
        pieces = {name: tf.reshape(tf.pad(example[name], [[0, count * length - n]]),
                                   [count, length]) for name in sequences}
        pieces[_LENGTH] = tf.minimum(length, n - tf.range(count) * length)
        for name in scalars:
            pieces[name] = tf.fill([count], example[name])
        return pieces

    return dataset.map(split).unbatch()


def _empty_row(spec: Mapping[str, tf.TensorSpec], length: int) -> dict[str, tf.Tensor]:
    row = {name: tf.zeros([length], s.dtype) for name, s in spec.items() if name != _LENGTH}
    row[SEGMENT_IDS] = tf.zeros([length], tf.int32)
    row[POSITIONS] = tf.zeros([length], tf.int32)
    return row


def _packer(spec: Mapping[str, tf.TensorSpec], length: int, sequences: list[str], bins: int):
    """The scan step over `bins` open rows: a piece goes to the first row it fits
    (first-fit); when it fits none, the fullest row is emitted and the piece starts
    it again. One row (`bins=1`) is next-fit: rows keep the examples' order."""
    index = tf.range(length, dtype=tf.int32)

    def step(state, piece):
        rows, fills, segments = state
        size = tf.cast(piece[_LENGTH], tf.int32)
        fits = fills + size <= length
        full = tf.logical_not(tf.reduce_any(fits))
        k = tf.where(full, tf.argmax(fills, output_type=tf.int32),
                     tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32))
        chosen = tf.equal(tf.range(bins), k)
        emitted = (full & (tf.gather(fills, k) > 0),
                   {name: tf.gather(value, k) for name, value in rows.items()})
        empty, reset = _empty_row(spec, length), chosen & full
        rows = {name: tf.where(reset[:, None], empty[name][None], value)
                for name, value in rows.items()}
        fills, segments = tf.where(reset, 0, fills), tf.where(reset, 0, segments)
        fill, segment = tf.gather(fills, k), tf.gather(segments, k)
        place = size <= length  # an end marker is never placed
        mine = chosen[:, None] & ((index >= fill) & (index < fill + size) & place)[None, :]
        for name in rows:
            if name in sequences:
                value = tf.roll(piece[name], shift=fill, axis=0)
            elif name == SEGMENT_IDS:
                value = tf.fill([length], segment + 1)
            elif name == POSITIONS:
                value = index - fill
            else:
                value = tf.fill([length], piece[name])
            rows[name] = tf.where(mine, value[None], rows[name])
        grown = tf.where(chosen & place, 1, 0)
        return (rows, fills + size * grown, segments + grown), emitted

    return step


def pack_sequences(dataset: tf.data.Dataset, length: int,
                   keys: Iterable[str] | None = None, bins: int = 1) -> tf.data.Dataset:
    """Packs a dataset of single examples into rows of `length` positions (see the module).

    Args:
        dataset: unbatched dicts: rank-1 features (packed; those in `keys` if
            given, all of the same length within an example) and scalars
            (carried per token). Apply it before `batch`.
        length: positions a row.
        keys: the features to pack; None packs every rank-1 feature.
        bins: rows kept open at once. 1 (next-fit) keeps the examples' order;
            more (first-fit over that many rows) fills rows fuller when
            examples are a sizeable share of a row, in a deterministic order.

    Returns rows of `{feature: [length], "segment_ids", "positions",
    "loss_weights": [length]}`, all statically shaped. A finite input ends with
    its last partly filled row.
    """
    where = "pack_sequences"
    length = check_length(where, length)
    sequences, scalars = sequence_features(dataset.element_spec, keys, where)
    pieces = _pieces(dataset, length, sequences, scalars, where)
    spec = pieces.element_spec
    bins = check_bins(where, bins)
    # End markers flush each row of a finite input (in a graph, e.g. a positional
    # input's window, the cardinality may be unknown: markers after an endless input
    # are never read).
    if tf.get_static_value(dataset.cardinality()) != tf.data.INFINITE_CARDINALITY:
        end = {name: tf.zeros(s.shape, s.dtype) for name, s in spec.items()}
        end[_LENGTH] = tf.constant(length + 1, spec[_LENGTH].dtype)
        pieces = pieces.concatenate(tf.data.Dataset.from_tensors(end).repeat(bins))
    rows = {name: tf.stack([value] * bins) for name, value in _empty_row(spec, length).items()}
    state = (rows, tf.zeros([bins], tf.int32), tf.zeros([bins], tf.int32))
    rows = pieces.scan(state, _packer(spec, length, sequences, bins))

    def emitted(emit, row):
        del row
        return emit

    def finish(emit, row):
        del emit
        row = {name: tf.ensure_shape(value, [length]) for name, value in row.items()}
        row[LOSS_WEIGHTS] = tf.cast(row[SEGMENT_IDS] > 0, tf.float32)
        return row

    return rows.filter(emitted).map(finish)


class PackSequences:
    """`pack_sequences` as a `TFRecordInput(to_static=...)` transform (gin-bindable).

    Args:
        length: positions a packed row.
        keys: features to pack; None packs every rank-1 feature.
        bins: rows open at once (`pack_sequences`): 1 keeps the order, more fill fuller.
    """

    def __init__(self, length: int, keys: Sequence[str] | None = None, bins: int = 1):
        self.length = check_length("PackSequences", length)
        self.keys = None if keys is None else tuple([keys] if isinstance(keys, str) else keys)
        self.bins = check_bins("PackSequences", bins)

    def __call__(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        return pack_sequences(dataset, self.length, self.keys, self.bins)

    def __repr__(self) -> str:
        return f"PackSequences({self.length}, keys={self.keys}, bins={self.bins})"
