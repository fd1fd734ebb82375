"""Tests for tputrain.data.packed_rows: a positional input's packed rows, rebuilt at
the place the sums of the rows trained on give."""

import numpy as np
import pytest
import tensorflow as tf

from tputrain.data import InputContext, TFRecordInput, write_tfrecords
from tputrain.data.packed_rows import ROW_END, ROW_HOST, places, row_sums
from tputrain.data.packing import PackSequences

pytestmark = pytest.mark.same_worker("packed_rows")  # the module-scoped manifest


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    """700 token records of 0 to 11 tokens in 2 shards: windows of 256 records (blocks
    of 256, window_blocks=1), about 100 rows of 16 each."""
    rng = np.random.default_rng(0)
    prefix = str(tmp_path_factory.mktemp("packed") / "tokens")
    write_tfrecords({"tokens": [rng.integers(1, 32, size=n) for n in
                                rng.integers(0, 12, size=700)]}, prefix, num_shards=2)
    return prefix + ".manifest.json"


def _input(manifest: str) -> TFRecordInput:
    return TFRecordInput(manifest=manifest, positional=True, window_blocks=1, seed=3,
                         to_static=PackSequences(16, bins=4))


def _batches(manifest: str, hosts: int, host: int, count: int, row_places=()) -> list[dict]:
    context = InputContext(hosts, host, hosts, global_batch_size=8 * hosts,
                           row_places=row_places)
    dataset = _input(manifest)(context)
    assert context.positional and context.position_honoured == any(
        place != (0, 0) for place in row_places[host:host + 1])
    return [{k: v.numpy() for k, v in batch.items()} for batch in dataset.take(count)]


@pytest.mark.parametrize("hosts, positions, count", [
    (1, (14,), 16),
    pytest.param(1, (0, 5, 13, 27), 30, marks=pytest.mark.slow),
    pytest.param(2, (0, 5, 12, 13, 27), 30, marks=pytest.mark.slow)])
def test_a_rebuild_at_the_summed_place_reads_the_uninterrupted_rows(manifest, hosts, positions,
                                                                     count):
    """After 0, 5 (mid-window), 12-14 (about the first window's end: row 100 or 106)
    and 27 batches (third window) of 8 rows, the place the sums of the rows read give rebuilds the
    uninterrupted rows (the last host's of `hosts`)."""
    host = hosts - 1
    whole = _batches(manifest, hosts, host, count)
    assert all((b[ROW_HOST] == host).all() for b in whole)
    ends = sum(int((b[ROW_END] > 0).sum()) for b in whole[:max(positions)])
    assert ends >= (2 if count == 30 else 1)  # past the first (and second) window's end
    for at in positions:
        totals = sum((row_sums(b, hosts).numpy() for b in whole[:at]),
                     np.zeros([hosts, 3], np.int32))
        again = _batches(manifest, hosts, host, count - at, places(totals))
        assert len(again) == count - at
        for expected, actual in zip(whole[at:], again):
            assert expected.keys() == actual.keys()
            for key in expected:
                np.testing.assert_array_equal(actual[key], expected[key], err_msg=f"{at} {key}")


def test_each_window_packs_on_its_own_and_ends_with_its_row_count(manifest):
    """The rows of the first window: its last row says how many they are, and they hold
    that window's tokens alone (the packer restarts at the next)."""
    batches = _batches(manifest, 1, 0, 30)
    ends = np.concatenate([b[ROW_END] for b in batches])
    first_end = int(np.flatnonzero(ends)[0])
    assert ends[first_end] == first_end + 1
    segments = np.concatenate([b["segment_ids"] for b in batches])[:first_end + 1]
    assert 0 < segments.max() and (segments[:, 0] == 1).all()  # every row starts a segment


@pytest.mark.parametrize("name", [ROW_HOST, ROW_END])
def test_a_row_feature_named_as_a_tag_is_refused_not_overwritten(name):
    """The tags ride in the row's features: a user's feature of that name would be
    replaced by the tag without a word, and the model would train on it."""
    from tputrain.data.packed_rows import tagged

    rows = tf.data.Dataset.from_tensors({"tokens": tf.zeros([4], tf.int64),
                                         name: tf.ones([4], tf.int64)})
    with pytest.raises(ValueError, match=f"{name}.*rename"):
        tagged(rows, host=0)


def test_rows_on_another_host_count_are_refused_naming_the_fix(manifest):
    context = InputContext(1, 0, 1, global_batch_size=8, examples_consumed=64,
                           layout_history=((0, 2), (32, 1)), row_places=((3, 1),))
    with pytest.raises(ValueError, match="resume on the host count it started with"):
        _input(manifest)(context)


@pytest.mark.slow  # three Trainers on 2 replicas, each mode
@pytest.mark.parametrize("input_mode", ["distributed", "host"])
def test_a_packed_positional_resume_trains_the_uninterrupted_weights(manifest, tmp_path,
                                                                     input_mode):
    """2 replicas, rows of 16 packed first-fit, windows of about 100 rows: 8 steps of
    8 rows (mid-window), then a resume to step 16 (past the window's end) builds the
    input at each host's place from the checkpointed row sums (no iterator saved in
    host mode, nothing re-read in distributed mode) and trains the uninterrupted
    weights bitwise."""
    import tputrain
    from faults import PackedRowsTask
    from tiny import strategy_for

    class Packed(PackedRowsTask):
        places: list = []

        def build_inputs(self, split, input_context):
            if split == "train":
                type(self).places.append(getattr(input_context, "row_places", ()))
            return super().build_inputs(split, input_context)

    def trainer(name):
        return tputrain.Trainer(Packed(manifest), str(tmp_path / name), strategy=strategy_for(2),
                                input_mode=input_mode, train_steps=16, steps_per_loop=4,
                                global_batch_size=8, checkpoint_every=8, eval_steps=1,
                                report_mfu=False)
    whole = trainer("whole")
    whole.train()
    first = trainer("resumed")
    first.train(num_steps=8)
    first.close()
    Packed.places.clear()
    second = trainer("resumed")
    second.train()
    assert any(places and places != ((0, 0),) for places in Packed.places), Packed.places
    reader = tf.train.load_checkpoint(second.checkpointer.latest)
    names = [name for name, _ in tf.train.list_variables(second.checkpointer.latest)]
    assert not any("iterator" in name for name in names), names
    assert reader.get_tensor("row_sums/.ATTRIBUTES/VARIABLE_VALUE")[0, 0] == 16 * 8
    for a, b in zip(whole.model.get_weights(), second.model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def token_sources(tmp_path_factory):
    """Two token sources of 1 to 4 tokens a record (600 and 400 records, 2 shards):
    a quota block of 1,024 draws packs into about 170 rows of 16."""
    from faults import write_token_sources
    return write_token_sources(tmp_path_factory.mktemp("sources"), {"a": 600, "b": 400},
                               (1, 5), seed=2)


def _mixture_batches(sources, count: int, row_places=()) -> list[dict]:
    from tputrain.data import MixtureInput
    context = InputContext(1, 0, 1, global_batch_size=8, row_places=row_places)
    dataset = MixtureInput(sources, [0.7, 0.3], seed=5, positional=True, window_blocks=1,
                           to_static=PackSequences(16, bins=4))(context)
    assert context.positional and context.position_honoured == bool(
        row_places and row_places[0] != (0, 0))
    return [{k: v.numpy() for k, v in batch.items()} for batch in dataset.take(count)]


@pytest.mark.slow  # two mixtures built and packed: 10 s
def test_a_packed_positional_mixture_rebuilt_at_its_place_reads_the_uninterrupted_rows(
        token_sources):
    """Each block of quota draws packs on its own: rebuilt at the place the row sums of
    25 batches give (past the first block's end), the rows and their sources continue
    the uninterrupted ones."""
    whole = _mixture_batches(token_sources, 30)
    totals = sum((row_sums(b, 1).numpy() for b in whole[:25]), np.zeros([1, 3], np.int32))
    assert totals[0, 1] >= 1  # a block ended
    again = _mixture_batches(token_sources, 5, places(totals))
    for expected, actual in zip(whole[25:], again):
        assert expected.keys() == actual.keys() and "source_id" in expected
        for key in expected:
            np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.mark.slow  # three Trainers on 2 replicas, each mode
@pytest.mark.parametrize("input_mode", ["distributed", "host"])
def test_a_packed_positional_mixture_resume_trains_the_uninterrupted_weights_and_counts(
        token_sources, tmp_path, input_mode):
    """A packed 2-source positional mixture on 2 replicas: 12 steps of 8 rows, then a
    resume to step 24 (past the first quota block's rows) builds the rows at each
    host's place and trains the uninterrupted weights and per-source counts bitwise."""
    import tputrain
    from faults import MixtureTask
    from tiny import strategy_for

    def trainer(name):
        return tputrain.Trainer(MixtureTask(token_sources, positional=True),
                                str(tmp_path / name), strategy=strategy_for(2),
                                input_mode=input_mode, train_steps=24, steps_per_loop=4,
                                global_batch_size=8, checkpoint_every=12, eval_steps=1,
                                report_mfu=False)
    whole = trainer("whole")
    whole.train()
    first = trainer("resumed")
    first.train(num_steps=12)
    first.close()
    second = trainer("resumed")
    second.train()
    assert second.inputs.row_places()[0][0] >= 1  # a block's rows ended
    assert second.inputs.saved_state(second.train_iterator) == {}
    counts = [t.inputs.source_counter.examples.numpy().tolist() for t in (whole, second)]
    assert counts[0] == counts[1] and min(counts[0]) > 0, counts
    for a, b in zip(whole.model.get_weights(), second.model.get_weights()):
        np.testing.assert_array_equal(a, b)
