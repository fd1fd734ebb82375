"""1 replica = 2 = 4 replicas (split CPU), with every optimizer option (issue: scale-out).

The same global batch on 1, 2 and 4 MirroredStrategy replicas must give the same
weights. Clipping is the case that broke: Keras 3 clips inside `apply`, before its
cross-replica sum, so each replica clipped its own partial gradient. The Trainer
now all-reduces first (`tputrain.distribution.allreduce`), and clipping sees the sum.
"""

from __future__ import annotations

import numpy as np
import pytest

from equivalence import OPTIONS, UNCLIPPED, train
from tiny import strategy_for

pytestmark = pytest.mark.same_worker("replica_equivalence")

@pytest.mark.start_early(0)
@pytest.mark.parametrize("replicas", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_replicas_equal_one_replica_with_every_option(one_replica, tmp_path, replicas):
    strategy = strategy_for(replicas)
    for option in OPTIONS:
        got = train(option, str(tmp_path / option), strategy)
        for g, want in zip(got, one_replica[option]):
            np.testing.assert_allclose(g, want, atol=1e-5, err_msg=f"{option}, {replicas} replicas")


@pytest.mark.parametrize("option", sorted(UNCLIPPED))
def test_clipping_fires(one_replica, option):
    """The equivalence above is about clipping only if clipping changed the update."""
    clipped, unclipped = one_replica[option], one_replica[UNCLIPPED[option]]
    assert max(np.abs(c - u).max() for c, u in zip(clipped, unclipped)) > 1e-3
