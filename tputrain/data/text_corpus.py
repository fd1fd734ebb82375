"""A real-text corpus every Python installation has: the standard library's own source.

Sequence models need real text to show they learn, and tests and examples
must not download anything. The standard library's `.py` files are tens of MB
of real, varied text on every machine with Python. `write_text_corpus` turns
them into byte-level tokens (ids 0..255 are the bytes; `EOS_ID` ends each
file, `BOS_ID` is reserved for models that start with one) stored as
variable-length TFRecords, one record a file, split into train and held-out
sets by file, so no file's text is in both. It writes once: a later call with
the same settings reuses the directory. The write goes to a hidden temp
directory beside the target, renamed into place only when complete, so an
interrupted write leaves nothing a later call could mistake for a corpus.

The files depend on the Python version (recorded in the corpus), so figures
measured on it are comparable only within one version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sysconfig
import zlib
from typing import Iterator

import numpy as np
import tensorflow as tf

from tputrain.checkpointing.atomic import atomic_path
from tputrain.data.manifest import manifest_path
from tputrain.data.writer import write_tfrecords

NUM_BYTES = 256
EOS_ID = 256  # ends every file
BOS_ID = 257  # reserved: never written, for models that start a sequence with it
VOCAB_SIZE = 258
TRAIN, HELDOUT = "train", "heldout"
_INFO = "corpus.json"
_FORMAT = 1
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
_MAX_SHARDS = 4  # enough for a few hosts to read whole files each


def stdlib_root() -> str:
    """The standard library's directory (where `os.py` is)."""
    return sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)


def stdlib_files(max_files: int | None = None) -> list[str]:
    """The standard library's `.py` files (without test suites and site-packages), sorted.

    `max_files` picks that many spread evenly over the sorted list (not the
    first ones, which would all come from a few packages); None takes all.
    """
    root = stdlib_root()
    found = []
    for directory, folders, names in os.walk(root):
        folders[:] = sorted(f for f in folders if f not in _SKIP_DIRS)
        found.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    found.sort(key=lambda path: os.path.relpath(path, root))
    if max_files is not None:
        if max_files < 2:
            raise ValueError(f"max_files must be >= 2 (one file a split at least), got {max_files}")
        found = [found[i * len(found) // max_files] for i in range(min(max_files, len(found)))]
    return found


def encode_bytes(data: bytes) -> np.ndarray:
    """A file's byte-level tokens: its bytes, then `EOS_ID` (int64)."""
    return np.append(np.frombuffer(data, np.uint8).astype(np.int64), EOS_ID)


def split_by_file(files: list[str], heldout_fraction: float) -> dict[str, list[str]]:
    """Train and held-out files: the held-out ones are those first by a hash of their
    path relative to the standard library, so a file keeps its split across subsets."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    root = stdlib_root()
    by_hash = sorted(files, key=lambda p: (zlib.crc32(os.path.relpath(p, root).encode()), p))
    count = min(len(files) - 1, max(1, round(heldout_fraction * len(files))))
    heldout = set(by_hash[:count])
    return {TRAIN: [p for p in files if p not in heldout], HELDOUT: sorted(heldout)}


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """A written corpus: its split manifests (read them with `TFRecordInput(manifest=...)`)."""

    directory: str
    train: str
    heldout: str
    num_files: dict[str, int]
    num_bytes: dict[str, int]
    python: str
    vocab_size: int = VOCAB_SIZE


def _examples(paths: list[str]) -> Iterator[dict[str, np.ndarray]]:
    for path in paths:
        with open(path, "rb") as f:
            yield {"tokens": encode_bytes(f.read())}


def _corpus(directory: str, info: dict) -> TextCorpus:
    return TextCorpus(directory, manifest_path(os.path.join(directory, TRAIN)),
                      manifest_path(os.path.join(directory, HELDOUT)), info["num_files"],
                      info["num_bytes"], info["python"])


def _existing(directory: str, settings: dict) -> TextCorpus | None:
    """The corpus already in `directory`, if it was written with these settings."""
    info_path = os.path.join(directory, _INFO)
    if not os.path.exists(info_path):
        if os.path.exists(directory):
            raise ValueError(f"{directory} exists but holds no text corpus (no {_INFO}): remove "
                             "it or use another directory")
        return None
    with open(info_path) as f:
        info = json.load(f)
    if info.get("settings") != settings:
        written = ", ".join(f"{k}={v}" for k, v in info.get("settings", {}).items())
        raise ValueError(f"the corpus in {directory} was written with {written}: use another "
                         "directory for other settings (or remove it)")
    return _corpus(directory, info)


def _write(temp: str, files: dict[str, list[str]], settings: dict) -> dict:
    """Writes both splits and the info file into `temp`; returns the info."""
    num_bytes = {}
    for split, paths in files.items():
        write_tfrecords(_examples(paths), os.path.join(temp, split),
                        num_shards=min(_MAX_SHARDS, len(paths)), var_len=["tokens"])
        num_bytes[split] = sum(os.path.getsize(p) for p in paths)
    info = {"format": _FORMAT, "settings": settings, "python": platform.python_version(),
            "vocab_size": VOCAB_SIZE, "eos_id": EOS_ID, "bos_id": BOS_ID,
            "num_files": {split: len(paths) for split, paths in files.items()},
            "num_bytes": num_bytes,
            "files": {split: [os.path.relpath(p, stdlib_root()) for p in paths]
                      for split, paths in files.items()}}
    with open(os.path.join(temp, _INFO), "w") as f:
        json.dump(info, f, indent=1)
    return info


def write_text_corpus(directory: str, *, max_files: int | None = None,
                      heldout_fraction: float = 0.05) -> TextCorpus:
    """Writes (once) the standard library's source as a byte-level corpus; returns it.

    Args:
        directory: a local directory for the corpus; reused when it already
            holds one written with the same settings (an error otherwise).
        max_files: that many files spread over the sorted list (`stdlib_files`);
            None: all of them.
        heldout_fraction: the share of files in the held-out split (at least one).

    Each split is `{directory}/{train,heldout}` with its manifest: a
    variable-length int64 feature `tokens` a file (see the module).
    """
    settings = {"max_files": max_files, "heldout_fraction": heldout_fraction,
                "python": platform.python_version(), "format": _FORMAT}
    directory = os.path.abspath(directory)
    found = _existing(directory, settings)
    if found is not None:
        return found
    files = split_by_file(stdlib_files(max_files), heldout_fraction)
    try:
        with atomic_path(directory, overwrite=False, hidden=True) as temp:
            info = _write(temp, files, settings)
    except (OSError, tf.errors.OpError):  # another process finished first: keep its corpus
        found = _existing(directory, settings)
        if found is None:
            raise
        return found
    return _corpus(directory, info)
