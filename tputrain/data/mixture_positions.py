"""A positional mixture's source choices and each source's position, from the
examples consumed alone (`MixtureInput(positional=True)`).

A seeded `sample_from_datasets` draws each source at random from a state that
only its iterator holds, so where each source stands after E examples is known
only by drawing them all again. Here the choices come in blocks of `QUOTA_BLOCK`
examples, each block holding every source's exact quota of the block (its weight's
share, largest remainders rounded up), in an order permuted by a stateless shuffle
of (seed, block). Then the examples source s gave in a host's first n choices are
`(n // B) * quota[s]` plus its count in the first `n % B` of one block: constant
time, whatever n.

Every host draws the same choice sequence (its sources' records differ: each host
reads its own windows), so every host of a layout has read as many records of
each source, which is what each source's ledger (`tputrain.data.ledger`) needs:
source s's examples consumed and layout history follow from the mixture's, layout
by layout (`source_positions`). The sequence restarts at each host-count change
(a batch change continues it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

QUOTA_BLOCK = 1024  # choices whose per-source counts are exact
_ENDLESS = 2**62  # blocks of choices: as good as for ever


def quotas(weights: Sequence[float], block: int = QUOTA_BLOCK) -> np.ndarray:
    """int64 [sources]: each source's choices in a block of `block`, summing to it
    (largest remainders); weights are normalised."""
    shares = np.asarray(weights, np.float64) / float(np.sum(weights)) * block
    counts = np.floor(shares).astype(np.int64)
    left = block - int(counts.sum())
    counts[np.argsort(-(shares - counts), kind="stable")[:left]] += 1
    return counts


def _block(seed: int, quota: np.ndarray, index: tf.Tensor) -> tf.Tensor:
    """Block `index`'s choices: every source its quota, in a stateless order."""
    choices = tf.repeat(tf.range(len(quota), dtype=tf.int64), tf.constant(quota))
    return tf.random.experimental.stateless_shuffle(
        choices, seed=tf.stack([tf.constant(seed, tf.int64), tf.cast(index, tf.int64)]))


def choices(seed: int, quota: np.ndarray, start: int) -> tf.data.Dataset:
    """The endless choice sequence (source indices) from choice `start` on."""
    block = int(quota.sum())
    return tf.data.Dataset.range(start // block, _ENDLESS).flat_map(
        lambda index: tf.data.Dataset.from_tensor_slices(_block(seed, quota, index))
    ).skip(start % block)


def counts_at(seed: int, quota: np.ndarray, n: int) -> np.ndarray:
    """int64 [sources]: each source's choices among the first `n`."""
    block = int(quota.sum())
    partial = _block(seed, quota, n // block).numpy()[:n % block]
    return (n // block) * quota + np.bincount(partial, minlength=len(quota))


def source_positions(seed: int, quota: np.ndarray, history: Sequence[tuple[int, ...]],
                     consumed: int) -> tuple[list[tuple[int, tuple[tuple[int, ...], ...]]], int]:
    """Each source's (examples consumed, layout history) once the mixture has
    consumed `consumed` examples over the layouts of `history` ((examples, hosts[,
    rule]) at each host count, the current one last; a rule goes to every source's
    entry), and the current layout's choice index (each host's choices since it
    took over)."""
    totals = np.zeros(len(quota), np.int64)
    histories: list[list[tuple[int, ...]]] = [[] for _ in quota]
    ends = [entry[0] for entry in history[1:]] + [consumed]
    index = 0
    for (start, hosts, *rule), end in zip(history, ends):
        for source, total in enumerate(totals):
            histories[source].append((int(total), hosts, *rule))
        index = (end - start) // hosts
        totals = totals + hosts * counts_at(seed, quota, index)
    return [(int(total), tuple(h)) for total, h in zip(totals, histories)], index
