"""Tests for tputrain.data.packing, padding and bucketing: variable-length sequences to
static shapes, without losing or duplicating a token."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tputrain.data import (PackSequences, PadSequences, TFRecordInput, bucket_by_length,
                           pack_sequences, pad_sequences, write_tfrecords)

LENGTH = 16


def _examples(lengths, seed=0, sources=2):
    """Token rows of the given lengths (tokens >= 1, so 0 is only ever padding) and a
    scalar `source` feature."""
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(1, 259, size=n).astype(np.int64),
             "source": np.int64(i % sources)} for i, n in enumerate(lengths)]


def _dataset(examples):
    return tf.data.Dataset.from_generator(
        lambda: iter(examples), output_signature={
            "tokens": tf.TensorSpec([None], tf.int64), "source": tf.TensorSpec([], tf.int64)})


def _rows(dataset):
    return [{k: v.numpy() for k, v in row.items()} for row in dataset]


LENGTHS = [3, 0, 16, 5, 40, 1, 0, 9, 12, 33, 7, 2, 15, 16, 17, 4]


def test_packing_keeps_every_token_in_order_and_rows_are_static():
    examples = _examples(LENGTHS)
    packed = pack_sequences(_dataset(examples), LENGTH)
    for key in ("tokens", "source", "segment_ids", "positions", "loss_weights"):
        assert packed.element_spec[key].shape == [LENGTH], key
    rows = _rows(packed)
    real = [row["segment_ids"] > 0 for row in rows]
    # Next-fit packing keeps the order: the real tokens, row after row, are the input's.
    got = np.concatenate([row["tokens"][mask] for row, mask in zip(rows, real)])
    assert got.tolist() == np.concatenate([e["tokens"] for e in examples]).tolist()
    # Per source, the multiset of tokens is the same (each token keeps its source).
    for source in (0, 1):
        want = collections.Counter(t for e in examples if e["source"] == source
                                   for t in e["tokens"].tolist())
        have = collections.Counter(t for row, mask in zip(rows, real)
                                   for t, s in zip(row["tokens"][mask], row["source"][mask])
                                   if s == source)
        assert have == want
    for row, mask in zip(rows, real):
        assert (row["loss_weights"] == mask.astype(np.float32)).all()
        assert (row["tokens"][~mask] == 0).all() and (row["positions"][~mask] == 0).all()
        # Padding only at the end; segments numbered 1, 2, ... in order.
        assert mask.tolist() == sorted(mask.tolist(), reverse=True)
        ids = row["segment_ids"][mask]
        assert ids[0] == 1 and set(np.diff(ids)) <= {0, 1}
    pieces = sum(-(-n // LENGTH) for n in LENGTHS)
    assert len(rows) < pieces  # rows hold several examples: fewer rows than padding needs


def test_long_examples_are_split_into_segments_whose_positions_restart():
    examples = _examples([40])  # 16 + 16 + 8 tokens
    rows = _rows(pack_sequences(_dataset(examples), LENGTH))
    assert len(rows) == 3
    assert [int((r["segment_ids"] > 0).sum()) for r in rows] == [16, 16, 8]
    for row in rows:
        n = int((row["segment_ids"] > 0).sum())
        assert row["positions"][:n].tolist() == list(range(n))
        assert set(row["segment_ids"][:n]) == {1}


def test_segments_never_cross_rows_and_positions_count_within_a_segment():
    rows = _rows(pack_sequences(_dataset(_examples(LENGTHS, seed=1)), LENGTH))
    pieces = []
    for row in rows:
        for segment in range(1, int(row["segment_ids"].max()) + 1):
            where = np.flatnonzero(row["segment_ids"] == segment)
            assert (np.diff(where) == 1).all()  # contiguous
            assert row["positions"][where].tolist() == list(range(len(where)))
            pieces.append(len(where))
    # Every example, split into pieces of at most LENGTH: the same pieces, in order.
    want = [min(LENGTH, n - start) for n in LENGTHS for start in range(0, n, LENGTH)]
    assert pieces == want


@pytest.mark.parametrize("bins", [1, 3])
def test_packing_is_deterministic_and_resumes_bitwise_from_an_iterator_checkpoint(tmp_path, bins):
    examples = _examples(np.random.default_rng(2).integers(0, 40, size=50).tolist())
    # A generator's position is not checkpointable: a tensor source is.
    def build():
        dataset = tf.data.Dataset.from_tensor_slices(
            tf.ragged.constant([e["tokens"].tolist() for e in examples], dtype=tf.int64)).map(
            lambda t: {"tokens": t})
        return pack_sequences(dataset.shuffle(20, seed=3).repeat(), LENGTH, bins=bins).batch(4)

    first = [b["tokens"].numpy() for b in build().take(30)]
    assert all((a == b).all() for a, b in zip(first, [b["tokens"].numpy()
                                                       for b in build().take(30)]))
    packed = build()
    iterator = iter(packed)
    for _ in range(7):
        next(iterator)
    checkpoint = tf.train.Checkpoint(iterator=iterator)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    expected = [{k: v.numpy() for k, v in next(iterator).items()} for _ in range(10)]
    restored = iter(packed)
    tf.train.Checkpoint(iterator=restored).read(path).assert_consumed()
    again = [{k: v.numpy() for k, v in next(restored).items()} for _ in range(10)]
    for a, b in zip(expected, again):
        assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_pack_sequences_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="length must be"):
        pack_sequences(_dataset(_examples([1])), 0)
    with pytest.raises(ValueError, match="'segment_ids' is a name packing writes"):
        pack_sequences(tf.data.Dataset.from_tensors(
            {"tokens": tf.constant([1]), "segment_ids": tf.constant([1])}), 4)
    with pytest.raises(ValueError, match="'image'.*rank 2"):
        pack_sequences(tf.data.Dataset.from_tensors(
            {"tokens": tf.constant([1]), "image": tf.zeros([2, 2])}), 4)
    with pytest.raises(ValueError, match="'text'.*string"):
        pack_sequences(tf.data.Dataset.from_tensors({"text": tf.constant(["a"])}), 4)
    with pytest.raises(ValueError, match="keys names 'x'"):
        pack_sequences(_dataset(_examples([1])), 4, keys=["x"])
    with pytest.raises(TypeError, match="dict"):
        pack_sequences(tf.data.Dataset.range(3), 4)


def test_feature_lengths_that_differ_within_an_example_fail_by_name():
    dataset = tf.data.Dataset.from_tensors({"tokens": tf.constant([1, 2, 3], tf.int64),
                                            "targets": tf.constant([1, 2], tf.int64)})
    with pytest.raises(tf.errors.InvalidArgumentError, match="tokens.*targets|same length"):
        list(pack_sequences(dataset, 4))


def test_pad_sequences_pads_and_truncates_with_the_same_features_as_packing():
    examples = _examples([3, 0, 20])
    rows = _rows(pad_sequences(_dataset(examples), LENGTH))
    assert [int(r["loss_weights"].sum()) for r in rows] == [3, 0, 16]  # 20 truncated to 16
    assert rows[2]["tokens"].tolist() == examples[2]["tokens"][:LENGTH].tolist()
    assert rows[0]["tokens"].tolist() == examples[0]["tokens"].tolist() + [0] * 13
    assert rows[0]["segment_ids"].tolist() == [1] * 3 + [0] * 13
    assert rows[0]["positions"].tolist() == [0, 1, 2] + [0] * 13
    assert rows[0]["source"] == 0  # scalar features stay scalars


def test_bucket_by_length_batches_to_one_static_length_per_bucket():
    examples = _examples([3, 5, 12, 30, 2, 7, 9, 15, 60, 1, 4, 8])
    batches = _rows(bucket_by_length(_dataset(examples), [8, 16, 32], batch_size=2))
    shapes = {b["tokens"].shape for b in batches}
    assert shapes <= {(2, 8), (2, 16), (2, 32)}
    for batch in batches:
        real = batch["loss_weights"] > 0
        assert (batch["tokens"][~real] == 0).all()
    seen = collections.Counter(int(w.sum()) for b in batches for w in b["loss_weights"])
    # 60 is truncated to the longest bucket; batches are full (drop_remainder).
    assert sum(seen.values()) == 2 * len(batches) and 60 not in seen


def test_pack_sequences_reads_variable_length_records_through_tfrecord_input(tmp_path):
    examples = _examples(LENGTHS, seed=4)
    write_tfrecords({"tokens": [e["tokens"] for e in examples]}, str(tmp_path / "seq"),
                    num_shards=1)
    inputs = TFRecordInput(manifest=str(tmp_path / "seq.manifest.json"), global_batch_size=1,
                           shuffle=False, repeat=False, to_static=PackSequences(LENGTH))
    rows = [{k: v.numpy()[0] for k, v in batch.items()} for batch in inputs()]
    got = np.concatenate([r["tokens"][r["segment_ids"] > 0] for r in rows])
    assert got.tolist() == np.concatenate([e["tokens"] for e in examples]).tolist()
    padded = TFRecordInput(manifest=str(tmp_path / "seq.manifest.json"), global_batch_size=4,
                           shuffle=False, repeat=False, to_static=PadSequences(LENGTH))
    assert next(iter(padded()))["tokens"].shape == (4, LENGTH)


def test_first_fit_over_several_rows_keeps_every_segment_and_fills_rows_fuller():
    """bins=4: every example's pieces are whole segments somewhere (multiset of
    segments in = out), rows are static, and fewer rows hold the same tokens."""
    lengths = [9, 9, 9, 9, 7, 7, 7, 7, 12, 12, 4, 4]  # 96 tokens: 6 full rows exist
    examples = _examples(lengths)
    next_fit = _rows(pack_sequences(_dataset(examples), LENGTH))
    first_fit = _rows(pack_sequences(_dataset(examples), LENGTH, bins=4))
    assert pack_sequences(_dataset(examples), LENGTH, bins=4).element_spec["tokens"].shape == [LENGTH]

    def segments(rows):
        found = collections.Counter()
        for row in rows:
            for segment in set(row["segment_ids"].tolist()) - {0}:
                mine = row["segment_ids"] == segment
                assert row["positions"][mine].tolist() == list(range(mine.sum()))
                found[tuple(row["tokens"][mine].tolist())] += 1
        return found
    assert segments(first_fit) == segments(next_fit) == collections.Counter(
        tuple(e["tokens"].tolist()) for e in examples if len(e["tokens"]))
    assert len(first_fit) < len(next_fit)
    share = sum(r["loss_weights"].sum() for r in first_fit) / (len(first_fit) * LENGTH)
    assert share >= 0.95


@pytest.mark.parametrize("make", [PackSequences, PadSequences,
                                  lambda n: PackSequences(8, bins=n)])
def test_packing_lengths_and_bins_have_a_limit_checked_at_construction(make):
    with pytest.raises(ValueError, match=r"at most [\d,]+.*got 1000000000000"):
        make(10**12)
    with pytest.raises(ValueError, match="at most"):
        bucket_by_length(_dataset(_examples([1])), [4, 10**12], 2)
