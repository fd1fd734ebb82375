"""Per-source example counts of a weighted mixture: exact, global, checkpointed, shown.

The expected counts are a direct count of the source ids of the segments in the
batches the run consumed: the same seeded mixture iterated here, batch by batch.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tputrain
from events import scalar_points
from faults import write_token_sources
from tiny import strategy_for
from tputrain.data import InputContext, MixtureInput, PackSequences
from tputrain.observe.progress import Progress

LENGTH, VOCAB, GLOBAL_BATCH, REPLICAS = 16, 32, 4, 2


def _targets(row):
    following = tf.concat([row["tokens"][1:], [0]], 0)
    same = tf.concat([row["segment_ids"][1:] == row["segment_ids"][:-1], [False]], 0)
    return {**row, "targets": tf.where(same, following, 0)}


def _mixture(sources):
    return MixtureInput(sources, [0.7, 0.3], label_key="targets", seed=3, shuffle_buffer=16,
                        to_static=lambda d: PackSequences(LENGTH)(d).map(_targets))


class NoSourceModel(keras.Model):
    """Fails if the mixture's source id reaches the model's features."""

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(VOCAB, 8)
        self.out = keras.layers.Dense(VOCAB)

    def call(self, features):
        if "source_id" in features:
            raise AssertionError(f"the source id reached the model: {sorted(features)}")
        return self.out(self.embed(features["tokens"]))


class MixtureTask(tputrain.Task):
    def __init__(self, sources):
        self.sources = sources

    def build_model(self):
        return NoSourceModel()

    def build_inputs(self, split, input_context):
        return _mixture(self.sources)(input_context)

    def compute_loss(self, labels, outputs):
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            labels, outputs, from_logits=True), axis=-1)

    def build_optimizer(self):
        return keras.optimizers.SGD(0.1)


def _sources(directory):
    return write_token_sources(directory, {"wiki": 30, "code": 20}, (1, 12), seed=11,
                               vocab=VOCAB)


def direct_counts(sources, steps, replicas=REPLICAS):
    """[wiki, code] examples (segments) in the first `steps` steps' batches, counted
    from each row's segment ids and the source id their tokens carry."""
    context = InputContext(num_input_pipelines=1, input_pipeline_id=0,
                           num_replicas_in_sync=replicas, global_batch_size=GLOBAL_BATCH)
    counts = np.zeros(2, np.int64)
    batches = _mixture(sources)(context).take(steps * replicas)
    for features, _ in batches.as_numpy_iterator():
        for segments, ids in zip(features["segment_ids"], features["source_id"]):
            for segment in set(segments.tolist()) - {0}:
                counts[ids[segments == segment][0]] += 1
    return counts


def _trainer(tmp_path, sources, directory, steps, replicas=REPLICAS):
    return tputrain.Trainer(MixtureTask(sources), str(tmp_path / directory),
                            strategy=strategy_for(replicas), train_steps=steps, steps_per_loop=2,
                            global_batch_size=GLOBAL_BATCH, checkpoint_every=2, eval_steps=1,
                            report_mfu=False)


# 2 replicas: summed over replicas; 1 replica: the whole step one XLA program.
@pytest.mark.parametrize("replicas", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_the_counts_are_exact_cumulative_global_and_shown(tmp_path, caplog, replicas):
    sources = _sources(tmp_path)
    with caplog.at_level("INFO"):
        _trainer(tmp_path, sources, "run", 6, replicas).train()
    points = scalar_points(tmp_path / "run" / "train")
    for step in (2, 4, 6):
        written = [dict(points[f"examples/{name}"])[step] for name in ("wiki", "code")]
        assert written == direct_counts(sources, step, replicas).tolist(), step
    wiki, code = direct_counts(sources, 6, replicas)
    assert wiki > 0 and code > 0
    line = [r.getMessage() for r in caplog.records if "step 6/6" in r.getMessage()][-1]
    wiki_share, code_share = (f"{100 * n / (wiki + code):.0f}" for n in (wiki, code))
    assert f"sources: wiki {wiki_share}% ({wiki}) | code {code_share}% ({code})" in line, line


# slow tier: the counts' exactness stays in the default tier
@pytest.mark.slow
def test_a_resumed_run_continues_the_counts(tmp_path):
    sources = _sources(tmp_path)
    _trainer(tmp_path, sources, "resumed", 4).train()
    _trainer(tmp_path, sources, "resumed", 8).train()
    points = scalar_points(tmp_path / "resumed" / "train")
    for step in (2, 4, 6, 8):
        written = [dict(points[f"examples/{name}"])[step] for name in ("wiki", "code")]
        assert written == direct_counts(sources, step).tolist(), step


def test_the_progress_line_shows_shares_and_counts_and_a_plain_run_shows_none(caplog):
    progress = Progress(None, train_steps=10, global_batch_size=8)
    with caplog.at_level("INFO"):
        progress.train_loop_done(10, 10, 1.0, {"loss": 1.0, "examples/wiki": 6100.0,
                                               "examples/code": 3900.0})
        progress.train_loop_done(10, 10, 1.0, {"loss": 1.0})
    mixed, plain = (r.getMessage() for r in caplog.records[-2:])
    assert "sources: wiki 61% (6.1k) | code 39% (3.9k)" in mixed
    assert "examples/wiki" not in mixed
    assert "sources" not in plain


def test_a_plain_input_has_no_counter():
    from tputrain.data.mixture import mixture_sources
    assert mixture_sources(tf.data.Dataset.range(3)) is None


def test_names_default_to_the_sources_and_must_match_them(tmp_path):
    sources = _sources(tmp_path)
    from tputrain.data.mixture import mixture_sources
    dataset = _mixture(sources)(InputContext(global_batch_size=2))
    assert mixture_sources(dataset).names == ("wiki", "code")
    named = MixtureInput(sources, [1, 1], names=["w", "c"], to_static=PackSequences(LENGTH))
    assert mixture_sources(named(InputContext(global_batch_size=2))).names == ("w", "c")
    with pytest.raises(ValueError, match="2 sources but 1 names"):
        MixtureInput(sources, [1, 1], names=["w"], to_static=PackSequences(LENGTH))
    with pytest.raises(ValueError, match="unique"):
        MixtureInput(sources, [1, 1], names=["w", "w"], to_static=PackSequences(LENGTH))
