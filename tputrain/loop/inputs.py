"""The host's input pipelines, and how each step's batches reach the replicas.

Two input modes (see `Trainer.input_mode`): "host" keeps a plain, checkpointed
iterator per host and places each step's per-replica batches itself (exact
resume); "distributed" uses `distribute_datasets_from_function` (device
prefetch) and resumes by skipping consumed batches.
"""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf
from absl import logging

from tputrain.core import tracing
from tputrain.data import InputContext
from tputrain.data.batching import check_static, label_key_of
from tputrain.data.external_state import checkpointable
from tputrain.checkpointing.integrity import InputLayoutError
from tputrain.data.mixture import mixture_sources, without_source_ids
from tputrain.checkpointing.input_layout import InputLayout, LayoutChange
from tputrain.loop.source_counts import SourceCounter, has_row_tags, without_source
from tputrain.options import INPUT_MODES as OPTION_INPUT_MODES
from tputrain.task import Task

INPUT_MODES = OPTION_INPUT_MODES  # Trainer.input_mode's values, defined with the options


def default_input_mode(strategy: tf.distribute.Strategy) -> tuple[str, str]:
    """("host" or "distributed", why): exact resume unless the strategy cannot have it."""
    hosts = getattr(strategy.extended, "num_hosts", 1)
    if isinstance(strategy, tf.distribute.TPUStrategy) and hosts > 1:
        return "distributed", (f"a {hosts}-host TPU slice is fed by a pipeline per host; "
                               "a resume re-reads and skips the consumed batches")
    return "host", ("exact resume: the data position (an iterator, or a positional "
                    "input's place) is checkpointed")


def replicas_per_pipeline(context: tf.distribute.InputContext) -> int:
    """Replicas one input pipeline feeds under `distribute_datasets_from_function`."""
    return context.num_replicas_in_sync // context.num_input_pipelines


def is_weighted(element_spec: Any) -> bool:
    """Eval batches of `(features, labels, weights)`: padded, weight 0 on padding."""
    return isinstance(element_spec, tuple) and len(element_spec) == 3


def with_weights(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`(features, labels)` batches as `(features, labels, ones)`: weighted, so that
    a host with fewer eval batches can pad with zero-weight ones (see `padded`)."""
    if is_weighted(dataset.element_spec):
        return dataset

    def add_weights(features, labels):
        rows = tf.shape(tf.nest.flatten(features)[0])[0]
        return features, labels, tf.ones([rows], tf.float32)
    return dataset.map(add_weights)


def with_class_weights(dataset: tf.data.Dataset,
                       class_weight: Mapping[int, float]) -> tf.data.Dataset:
    """`(features, labels)` batches -> `(features, labels, weight of each label's class)`,
    Keras `fit`'s `class_weight`: labels are class ids, or one-hot (last axis > 1, its
    argmax); a class not in `class_weight` (or out of its range) weighs 1."""
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], tf.TensorSpec)):
        raise ValueError("Trainer.class_weight needs train batches of (features, labels) "
                         "with one labels tensor (it makes the sample weights: a dataset that "
                         "yields its own sample weights cannot have class weights too), got "
                         f"{spec}")
    table = tf.constant([class_weight.get(c, 1.0) for c in range(max(class_weight) + 1)],
                        tf.float32)

    def add_weights(features, labels):
        if labels.shape.rank and labels.shape.rank >= 2 and labels.shape[-1] != 1:
            classes = tf.argmax(labels, axis=-1, output_type=tf.int32)
        else:
            classes = tf.cast(tf.round(tf.cast(tf.reshape(labels, [-1]), tf.float32)),
                              tf.int32)
        known = (classes >= 0) & (classes < table.shape[0])
        weights = tf.gather(table, tf.clip_by_value(classes, 0, table.shape[0] - 1))
        return features, labels, tf.where(known, weights, 1.0)
    return dataset.map(add_weights)


def zeros_of(structure: Any) -> Any:
    """Zeros shaped like each TensorSpec (or tensor) of a nest: a stand-in batch or
    log that is traced or passed but never trained on."""
    return tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), structure)


def padded(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """A weighted eval dataset followed by endless all-zero, zero-weight batches
    (to fill the last step's replicas); any other dataset unchanged."""
    if not is_weighted(dataset.element_spec):
        return dataset
    return dataset.concatenate(tf.data.Dataset.from_tensors(
        zeros_of(dataset.element_spec)).repeat())




class Inputs:
    """Builds this host's datasets and iterators, and distributes their batches."""

    def __init__(self, task: Task, strategy: tf.distribute.Strategy, plan: Any):
        """`plan`: the run's `tputrain.runtime.plan.RunPlan` (batch split, hosts, input mode)."""
        self.task = task
        self.strategy = strategy
        self.plan = plan  # read, never copied: the batch split, hosts, input mode
        # A mixture's train split: the step strips and counts its sources' examples.
        self.source_counter: SourceCounter | None = None
        # The train input is a function of its position (`InputContext.positional`):
        # host mode builds it there on a resume (`positioned_iterator`), saving none.
        self.positional_train = False
        # Each split's builder `label_key` (None if unknown): what a label error names.
        self.label_keys: dict[str, str | None] = {}
        # Inputs first: bad data fails before anything is built or written.
        self._train_dataset = self.build_dataset("train")
        # The eval sets (`TrainerOptions.eval_splits`), in order: name -> dataset.
        self.eval_datasets = {name: self.build_dataset(name)
                              for name in plan.options.eval_splits}

    @property
    def train_dataset(self) -> tf.data.Dataset:
        """This host's train split: per-replica batches (micro-batches stacked)."""
        return self._train_dataset

    @property
    def eval_dataset(self) -> tf.data.Dataset:
        """The first eval set's dataset (the only one by default, "eval")."""
        return next(iter(self.eval_datasets.values()))

    def dataset(self, split: str) -> tf.data.Dataset:
        """This host's dataset of `split`: "train" or an eval set's name."""
        return self._train_dataset if split == "train" else self.eval_datasets[split]

    def input_context(self, tf_context: tf.distribute.InputContext | None = None,
                       global_batch_size: int | None = None) -> InputContext:
        global_batch_size = global_batch_size or self.plan.batch.global_batch_size
        if tf_context is not None:
            return InputContext.from_tf(tf_context, global_batch_size)
        return InputContext(num_input_pipelines=self.plan.batch.num_hosts,
                            input_pipeline_id=self.plan.batch.host_id,
                            num_replicas_in_sync=self.strategy.num_replicas_in_sync,
                            global_batch_size=global_batch_size)

    def layout(self) -> InputLayout:
        """How a step's global batch is split: what a checkpointed iterator fits."""
        batch = self.plan.batch
        return InputLayout(replicas=batch.replicas, hosts=batch.num_hosts,
                           global_batch=batch.global_batch_size,
                           accumulation=batch.accumulation_steps,
                           fetch="direct" if self.direct_fetch else "stacked")

    @property
    def direct_fetch(self) -> bool:
        """One local replica, one step a fetch: the train iterator reads the task's own
        batches, with nothing stacked (see `fetch_groups`)."""
        return self.plan.batch.local_replicas == 1 and self.plan.steps_per_fetch == 1

    def advance(self, iterator: Any, steps: int) -> int:
        """Reads a `fetch_groups` iterator past `steps` steps' batches (whole fetches),
        in one compiled loop; returns the steps read (fewer if a finite input ended).

        For a resume whose saved iterator does not fit (`read_past`): the fresh
        iterator keeps the pipeline's structure, which later checkpoints of it need
        (a `skip` op would make them unreadable by the next plain pipeline).
        """
        @tf.function
        def read(count: tf.Tensor) -> tf.Tensor:
            def body(done, more):
                more = iterator.get_next_as_optional().has_value()
                return done + tf.cast(more, tf.int64), more
            done, _ = tf.while_loop(lambda done, more: tf.logical_and(more, done < count),
                                    body, (tf.constant(0, tf.int64), tf.constant(True)))
            return done
        fetches = tf.constant(steps // self.plan.steps_per_fetch, tf.int64)
        return int(read(fetches)) * self.plan.steps_per_fetch

    def read_past(self, iterator: Any, change: LayoutChange) -> int:
        """Reads a fresh train iterator past the examples a checkpoint written under
        another layout consumed, in whole batches of this run's global batch (each
        host its own share); returns the steps read (`advance`)."""
        steps_per_fetch = self.plan.steps_per_fetch
        if change.resume_steps % steps_per_fetch:
            raise InputLayoutError(
                f"checkpoint {change.path} consumed {change.consumed} examples, "
                f"{change.resume_steps} batches of this run's {self.plan.batch.global_batch_size}: "
                f"not a multiple of Trainer.steps_per_fetch={steps_per_fetch}, in which the "
                "input is read: resume once with steps_per_fetch=1")
        return self.advance(iterator, change.resume_steps)

    def input_batch(self, split: str) -> int:
        """The global batch the task's inputs are built with: a micro-batch when training
        with gradient accumulation."""
        batch = self.plan.batch
        return batch.global_micro_batch if split == "train" else batch.global_batch_size

    def group_micro_batches(self, dataset: tf.data.Dataset, split: str) -> tf.data.Dataset:
        """With accumulation, one element holds a replica's N micro-batches stacked on a
        new leading axis, so one step still takes one element per replica."""
        accumulation = self.plan.batch.accumulation_steps
        if split != "train" or accumulation == 1:
            return dataset
        return dataset.batch(accumulation, drop_remainder=True)

    def micro_batch_spec(self) -> Any:
        """Element spec of one per-replica (micro-)batch of the train split."""
        spec = self._train_dataset.element_spec
        if self.source_counter is not None:  # the model's features hold no source id
            spec = without_source(spec, self.source_counter.key)
        if self.plan.batch.accumulation_steps == 1:
            return spec
        return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec)

    def saved_state(self, iterator: Any) -> dict[str, Any]:
        """What each host checkpoints of its input: the train `iterator` in host mode,
        unless the input is positional (built at its position on a resume: no state)."""
        saved = self.plan.input_mode == "host" and not self.positional_train
        return {"iterator": iterator} if saved else {}

    def positioned_iterator(self, layout: InputLayout, step: int) -> Any:
        """A positional train input built at `step` of `layout` (the examples consumed,
        across its host history), as a fresh `fetch_groups` iterator: what host mode
        resumes from, on any layout, instead of a saved iterator. No batch before the
        position is read (`tputrain.data.ledger`)."""
        consumed = layout.input_steps(step) * layout.global_batch
        self._train_dataset = self.build_dataset("train", consumed, layout.history(),
                                                 self.row_places())
        return iter(self.fetch_groups(self._train_dataset))

    def row_places(self) -> tuple[tuple[int, int], ...]:
        """Each host's place in a positional input's packed rows, from the row sums of
        the training so far (`SourceCounter.row_places`); none for other inputs."""
        return self.source_counter.row_places() if self.source_counter else ()

    def build_dataset(self, split: str, examples_consumed: int = 0,
                      layout_history: tuple[tuple[int, ...], ...] = (),
                      row_places: tuple[tuple[int, int], ...] = ()) -> tf.data.Dataset:
        """Builds this host's dataset of per-replica batches (a train split that can,
        at `examples_consumed` across `layout_history`, or packed rows at
        `row_places`) and checks its shapes."""
        batch = self.input_batch(split)
        context = InputContext.from_tf(self.input_context(global_batch_size=batch),
                                       examples_consumed=examples_consumed,
                                       layout_history=layout_history, row_places=row_places)
        dataset = self.task.build_inputs(split, context)
        if split == "train":
            self.positional_train = context.positional
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"Task.build_inputs({split!r}) must return a tf.data.Dataset, "
                            f"got {type(dataset).__name__}")
        self.label_keys[split] = label_key_of(dataset)
        dataset = self.sources_of(dataset, split)
        check_static(f"{split} input", dataset.element_spec,
                     "pad variable-length features to a fixed length",
                     self.plan.batch.micro_batch if split == "train"
                     else self.plan.batch.per_replica, dataset)
        dataset = self.weighted_by_class(dataset, split)
        if split == "train" and self.saved_state(None):  # its iterator is checkpointed
            dataset = checkpointable(dataset, split)
        return self.group_micro_batches(dataset, split)

    def sources_of(self, dataset: tf.data.Dataset, split: str) -> tf.data.Dataset:
        """A mixture's train split, or a positional input's packed rows, gets a
        `source_counter` (the step strips and counts the source ids and row tags); a
        mixture's eval split, the source id stripped from the features (nothing counts
        there). Any other dataset is unchanged."""
        sources = mixture_sources(dataset)
        rows = split == "train" and has_row_tags(dataset.element_spec)
        if sources is None and not rows:
            return dataset
        if split == "train":  # a rebuilt input keeps the counter (its counts are saved)
            self.source_counter = self.source_counter or SourceCounter(
                sources, self.plan.batch.num_hosts if rows else 0)
            return dataset
        return without_source_ids(dataset)

    def weighted_by_class(self, dataset: tf.data.Dataset, split: str) -> tf.data.Dataset:
        """The train split's `(features, labels)` as `(features, labels, class weights)`
        with `class_weight` (as Keras `fit` does); any other dataset unchanged."""
        class_weight = self.plan.options.class_weight
        if split != "train" or class_weight is None:
            return dataset
        return with_class_weights(dataset, class_weight)

    def distributed_iterator(self, split: str, skip_steps: int = 0,
                             layout_history: tuple[tuple[int, ...], ...] = ()):
        """distribute_datasets_from_function, past `skip_steps` steps of data: a
        positional input starts there (`InputContext.examples_consumed`; across the
        host counts of `layout_history`, `InputLayout.history`), any other is read
        past them (`Dataset.skip`, linear in the steps)."""
        consumed = skip_steps * self.plan.batch.global_batch_size
        places = self.row_places() if skip_steps else ()

        def dataset_fn(tf_context):
            context = InputContext.from_tf(tf_context, self.input_batch(split),
                                           examples_consumed=consumed,
                                           layout_history=layout_history,
                                           row_places=places if split == "train" else ())
            dataset = self.task.build_inputs(split, context)
            skip = 0 if context.position_honoured else skip_steps
            if skip and tf_context.input_pipeline_id == 0:
                logging.info("tputrain: the %s input is not positional: it re-reads the %d "
                             "steps' batches consumed to reach them (TFRecordInput("
                             "positional=True) starts there at once)", split, skip)
            if split != "train":
                dataset = without_source_ids(dataset)
            dataset = self.group_micro_batches(self.weighted_by_class(dataset, split), split)
            # Each pipeline feeds its replicas one batch each per step (a TPU pod has
            # one client but a pipeline per host: not the plan's local replicas).
            replicas = replicas_per_pipeline(tf_context)
            return dataset.skip(skip * replicas) if skip else dataset
        return iter(self.strategy.distribute_datasets_from_function(dataset_fn))

    def stand_in_iterator(self, batch: Any = None) -> Any:
        """An endless train iterator of one stand-in batch (`batch`, an element of the
        train split read at start-up, else zeros shaped as one), in the train
        iterator's structure: what the plan trial times plans on. It reads none of the
        user's data: every iterator of a dataset that reshuffles each iteration draws
        its next shuffle, and a Python source gives up its elements."""
        value = zeros_of(self.train_dataset.element_spec) if batch is None else batch
        stand_in = tf.data.Dataset.from_tensors(value).repeat()
        if self.plan.input_mode == "distributed":
            return iter(self.strategy.distribute_datasets_from_function(lambda _: stand_in))
        return iter(self.fetch_groups(stand_in))

    @tracing.graph_helper
    def next(self, iterator) -> tuple[tf.Tensor, Any]:
        """In a tf.function: (has_value, distributed batch) for one step.

        Host mode takes one per-replica batch for each local replica from the plain
        iterator and places them with `experimental_distribute_values_from_function`.
        """
        if self.plan.input_mode == "distributed":
            optional = iterator.get_next_as_optional()
            return optional.has_value(), optional
        local = self.plan.batch.local_replicas
        optionals = [iterator.get_next_as_optional() for _ in range(local)]
        has_value = tf.reduce_all(tf.stack([o.has_value() for o in optionals]))
        return has_value, optionals

    def fetch_groups(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """One element holds the per-replica batches of `steps_per_fetch` steps:
        shape `[steps_per_fetch, local_replicas, per-replica batch, ...]`.

        The host's prefetch, owned here: each step's per-replica batches are
        stacked and buffered in the background (`steps_per_fetch` steps deep), so a
        fetch only takes ready batches, as the device prefetch of
        `distribute_datasets_from_function` would (benchmarks/resume.py). The buffer
        holds per-step groups whatever `steps_per_fetch` is, and the outer batch op
        saves only its input's position, so checkpoints of the iterator stay valid
        when steps_per_fetch changes.

        With one local replica and one step a fetch (`direct_fetch`) the dataset is
        read as the task built it: the two stacking copies cost 1.3% of the CPU time
        of benchmarks/train_loop.py's MLP step (21 paired rounds in one process), and
        the task's own prefetch already buffers. Its checkpoints then hold another structure, which
        the input layout records (`InputLayout.fetch`).
        """
        if self.direct_fetch:
            return dataset
        fetch = self.plan.steps_per_fetch
        per_step = dataset.batch(self.plan.batch.local_replicas, drop_remainder=True)
        grouped = per_step.prefetch(fetch).batch(fetch, drop_remainder=True)
        # tf.data would otherwise inject a prefetch after the outer batch, and a
        # checkpoint would then hold whole groups of the old size: resuming with
        # another steps_per_fetch would fail on their shape.
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        return grouped.with_options(options)

    @tracing.graph_helper
    def distribute_from_group(self, group: Any, j: tf.Tensor) -> Any:
        """Step `j` of a fetched group: replica r takes `group[j, r]`, the order one
        fetch per step would give. A direct fetch's group is the step's batch."""
        if self.direct_fetch:
            return self.strategy.experimental_distribute_values_from_function(
                lambda ctx: group)
        local = self.plan.batch.local_replicas
        batches = [tf.nest.map_structure(lambda t, r=r: t[j, r], group) for r in range(local)]
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: batches[ctx.replica_id_in_sync_group % local])

    @tracing.graph_helper
    def distribute(self, value) -> Any:
        if self.plan.input_mode == "distributed":
            return value.get_value()
        batches = [o.get_value() for o in value]
        local = self.plan.batch.local_replicas
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: batches[ctx.replica_id_in_sync_group % local])
