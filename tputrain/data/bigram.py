"""A bigram baseline for byte-level corpora: the bits per byte a model must beat.

A language model on bytes earns its compute only if it predicts better than
counting which byte follows which. `bigram_bits_per_byte` fits those counts on
a training split (add-`smoothing` for unseen pairs) and returns the held-out
cross-entropy in bits per predicted token: every token of a record after its
first, the end-of-file id included, the positions a next-token model trained
on the same records predicts (packing into rows shorter than a file leaves
each piece's first token unpredicted, a small difference).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tputrain.data.manifest import read_manifest


def _records(manifest_path: str, key: str) -> list[np.ndarray]:
    manifest = read_manifest(manifest_path)
    spec = {key: manifest.features[key]}
    dataset = tf.data.TFRecordDataset(manifest.files(),
                                      compression_type=manifest.compression_type or "")
    parsed = dataset.batch(256).map(lambda chunk: tf.io.parse_example(chunk, spec)[key])
    return [row for batch in parsed.as_numpy_iterator() for row in batch]


def _pairs(rows: list[np.ndarray], vocab_size: int) -> np.ndarray:
    """Counts of (previous, next) token pairs within records, as a [vocab, vocab] matrix."""
    index = np.concatenate([r[:-1] * vocab_size + r[1:] for r in rows if len(r) > 1] or
                           [np.zeros(0, np.int64)])
    return np.bincount(index, minlength=vocab_size ** 2).reshape(vocab_size, vocab_size)


def bigram_bits_per_byte(train_manifest: str, heldout_manifest: str, *, key: str = "tokens",
                         vocab_size: int | None = None, smoothing: float = 0.1) -> float:
    """Held-out bits per predicted token of a bigram model fitted on the training split.

    Args:
        train_manifest, heldout_manifest: manifests of variable-length token
            records (`write_text_corpus` writes both).
        key: the token feature.
        vocab_size: ids are in [0, vocab_size); None: the corpus's
            (`tputrain.data.text_corpus.VOCAB_SIZE`).
        smoothing: added to every pair's count, so unseen pairs cost finite bits.
    """
    if vocab_size is None:
        from tputrain.data.text_corpus import VOCAB_SIZE  # pylint: disable=import-outside-toplevel
        vocab_size = VOCAB_SIZE
    if not smoothing > 0:
        raise ValueError(f"smoothing must be > 0 (unseen pairs would cost infinite bits), "
                         f"got {smoothing!r}")
    counts = _pairs(_records(train_manifest, key), vocab_size) + smoothing
    log_p = np.log2(counts) - np.log2(counts.sum(axis=1, keepdims=True))
    held = _pairs(_records(heldout_manifest, key), vocab_size)
    if held.sum() == 0:
        raise ValueError(f"{heldout_manifest} holds no record of two or more tokens to predict")
    return float(-(held * log_p).sum() / held.sum())
