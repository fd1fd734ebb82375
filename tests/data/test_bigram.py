"""Tests for tputrain.data.bigram: the bits-per-byte baseline a byte-level model must beat."""

import numpy as np

from tputrain.data import bigram_bits_per_byte, write_text_corpus, write_tfrecords
from tputrain.data.text_corpus import EOS_ID, VOCAB_SIZE


def _write(path, rows):
    write_tfrecords({"tokens": [np.append(r, EOS_ID) for r in rows]}, str(path), num_shards=1,
                    var_len=["tokens"])
    return f"{path}.manifest.json"


def test_a_predictable_sequence_costs_almost_nothing_and_noise_costs_eight_bits(tmp_path):
    cycle = [np.tile(np.arange(10, 20), 2000)]
    assert bigram_bits_per_byte(_write(tmp_path / "a", cycle), _write(tmp_path / "b", cycle)) < 0.05
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, size=1_000_000)]
    other = [rng.integers(0, 256, size=20_000)]
    bits = bigram_bits_per_byte(_write(tmp_path / "c", noise), _write(tmp_path / "d", other))
    assert 7.9 < bits < 8.3


def test_the_stdlib_bigram_baseline_is_well_below_uniform(tmp_path):
    corpus = write_text_corpus(str(tmp_path / "corpus"), max_files=8, heldout_fraction=0.25)
    bits = bigram_bits_per_byte(corpus.train, corpus.heldout)
    assert 2.0 < bits < np.log2(VOCAB_SIZE)
