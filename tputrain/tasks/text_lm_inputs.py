"""The text LM's input: the standard library's source, as bytes, packed to static rows.

Per file (one variable-length record): the model reads `tokens` (BOS, then the
file's bytes but the last) and predicts `targets` (the file's bytes, then EOS).
Files are shuffled (train) and packed several to a row of `sequence_length`
(`tputrain.data.pack_sequences`: long files are split, nothing is dropped), then
batched: `({tokens, segment_ids, positions}, targets, loss_weights)`. Packing
is a tf.data transformation before batching, so the host iterator's checkpoint
holds the partly filled row and a resume continues bitwise.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf

from tputrain.core.cache_dir import cache_root
from tputrain.data import InputContext
from tputrain.data.packing import LOSS_WEIGHTS, POSITIONS, SEGMENT_IDS, pack_sequences
from tputrain.data.text_corpus import BOS_ID, HELDOUT, TRAIN, write_text_corpus
from tputrain.data.tfrecord import TFRecordInput


def corpus_directory(corpus_dir: str | None, max_files: int | None) -> str:
    """Where the corpus is written once and reused (per file count): tputrain's cache
    folder, as for the digits (`TPUTRAIN_CACHE_DIR`, else ~/.cache/tputrain)."""
    if corpus_dir:
        return corpus_dir
    return os.path.join(cache_root(), f"stdlib-text-{max_files or 'all'}")


def shift_for_lm(example: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """One file -> `tokens` (BOS + bytes[:-1]) and `targets` (bytes, EOS included)."""
    targets = tf.cast(example["tokens"], tf.int32)
    tokens = tf.concat([tf.constant([BOS_ID], tf.int32), targets[:-1]], axis=0)
    return {"tokens": tokens, "targets": targets}


def packed_text(task: Any, split: str, input_context: InputContext) -> tf.data.Dataset:
    """The packed, batched split `split` ("train" or "eval": the held-out files)."""
    corpus = write_text_corpus(corpus_directory(task.corpus_dir, task.max_files),
                               max_files=task.max_files)
    training = split == "train"
    length = task.sequence_length

    def to_static(examples: tf.data.Dataset) -> tf.data.Dataset:
        return pack_sequences(examples.map(shift_for_lm), length, keys=["tokens", "targets"])

    batches = TFRecordInput(manifest=corpus.train if training else corpus.heldout,
                            shuffle=training, shuffle_buffer=task.shuffle_buffer,
                            seed=task.seed, repeat=training, to_static=to_static)(input_context)

    def split_row(batch: dict[str, tf.Tensor]):
        features = {name: batch[name] for name in ("tokens", SEGMENT_IDS, POSITIONS)}
        return features, batch["targets"], batch[LOSS_WEIGHTS]
    return batches.map(split_row)


__all__ = ["HELDOUT", "TRAIN", "corpus_directory", "packed_text", "shift_for_lm"]
