"""Reading a W&B run's local files (`<dir>/wandb/*-<id>/run-<id>.wandb`), which W&B
writes in offline and online mode alike: what a resumed `WandbTracker` already
logged, and a test's read-back of an offline run.

A `.wandb` file is a 7-byte header (`:W&B`, a magic number, a version) and then
LevelDB's log format: 32 KiB blocks of records, each a 7-byte header (CRC-32, a
2-byte little-endian length, a type: 1 whole, 2 first, 3 middle, 4 last part) and
its bytes, here a serialized `wandb_internal_pb2.Record`. A record cut short by a
kill ends the read.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

BLOCK = 32768
RECORD_HEADER = 7
FILE_HEADER = 7
MAGIC = b":W&B"


def raw_records(path: str) -> Iterator[bytes]:
    """Each record's bytes, in order."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != MAGIC:
        raise ValueError(f"{path} is not a W&B run file")
    position, pending = FILE_HEADER, b""
    while position + RECORD_HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < RECORD_HEADER:  # a block's zero-padded tail
            position += left
            continue
        length = int.from_bytes(data[position + 4:position + 6], "little")
        kind, start = data[position + 6], position + RECORD_HEADER
        if kind == 0 or start + length > len(data):  # padding, or cut short
            break
        chunk, position = data[start:start + length], start + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def run_files(directory: str, run_id: str) -> list[str]:
    """The run's `.wandb` files under `directory` (one per process that logged it)."""
    return sorted(glob.glob(os.path.join(directory, "wandb", f"*-{run_id}", f"run-{run_id}.wandb")))


def history(directory: str, run_id: str) -> list[tuple[int, dict[str, Any]]]:
    """Every history row (step, {key: value}) the run's files hold, in file order."""
    from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
    rows = []
    for path in run_files(directory, run_id):
        for data in raw_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            values = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                      for item in record.history.item if not
                      (item.key or "/".join(item.nested_key)).startswith("_")}
            rows.append((record.history.step.num, values))
    return rows


def logged_steps(directory: str, run_id: str) -> dict[str, int]:
    """The last step of each metric the run's files hold."""
    steps: dict[str, int] = {}
    for step, values in history(directory, run_id):
        for key in values:
            steps[key] = max(step, steps.get(key, -1))
    return steps
