"""What an input pipeline already does, read from its stages: whether it reads files,
caches, parallelises its maps, prefetches or uses the tf.data service.

`tputrain diagnose` advises a knob only when the pipeline does not already turn it
(`tputrain.jobs.diagnose`): advice to cache a pipeline that serves its batches from RAM
misleads. The stages are the dataset objects upstream of the one given
(`Dataset._inputs()`, as `tputrain.data.external_state` walks them) and the
dataset ops inside their functions (files read inside an `interleave`).
"""

from __future__ import annotations

import dataclasses
import re
import weakref

import tensorflow as tf

from tputrain.data.stages import dataset_stages

# Datasets `in_memory_batches` returned: batches gathered from parsed examples in RAM.
_IN_MEMORY: "weakref.WeakSet[tf.data.Dataset]" = weakref.WeakSet()
_FILE_READERS = re.compile(r"tfrecord|textline|fixedlengthrecord", re.IGNORECASE)
_SEQUENTIAL_MAP = re.compile(r"^_?MapDataset$")


def mark_in_memory(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Marks `dataset` as batches served from examples held in RAM; returns it."""
    _IN_MEMORY.add(dataset)
    return dataset


@dataclasses.dataclass(frozen=True)
class PipelineFacts:
    """What one pipeline does. `cached`: a tf.data cache or tputrain's in-memory
    batches (`TFRecordInput.cache='memory'`); `maps_after_cache`: map stages that
    run on every batch downstream of that cache (all of them when nothing caches);
    `prefetch`: the fixed buffer of the last prefetch, None for AUTOTUNE or none."""

    reads_files: bool = False
    cached: bool = False
    in_memory: bool = False
    maps_after_cache: int = 0
    sequential_maps: int = 0
    prefetch: int | None = None
    service: bool = False
    threadpool_size: int | None = None


def _buffer(stage: tf.data.Dataset) -> int | None:
    size = getattr(stage, "_buffer_size", None)
    try:
        value = int(size) if size is not None else None
    except (TypeError, ValueError):
        return None
    return value if value is not None and value > 0 else None


def pipeline_facts(dataset: tf.data.Dataset) -> PipelineFacts:
    """Reads `dataset`'s stages (no element is produced)."""
    facts: dict = {"threadpool_size": dataset.options().threading.private_threadpool_size}
    maps, cached, prefetch_seen = 0, False, False
    for stage, nodes in dataset_stages(dataset):
        ops = [node.op for node in nodes]
        name = type(stage).__name__
        if stage in _IN_MEMORY or "Cache" in name:
            facts["in_memory"] = facts.get("in_memory", False) or stage in _IN_MEMORY
            cached = True
        if "Map" in name and "FlatMap" not in name and not cached:
            maps += 1
        facts["sequential_maps"] = facts.get("sequential_maps", 0) + bool(
            _SEQUENTIAL_MAP.match(name))
        if "Prefetch" in name and not prefetch_seen:
            prefetch_seen, facts["prefetch"] = True, _buffer(stage)
        if _FILE_READERS.search(name) or any(_FILE_READERS.search(op) for op in ops):
            facts["reads_files"] = True
        if "DataService" in name or any("DataService" in op for op in ops):
            facts["service"] = True
    return PipelineFacts(cached=cached, maps_after_cache=maps, **facts)
