"""Tests for tputrain.data.mixture_positions: quota choices and each source's position
from the examples consumed."""

import numpy as np
import pytest

from tputrain.data.mixture_positions import (QUOTA_BLOCK, choices, counts_at, quotas,
                                             source_positions)


def _choices(seed, quota, start, count):
    return [int(c) for c in choices(seed, quota, start).take(count).as_numpy_iterator()]


@pytest.mark.parametrize("weights", [[3, 1], [0.2, 0.5, 0.3], [1, 1, 1]])
def test_a_blocks_quotas_are_the_weights_shares_to_the_choice(weights):
    quota = quotas(weights)
    assert quota.sum() == QUOTA_BLOCK
    shares = np.asarray(weights) / np.sum(weights) * QUOTA_BLOCK
    assert np.all(np.abs(quota - shares) < 1)


def test_counts_and_a_rebuilt_sequence_are_those_of_the_uninterrupted_choices():
    """Small blocks (12 choices): the closed-form counts equal the drawn choices' counts
    at any n, and the sequence built from choice `start` is the uninterrupted tail."""
    quota = quotas([3, 1, 2], block=12)
    whole = _choices(9, quota, 0, 60)
    assert [whole[12 * b:12 * b + 12].count(s) for b in range(5) for s in range(3)] == \
        quota.tolist() * 5
    assert whole[:12] != whole[12:24]  # each block in its own order
    for n in (0, 5, 12, 29, 60):
        assert counts_at(9, quota, n).tolist() == np.bincount(
            whole[:n], minlength=3).tolist(), n
    for start in (7, 24, 41):
        assert _choices(9, quota, start, 19) == whole[start:start + 19], start


def test_source_positions_follow_the_layouts_each_starting_its_choices_again():
    """2 hosts to 144 examples (72 choices each), then 3 (64 each, from choice 0): each
    source's examples consumed and its own layout history."""
    quota = quotas([3, 1])
    places, index = source_positions(4, quota, ((0, 2), (144, 3)), 336)
    first, then = counts_at(4, quota, 72), counts_at(4, quota, 64)
    assert index == 64
    assert places == [(int(2 * first[s] + 3 * then[s]), ((0, 2), (int(2 * first[s]), 3)))
                      for s in range(2)]
    assert source_positions(4, quota, ((0, 1),), 0) == ([(0, ((0, 1),)), (0, ((0, 1),))], 0)
