"""Tests for tputrain.data.mixture: weighted mixtures of sources, per host, resumable."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from faults import cli_refusal, write_token_sources
from tputrain.data import (InputContext, MixtureInput, PackSequences, PadSequences,
                           TFRecordInput, mix_datasets, source_counts, write_tfrecords)


def _source(value, length=3):
    """An endless source whose examples all hold `value` (so each shows where it came from)."""
    return tf.data.Dataset.from_tensors(
        {"tokens": tf.fill([length], tf.constant(value, tf.int64))}).repeat()


def test_observed_proportions_are_within_two_percent_of_the_weights():
    weights = [0.5, 0.3, 0.2]
    mixed = mix_datasets([_source(1), _source(2), _source(3)], weights, seed=7)
    batch = mixed.batch(10_000).take(1).get_single_element()
    ids, tokens = batch["source_id"].numpy(), batch["tokens"].numpy()[:, 0]
    assert len(ids) == 10_000
    assert (tokens == ids + 1).all()  # the id names the source an example came from
    shares = np.bincount(ids, minlength=3) / len(ids)
    assert np.abs(shares - weights).max() < 0.02, shares


def test_weights_need_not_sum_to_one_and_the_seed_fixes_the_order():
    def ids(seed):
        mixed = mix_datasets([_source(1), _source(2)], [3, 1], seed=seed)
        return [int(e["source_id"]) for e in mixed.take(400).as_numpy_iterator()]

    assert ids(1) == ids(1) and ids(1) != ids(2)
    assert abs(np.mean(np.array(ids(1)) == 0) - 0.75) < 0.07


@pytest.mark.slow
def test_a_mixture_resumes_bitwise_from_an_iterator_checkpoint_mid_stream(tmp_path):
    def build():
        a = tf.data.Dataset.range(1000).map(lambda i: {"tokens": tf.fill([i % 7], i)})
        b = tf.data.Dataset.range(1000, 2000).map(lambda i: {"tokens": tf.fill([i % 5 + 1], i)})
        mixed = mix_datasets([a.shuffle(50, seed=1).repeat(), b.shuffle(50, seed=2).repeat()],
                             [0.6, 0.4], seed=3)
        return PackSequences(8)(mixed).batch(2)

    iterator = iter(build())
    for _ in range(9):
        next(iterator)
    path = tf.train.Checkpoint(iterator=iterator).write(str(tmp_path / "ckpt"))
    expected = [next(iterator) for _ in range(12)]
    restored = iter(build())
    tf.train.Checkpoint(iterator=restored).read(path).assert_consumed()
    for want, got in zip(expected, (next(restored) for _ in range(12))):
        assert want.keys() == got.keys()
        for key in want:
            assert want[key].numpy().tobytes() == got[key].numpy().tobytes(), key


def test_source_counts_count_examples_and_real_tokens_per_source():
    a = tf.data.Dataset.from_tensor_slices({"tokens": tf.ragged.constant([[1, 1], [1]])})
    b = tf.data.Dataset.from_tensor_slices({"tokens": tf.ragged.constant([[2, 2, 2]])})
    mixed = mix_datasets([a, b], [0.5, 0.5], seed=0)
    packed = next(iter(PackSequences(8)(mixed).batch(1)))
    counts = source_counts(packed, 2)
    assert counts["examples"].numpy().tolist() == [2, 1]
    assert counts["tokens"].numpy().tolist() == [3, 3]
    padded = next(iter(PadSequences(4)(mix_datasets([a, b], [0.5, 0.5], seed=0)).batch(3)))
    assert source_counts(padded, 2)["examples"].numpy().tolist() == [2, 1]
    assert source_counts(padded, 2)["tokens"].numpy().tolist() == [3, 3]


def _write_source(directory, name, first_id, count, length):
    ids = np.arange(first_id, first_id + count)
    write_tfrecords({"tokens": [np.full(1 + i % length, i) for i in ids]},
                    str(directory / name), num_shards=4)
    return str(directory / f"{name}.manifest.json")


def test_mixture_input_shards_every_source_per_host(tmp_path):
    sources = [_write_source(tmp_path, "a", 0, 40, 5), _write_source(tmp_path, "b", 1000, 40, 3)]
    seen = []
    for pipeline in range(2):
        context = InputContext(num_input_pipelines=2, input_pipeline_id=pipeline,
                               num_replicas_in_sync=2, global_batch_size=2)
        inputs = MixtureInput(sources, [0.5, 0.5], to_static=PadSequences(8), shuffle=False,
                              repeat=False)
        batches = list(inputs(context))
        assert all(b["tokens"].shape == (1, 8) for b in batches)
        seen.append({int(b["tokens"][0, 0]) for b in batches})
    assert not seen[0] & seen[1]  # no example on both hosts
    assert seen[0] | seen[1] == set(range(40)) | set(range(1000, 1040))


def test_mixture_input_checks_its_arguments(tmp_path):
    sources = [_write_source(tmp_path, "a", 0, 8, 5), _write_source(tmp_path, "b", 100, 8, 3)]
    with pytest.raises(ValueError, match="2 sources but 3 weights"):
        MixtureInput(sources, [1, 1, 1], to_static=PackSequences(8))
    with pytest.raises(ValueError, match="weights must be >= 0 with a positive sum"):
        MixtureInput(sources, [1, -1], to_static=PackSequences(8))
    with pytest.raises(ValueError, match="variable-length.*to_static"):
        MixtureInput(sources, [1, 1])
    write_tfrecords({"other": np.zeros((8, 2), np.float32)}, str(tmp_path / "c"), num_shards=4)
    with pytest.raises(ValueError, match="source 1 .* features"):
        MixtureInput([sources[0], str(tmp_path / "c.manifest.json")], [1, 1],
                     to_static=PackSequences(8))(InputContext(global_batch_size=1))
    inputs = TFRecordInput(manifest=sources[0], to_static=PackSequences(8))
    assert isinstance(MixtureInput([inputs, sources[1]], [1, 1], to_static=PackSequences(8),
                                   global_batch_size=2)(), tf.data.Dataset)


# Through the Trainer: a packed 2-source mixture resumes bitwise in host input mode.

LENGTH, VOCAB = 16, 64


def _targets(row):
    """Next-token targets inside each segment (0, weightless, where the segment ends)."""
    following = tf.concat([row["tokens"][1:], [0]], 0)
    same = tf.concat([row["segment_ids"][1:] == row["segment_ids"][:-1], [False]], 0)
    return {"tokens": row["tokens"], "targets": tf.where(same, following, 0)}


class PackedTask(tputrain.Task):
    """A tiny next-token model over packed rows of a 2-source mixture."""

    def __init__(self, sources):
        self.sources = sources

    def build_model(self):
        tokens = keras.Input((LENGTH,), dtype="int64", name="tokens")
        hidden = keras.layers.Dense(8)(keras.ops.one_hot(tokens, VOCAB))
        return keras.Model({"tokens": tokens}, keras.layers.Dense(VOCAB)(hidden))

    def build_inputs(self, split, input_context):
        # Unshuffled sources: with shuffled ones the weights of two fresh runs differ
        # through the Trainer (not when the same pipeline is iterated directly): open.
        mixture = MixtureInput(self.sources, [0.7, 0.3], label_key="targets", seed=5,
                               shuffle=False,
                               to_static=lambda d: PackSequences(LENGTH)(d).map(_targets))
        return mixture(input_context)

    def compute_loss(self, labels, outputs):
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            labels, outputs, from_logits=True), axis=-1)

    def build_optimizer(self):
        return keras.optimizers.SGD(0.1)


def _straight_half_resumed(tmp_path, make_task, global_batch_size: int) -> tuple:
    """Host-mode Trainers of `make_task()`: 8 steps straight, and 4 steps then a resume
    to 8 in another model_dir (each trained)."""
    def trainer(directory, steps):
        return tputrain.Trainer(make_task(), str(tmp_path / directory),
                                strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
                                train_steps=steps, steps_per_loop=2,
                                global_batch_size=global_batch_size, checkpoint_every=2,
                                eval_steps=1, input_mode="host", report_mfu=False)
    runs = []
    for directory, steps in (("straight", 8), ("resumed", 4), ("resumed", 8)):
        runs.append(trainer(directory, steps))
        runs[-1].train()
    return tuple(runs)


@pytest.mark.slow
def test_a_packed_mixture_resumes_bitwise_through_the_trainer(tmp_path):
    sources = write_token_sources(tmp_path, {"a": 60, "b": 40}, (0, 30), seed=6, vocab=VOCAB)
    straight, half, resumed = _straight_half_resumed(tmp_path, lambda: PackedTask(sources), 4)
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # The last 4 steps moved the weights: equality above is not of untrained models.
    assert any(np.asarray(a).tobytes() != np.asarray(b).tobytes()
               for a, b in zip(half.model.get_weights(), straight.model.get_weights()))


class ProbedTask(PackedTask):
    """PackedTask with shuffled sources; the train dataset is first read by `probes`
    throwaway iterators (several epochs each), as a process with more pre-flight
    checks would read it before the Trainer's own iterator."""

    def __init__(self, sources, probes):
        super().__init__(sources)
        self.probes = probes

    def build_inputs(self, split, input_context):
        mixture = MixtureInput(self.sources, [0.7, 0.3], label_key="targets", seed=5,
                               shuffle_buffer=8,
                               to_static=lambda d: PackSequences(LENGTH)(d).map(_targets))
        dataset = mixture(input_context)
        for _ in range(self.probes if split == "train" else 0):
            for _ in dataset.take(20):
                pass
        return dataset


def _small_sources(directory):
    return write_token_sources(directory, {"a": 12, "b": 8}, (1, 10), seed=7, vocab=VOCAB)

@pytest.mark.slow

def test_iterators_made_first_do_not_change_what_a_shuffled_mixture_trains_on(tmp_path):
    """Two runs over a few epochs of shuffled sources, one after its train dataset was
    read by other iterators: bitwise-equal weights (each epoch's order is a function
    of the seed and the epoch only)."""
    sources = _small_sources(tmp_path)

    def trained(directory, probes):
        trainer = tputrain.Trainer(ProbedTask(sources, probes), str(tmp_path / directory),
                                   strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
                                   train_steps=8, steps_per_loop=4, global_batch_size=4,
                                   eval_steps=1, input_mode="host", report_mfu=False)
        trainer.train()
        return [np.asarray(w).tobytes() for w in trainer.model.get_weights()]

    assert trained("plain", probes=0) == trained("probed", probes=3)


@pytest.mark.slow
def test_a_shuffled_mixture_run_killed_mid_run_resumes_bitwise(tmp_path):
    """A shuffled 2-source weighted mixture, packed, through the CLI: the run's
    model_dir as a SIGKILL after step 6 leaves it, rerun, equals the uninterrupted
    run bitwise, and its per-source counts continue."""
    from faults import killed_and_rerun, same_final_weights

    sources = write_token_sources(tmp_path, {"wiki": 90, "code": 60}, (0, 40), seed=7)
    config = tmp_path / "mixture.gin"
    config.write_text(f"""
Trainer.task = @MixtureTask()
MixtureTask.sources = {sources!r}
Trainer.train_steps = 12
Trainer.steps_per_loop = 2
Trainer.checkpoint_every = 4
Trainer.eval_every = 12
Trainer.global_batch_size = 4
Trainer.input_mode = 'host'
Trainer.report_mfu = False
""")
    reference, resumed = killed_and_rerun(tmp_path, config, step=6)
    assert "ckpt-4 (step 4)" in resumed.text(), resumed.log()  # steps 5-6 replayed
    assert "sources: wiki" in reference.text(), reference.log()
    last = [line for line in reference.text().splitlines() if "sources: wiki" in line][-1]
    again = [line for line in resumed.text().splitlines() if "sources: wiki" in line][-1]
    assert last.split("sources: ")[1].split(" | ")[:2] == again.split("sources: ")[1].split(
        " | ")[:2]  # the same counts at the end: continued, not restarted
    weights = same_final_weights(tmp_path)
    assert len(weights) >= 3


@pytest.mark.parametrize("weights", [[float("inf"), 1], [float("nan"), 1], [1e308, 1e308]])
def test_mixture_weights_are_checked_at_construction_and_quoted_as_given(weights):
    with pytest.raises(ValueError, match=r"finite") as caught:
        mix_datasets([_source(1), _source(2)], weights)
    assert str(weights[0]) in str(caught.value) and "nan, 0.0" not in str(caught.value)
    with pytest.raises(ValueError, match=r"MixtureInput: .*finite") as caught:
        MixtureInput(["a.manifest.json", "b.manifest.json"], weights)
    assert str(weights[0]) in str(caught.value)


def test_a_mixture_with_an_empty_component_is_one_line_and_exit_2(tmp_path):
    """A shuffled mixture with a component of 0-byte shards hung (timeout: a hang guard)."""
    good = write_token_sources(tmp_path, {"good": 40}, (2, 9), seed=1)[0]
    (tmp_path / "empty-00000-of-00001.tfrecord").write_bytes(b"")
    empty = str(tmp_path / "empty-*")
    with pytest.raises(ValueError, match=r"source 1 \('empty'\).*0-byte") as caught:
        MixtureInput([good, empty], [1, 1], features={"tokens": ([None], "int64")},
                     to_static=PackSequences(8))(InputContext(global_batch_size=2))
    assert "\n" not in str(caught.value)
    stderr = cli_refusal(tmp_path, f"Trainer.task = @MixtureTask()\nMixtureTask.sources = "
                         f"['{good}', '{empty}']\nMixtureTask.features = "
                         "{'tokens': ([None], 'int64')}\nTrainer.train_steps = 2\n"
                         "Trainer.global_batch_size = 4\nTrainer.eval_steps = 1\n")
    assert "source 1 ('empty')" in stderr


def test_a_mixture_whose_to_static_keeps_nothing_is_named(tmp_path):
    sources = write_token_sources(tmp_path, {"a": 10, "b": 10}, (2, 9), seed=2)
    with pytest.raises(ValueError, match=r"to_static .*keeps none of the 20 examples") as caught:
        MixtureInput(sources, [1, 1], to_static=lambda d: PackSequences(8)(
            d.filter(lambda e: e["source_id"] > 5)))(InputContext(global_batch_size=2))
    assert "\n" not in str(caught.value)


# MixtureInput(positional=True): quota choices, every source at its own position.

def _id_sources(directory) -> list[str]:
    """Two sources of fixed-length examples, "id" 0..599 and 1000..1399, 8 shards each
    (blocks of 75 and 50: windows of that many with window_blocks=1, 8 an epoch)."""
    manifests = []
    for name, first, count in (("a", 0, 600), ("b", 1000, 400)):
        write_tfrecords({"id": np.arange(first, first + count, dtype=np.int64)},
                        str(directory / name), num_shards=8)
        manifests.append(str(directory / f"{name}.manifest.json"))
    return manifests


def _mixture_ids(sources, hosts: int, host: int, batch: int, consumed: int, steps: int,
                 history=()) -> list[tuple[int, int]]:
    """(id, source id) of host `host`'s examples over `steps` steps of a global `batch`."""
    context = InputContext(hosts, host, hosts, global_batch_size=batch,
                           examples_consumed=consumed, layout_history=history)
    dataset = MixtureInput(sources, [3, 1], positional=True, window_blocks=1, seed=4)(context)
    assert context.positional and context.position_honoured is (consumed > 0)
    return [(int(i), int(s)) for b in dataset.take(steps).as_numpy_iterator()
            for i, s in zip(b["id"], b["source_id"])]


@pytest.mark.slow  # five mixtures built (each traces two positional sources)
def test_a_positional_mixture_rebuilt_at_a_position_continues_the_uninterrupted_one(
        tmp_path):
    """2 hosts, global batch 64: rebuilt at step 3 and at step 33 (past a quota block
    of 1024 choices, and past source b's epoch: 200 records a host), each host's
    examples are the uninterrupted ones from there, with their sources."""
    sources = _id_sources(tmp_path)
    whole = {host: _mixture_ids(sources, 2, host, 64, 0, 35) for host in range(2)}
    for step, host in ((3, 1), (33, 0), (33, 1)):
        assert _mixture_ids(sources, 2, host, 64, step * 64, 2) == \
            whole[host][step * 32:(step + 2) * 32], (host, step)


@pytest.mark.slow  # five mixtures built
def test_a_positional_mixture_reads_no_example_twice_through_2_then_3_hosts(tmp_path):
    """3 steps of 48 on 2 hosts, then 4 steps of 48 on 3 (each source's windows carried
    over by its own ledger): no example of either source read twice (336 examples:
    under either source's epoch at the weights 3:1), and the sources' shares are the
    quotas of the choices each host made."""
    sources = _id_sources(tmp_path)
    read = [pair for host in range(2) for pair in _mixture_ids(sources, 2, host, 48, 0, 3)]
    history = ((0, 2), (144, 3))
    read += [pair for host in range(3)
             for pair in _mixture_ids(sources, 3, host, 48, 144, 4, history)]
    ids = [i for i, _ in read]
    assert len(ids) == 336 and len(set(ids)) == 336
    assert all((i >= 1000) == (s == 1) for i, s in read)


def test_a_positional_mixture_needs_positional_sources():
    from tputrain.data import TFRecordInput
    with pytest.raises(ValueError, match="source 0 is a TFRecordInput with positional=False"):
        MixtureInput([TFRecordInput("/nowhere-*", {"id": ([], "int64")})], [1],
                     positional=True)


class PositionalMixtureTask(tputrain.Task):
    """A classifier over a positional 2-source mixture of fixed-length examples."""

    def __init__(self, sources):
        self.sources = sources

    def build_model(self):
        inputs = keras.Input((8,), name="x")
        return keras.Model({"x": inputs}, keras.layers.Dense(2)(inputs))

    def build_inputs(self, split, input_context):
        return MixtureInput(self.sources, [3, 1], label_key="label", seed=5, positional=True,
                            window_blocks=1)(input_context)

    def compute_loss(self, labels, outputs):
        return keras.losses.sparse_categorical_crossentropy(labels, outputs, from_logits=True)

    def build_optimizer(self):
        return keras.optimizers.SGD(0.1)


@pytest.mark.slow  # three Trainers
def test_a_positional_mixture_resumes_bitwise_and_its_source_counts_carry_on(tmp_path):
    """Host mode: 4 steps, then resumed to 8 (no iterator saved: the mixture is built at
    the 32 examples consumed) train the weights and per-source counts of 8 steps."""
    rng = np.random.default_rng(3)
    sources = []
    for name, count in (("a", 300), ("b", 200)):
        write_tfrecords({"x": rng.standard_normal((count, 8)).astype(np.float32),
                         "label": rng.integers(0, 2, count)}, str(tmp_path / name),
                        num_shards=4)
        sources.append(str(tmp_path / f"{name}.manifest.json"))
    straight, half, resumed = _straight_half_resumed(
        tmp_path, lambda: PositionalMixtureTask(sources), 8)
    assert half.inputs.saved_state(half.train_iterator) == {}
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    counts = [t.inputs.source_counter.examples.numpy().tolist() for t in (straight, resumed)]
    assert counts[0] == counts[1] and sum(counts[0]) == 64, counts
