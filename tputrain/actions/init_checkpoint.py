"""Fine-tuning: start a new run from another run's weights (`InitCheckpoint`).

The source may be a tputrain model_dir (its newest readable checkpoint), a plain
TF checkpoint (a prefix, or a folder of them) of an object with a `model`, or a
Keras `.weights.h5`. Variables are matched by name, never by position, so a new
head or a reordered model takes exactly the backbone it shares with the source:

* TF checkpoints store each variable's name beside its value (the object graph's
  `full_name`, which for Keras 3 is `variable.path`, e.g. "backbone_1/kernel").
  Keys such as `optimizer/_trainable_variables/0/...` depend on how the object
  graph was walked, so they are not used to match.
* `.weights.h5` files name each layer (the `name` attribute of its `vars`
  group) and number its variables in the layer's own save order; a model
  variable is matched by its layer's name and that number.

It is loaded only when the run restored nothing (step 0 and no checkpoint in
model_dir): a resumed fine-tuning run continues from its own checkpoints. The
step, optimizer iterations and learning rate are never taken (fine-tuning starts
at step 0 with the config's schedule); optimizer slots only with `optimizer=True`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tputrain.actions import Action
from tputrain.checkpointing.files import list_checkpoints
from tputrain.checkpointing.integrity import GRAPH_KEY, object_graph
from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.checkpointing.model_variables import ROOT as MODEL_VARIABLES, model_paths
from tputrain.checkpointing.seeds import seed_generator_states
from tputrain.core.checks import check_bool
from tputrain.runtime.context import ActionContext

# Root objects of a tputrain checkpoint that are not weights.
_NOT_WEIGHTS = ("optimizer", "step", "save_counter", "iterator", "seeds", "nonfinite_steps")
_INDEX = re.compile(r"ckpt-(\d+)\.index$")
_SHOW = 12  # names listed in a log line


class Entry(NamedTuple):
    """One saved tensor: its shape and how to read it."""

    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


class Source(NamedTuple):
    """What a checkpoint offers: model weights by name, optimizer slots by name
    (without the optimizer's own prefix), and what kind of file it is; for a
    tputrain checkpoint also its model weights by their place in the model
    (`placed`: object-graph path from the model's roots -> (entry, its name if unambiguous))."""

    path: str
    kind: str  # "checkpoint" or "h5"
    weights: dict[str, Entry]
    slots: dict[str, Entry]
    ambiguous: frozenset[str]
    placed: Mapping[str, tuple[Entry, str | None]] = {}


class Report(NamedTuple):
    """What a load did: loaded (model name, checkpoint name) pairs, model variables
    left at their initial values, and checkpoint weights nothing took."""

    path: str
    loaded: list[tuple[str, str]]
    excluded: list[str]  # outside `include`
    missing: list[str]  # in `include`, not in the checkpoint
    unused: list[str]
    slots_loaded: int
    slots_missing: list[str]


# ------------------------------------------------------------ finding the files


def resolve_path(path: str) -> str:
    """The checkpoint prefix or .h5 file `path` stands for: a tputrain model_dir
    (its checkpoints/), a folder of checkpoints, a prefix, or a .h5 file."""
    if path.endswith(".h5"):
        if not tf.io.gfile.exists(path):
            raise FileNotFoundError(f"InitCheckpoint.path: {path} does not exist")
        return path
    if tf.io.gfile.exists(f"{path}.index"):
        return path
    if tf.io.gfile.isdir(path):
        inner = RunDirectory(path).checkpoints  # a model_dir
        folder = inner if tf.io.gfile.isdir(inner) else path
        found = _checkpoints_in(folder)
        if found:
            return found[-1]
        raise FileNotFoundError(f"InitCheckpoint.path: {path} holds no checkpoint (looked for "
                                f"ckpt-<step>.index in {folder})")
    raise FileNotFoundError(
        f"InitCheckpoint.path: {path} is neither a tputrain model_dir, a folder of "
        f"checkpoints, a checkpoint prefix (no file {path}.index) nor a .weights.h5 file")


def _checkpoints_in(folder: str) -> list[str]:
    """Readable-looking checkpoints of `folder`, oldest first: the listed ones (state
    file), else every `*.index` (a `best/` folder, a folder copied without it)."""
    listed = [p for p in list_checkpoints(folder).paths if tf.io.gfile.exists(f"{p}.index")]
    if listed:
        return listed
    indexes = [name for name in tf.io.gfile.listdir(folder) if name.endswith(".index")]
    def step(name: str) -> tuple[int, str]:
        found = _INDEX.search(name)
        return (int(found.group(1)) if found else -1, name)

    return [os.path.join(folder, name[:-len(".index")]) for name in sorted(indexes, key=step)]


# ------------------------------------------------------------ reading a TF checkpoint


def read_tf_checkpoint(prefix: str) -> Source:
    """Names every model weight and optimizer slot of a TF checkpoint by the name
    saved with it; a checkpoint without an object graph (TF1) by its keys."""
    try:
        reader = tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError) as error:
        raise ValueError(f"InitCheckpoint: cannot read the checkpoint {prefix} ({error}): point "
                         "InitCheckpoint.path at another one (an older ckpt-<step>)") from None
    shapes = reader.get_variable_to_shape_map()

    def entry(key: str) -> Entry:
        return Entry(tuple(shapes[key]), lambda: reader.get_tensor(key))

    if GRAPH_KEY not in shapes:
        return Source(prefix, "checkpoint", {k: entry(k) for k in shapes}, {}, frozenset())
    graph = object_graph(reader)
    roots = {child.local_name: child.node_id for child in graph.nodes[0].children}
    # The model, and the weights Keras leaves out of its object graph (model_variables.py).
    model_roots = [name for name in ("model", MODEL_VARIABLES) if name in roots]
    placed_nodes = _paths(graph, [(name, roots[name]) for name in model_roots])
    if "model" in roots:
        model_nodes = set(placed_nodes.values())
    else:  # a checkpoint of some other object: every weight that is not bookkeeping
        model_nodes = _reachable(graph, [i for n, i in roots.items() if n not in _NOT_WEIGHTS])
    optimizer_nodes = set()
    if "optimizer" in roots:  # its slots; the weights it also tracks are the model's
        optimizer_nodes = _reachable(graph, [roots["optimizer"]]) - model_nodes
    weights, ambiguous = _named(graph, model_nodes, entry, lambda name: name)
    slots, _ = _named(graph, optimizer_nodes, entry, lambda name: name.split("/", 1)[-1])
    placed = {}
    for path, node in placed_nodes.items():  # a tputrain checkpoint's model, by place
        for attribute in graph.nodes[node].attributes:
            if attribute.name == "VARIABLE_VALUE":
                name = attribute.full_name.removesuffix(":0")
                placed[path] = (entry(attribute.checkpoint_key), name if name in weights else None)
    return Source(prefix, "checkpoint", weights, slots, ambiguous, placed)


def _paths(graph: Any, roots: Sequence[tuple[str, int]]) -> dict[str, int]:
    """{path from `roots` (breadth first, as TensorFlow walks a model): node id}."""
    found: dict[str, int] = {}
    seen: set[int] = set()
    queue = list(roots)
    while queue:
        path, node = queue.pop(0)
        if node in seen:
            continue
        seen.add(node)
        found[path] = node
        queue.extend((f"{path}/{child.local_name}", child.node_id)
                     for child in graph.nodes[node].children)
    return found


def _reachable(graph: Any, starts: Sequence[int]) -> set[int]:
    seen, todo = set(), list(starts)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(child.node_id for child in graph.nodes[node].children)
    return seen


def _named(graph: Any, nodes: set[int], entry: Callable[[str], Entry],
           rename: Callable[[str], str]) -> tuple[dict[str, Entry], frozenset[str]]:
    """{name: entry} of the variables among `nodes`; names saved twice are ambiguous."""
    found: dict[str, Entry] = {}
    keys: dict[str, str] = {}
    ambiguous = set()
    for node in sorted(nodes):
        for attribute in graph.nodes[node].attributes:
            if attribute.name != "VARIABLE_VALUE":
                continue
            name = rename(attribute.full_name.removesuffix(":0")) or attribute.checkpoint_key
            if name in keys and keys[name] != attribute.checkpoint_key:
                ambiguous.add(name)
            keys[name] = attribute.checkpoint_key
            found[name] = entry(attribute.checkpoint_key)
    for name in ambiguous:
        found.pop(name, None)
    return found, frozenset(ambiguous)


# ------------------------------------------------------------ reading a .weights.h5


def read_h5(path: str, stack: Any) -> Source:
    """Names every dataset of a Keras `.weights.h5` "<layer name>/<index>"; `stack`
    (an ExitStack) keeps the file open until the values are read."""
    import h5py  # a Keras dependency

    local = path
    if "://" in path:  # h5py reads local files only
        folder = tempfile.mkdtemp(prefix="tputrain-init-")
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        local = os.path.join(folder, os.path.basename(path))
        tf.io.gfile.copy(path, local)
    try:
        file = stack.enter_context(h5py.File(local, "r"))
    except OSError as error:
        raise ValueError(f"InitCheckpoint: {path} is not a readable .h5 file: {error}") from None
    weights: dict[str, Entry] = {}
    ambiguous = set()

    def visit(name: str, group: Any) -> None:
        layer = group.attrs.get("name") if isinstance(group, h5py.Group) else None
        if name.split("/")[-1] != "vars" or layer is None:
            return
        layer = layer.decode() if isinstance(layer, bytes) else str(layer)
        for index, dataset in group.items():
            if not isinstance(dataset, h5py.Dataset):
                continue
            key = f"{layer}/{index}"
            if key in weights:
                ambiguous.add(key)
            weights[key] = Entry(tuple(dataset.shape), lambda d=dataset: np.asarray(d))

    file.visititems(visit)
    for key in ambiguous:
        weights.pop(key, None)
    return Source(path, "h5", weights, {}, frozenset(ambiguous))


def h5_places(model: keras.Model) -> dict[int, tuple[str, int]]:
    """{id(variable): (layer name, index)}: where a `.weights.h5` keeps each variable,
    found by asking each layer what it saves (its own `save_own_variables`)."""
    places: dict[int, tuple[str, int]] = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        store: dict[str, Any] = {}
        try:
            layer.save_own_variables(store)
        except Exception as error:  # noqa: BLE001 - a custom layer's override; say which
            logging.warning("tputrain: InitCheckpoint: cannot list the saved variables of "
                            "layer %s (%s)", layer.name, error)
            continue
        for index, value in store.items():
            if isinstance(value, (keras.Variable, tf.Variable)) and index.isdigit():
                places.setdefault(id(value), (layer.name, int(index)))
    return places


# ------------------------------------------------------------ matching


def rename(name: str, mapping: Mapping[str, str]) -> str:
    """The checkpoint name of model variable `name`: an exact mapping key, else the
    longest key that prefixes it, replaced; else `name` itself."""
    if name in mapping:
        return mapping[name]
    prefixes = [k for k in mapping if name.startswith(k)]
    if not prefixes:
        return name
    longest = max(prefixes, key=len)
    return mapping[longest] + name[len(longest):]


def selected(name: str, include: Sequence[str] | None) -> bool:
    """Whether `include` (prefixes, or regexes matched from the start) takes `name`."""
    if include is None:
        return True
    for pattern in include:
        if name.startswith(pattern):
            return True
        try:
            if re.match(pattern, name):
                return True
        except re.error:
            continue
    return False


def h5_key(variable: Any, old: str, place: tuple[str, int] | None) -> str | None:
    """The `<layer>/<index>` a model variable has in a .h5 file, its name mapped to
    `old`: the layer is renamed as the variable's path was."""
    if place is None:
        return None
    layer, index = place
    path = variable.path
    if old == path:
        return f"{layer}/{index}"
    at = path.rfind(f"{layer}/")
    suffix = path[at + len(layer):] if at >= 0 else "/" + path.rsplit("/", 1)[-1]
    stem = old[:-len(suffix)] if old.endswith(suffix) else old.rsplit("/", 1)[0]
    return f"{stem.rsplit('/', 1)[-1]}/{index}"


class Match(NamedTuple):
    """A model variable and the checkpoint name it takes its value from."""

    variable: Any
    name: str
    key: str


def match_weights(variables: Sequence[Any], source: Source, include: Sequence[str] | None,
                  mapping: Mapping[str, str], places: Mapping[int, tuple[str, int]],
                  paths: Mapping[int, str] | None = None
                  ) -> tuple[list[Match], list[str], list[str]]:
    """(matches, model names outside `include`, model names in it the checkpoint lacks).

    A weight whose name the checkpoint lacks is taken from the same place in a
    tputrain checkpoint's model (`paths`, `Source.placed`) when that place holds the
    name a subclassed model saves it under (`_same_place`), unless `mapping` renames it."""
    matches, excluded, missing = [], [], []
    seen: set[str] = set()
    for variable in variables:
        name = variable.path
        if not selected(name, include):
            excluded.append(name)
            continue
        if name in seen:
            raise ValueError(f"InitCheckpoint: this model has two variables named {name}, which "
                             "a name cannot tell apart: give their layers distinct names")
        seen.add(name)
        old = rename(name, mapping)
        key = h5_key(variable, old, places.get(id(variable))) if source.kind == "h5" else old
        if (key is None or key not in source.weights) and old == name and paths:
            key = _same_place(name, paths.get(id(variable)), source)
        if key is None or (key not in source.weights and key not in source.placed):
            missing.append(name)
            continue
        matches.append(Match(variable, name, key))
    return matches, excluded, missing


class Plan(NamedTuple):
    """The checked pairs a load assigns, and what it leaves at initial values."""

    matches: list[Match]
    excluded: list[str]
    missing: list[str]
    slots: list[Match]
    slots_missing: list[str]


def _flat(path: str) -> str:
    """How Keras 3 names a slot's reference: "dense/kernel" -> "dense_kernel"."""
    return path.replace("/", "_")


def match_slots(optimizer: Any, model_variables: Sequence[Any], matches: Sequence[Match],
                source: Source) -> tuple[list[Match], list[str]]:
    """The optimizer slots of the matched weights ("<flat path>_<slot>", e.g.
    "dense_kernel_momentum"), paired with the source's slots of their checkpoint
    names; never the iteration count or the learning rate."""
    owners = {_flat(v.path): v for v in model_variables}
    taken = {id(m.variable): m for m in matches}
    found, missing = [], []
    for slot in optimizer.variables:
        name = slot.name.removesuffix(":0").rsplit("/", 1)[-1]
        if name in ("iteration", "iterations", "learning_rate"):
            continue
        heads = [f for f in owners if name.startswith(f + "_")]
        if not heads:
            continue
        head = max(heads, key=len)
        owner = taken.get(id(owners[head]))
        if owner is None:  # a slot of a weight that was not loaded: stays as built
            continue
        key = f"{_flat(owner.key)}{name[len(head):]}"
        if key in source.slots:
            found.append(Match(slot, getattr(slot, "path", name), key))
        else:
            missing.append(getattr(slot, "path", name))
    return found, missing


def check_shapes(matches: Sequence[Match], entries: Mapping[str, Entry], path: str) -> None:
    """ValueError naming every variable whose shape differs from its checkpoint's."""
    problems = [f"{m.name} is {list(m.variable.shape)} in this model and {m.key} is "
                f"{list(entries[m.key].shape)} in the checkpoint" for m in matches
                if tuple(m.variable.shape) != tuple(entries[m.key].shape)]
    if problems:
        raise ValueError(f"InitCheckpoint: shapes differ between this model and {path}: "
                         f"{'; '.join(problems)}. Leave these variables out (include=...) or "
                         "map them to the right ones (mapping=...)")


def _value_for(variable: Any, value: np.ndarray, name: str) -> Any:
    """`value` in the variable's dtype: floats are cast (a bfloat16 or float16 copy of
    float32 weights), any other difference is an error."""
    target = tf.as_dtype(variable.dtype)
    source = tf.as_dtype(value.dtype)
    if source == target:
        return value
    if source.is_floating and target.is_floating:
        return tf.cast(value, target)
    raise ValueError(f"InitCheckpoint: {name} is {target.name} in this model and "
                     f"{source.name} in the checkpoint")


def assign(pairs: Sequence[Match], entries: Mapping[str, Entry],
           strategy: tf.distribute.Strategy | None) -> None:
    """Writes the checkpoint values in the strategy's scope (every replica's copy)."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        for pair in pairs:
            pair.variable.assign(_value_for(pair.variable, np.asarray(entries[pair.key].read()),
                                            pair.name))


def _names(names: Sequence[str]) -> str:
    more = f" (and {len(names) - _SHOW} more)" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more if names else "none"


# ------------------------------------------------------------ the action


def _check_include(include: Any) -> list[str] | None:
    if include is None:
        return None
    if isinstance(include, str):
        include = [include]
    if not isinstance(include, (list, tuple)) or not all(
            isinstance(p, str) and p for p in include):
        raise TypeError("InitCheckpoint.include must be None or a list of variable-name "
                        f"prefixes or regexes such as ['backbone'], got {include!r}")
    if not include:
        raise ValueError("InitCheckpoint.include=[] takes nothing: use None to take every "
                         "variable the checkpoint has")
    return list(include)


def _check_mapping(mapping: Any) -> dict[str, str]:
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in mapping.items()):
        raise TypeError("InitCheckpoint.mapping must be a dict {name or prefix in this model: "
                        "name or prefix in the checkpoint}, e.g. {'encoder': 'backbone'}, got "
                        f"{mapping!r}")
    return dict(mapping)


class InitCheckpoint(Action):
    """Fine-tuning: a new run (nothing in model_dir yet) starts from another
    checkpoint's weights; a resumed run continues from its own checkpoints.

    Weights match by name (`variable.path`). A subclassed model's weights are saved
    under "<model>/<weight>" (its layers' kernels share a name); from a tputrain
    checkpoint those are taken from the same place in the model's structure.

    Args:
      path: a tputrain model_dir (its newest checkpoint), a folder of TF checkpoints,
        a checkpoint prefix (`.../ckpt-100`), or a Keras `.weights.h5` file.
      include: model variable names to take, as prefixes or regexes matched from the
        start (`["backbone"]`); None: every variable the checkpoint has.
      mapping: `{name or prefix in this model: name or prefix in the checkpoint}`
        for renamed layers (`{"encoder": "backbone"}`); for `.weights.h5` it renames
        layers.
      optimizer: also take the optimizer slots (momentum, Adam moments) of the loaded
        weights, from a TF checkpoint with an `optimizer` (a tputrain one); never its
        iteration count or learning rate.
      strict: raise if a variable `include` takes is not in the checkpoint (else
        it keeps its initial value, named in the log).
    """

    def __init__(self, path: str, include: Sequence[str] | None = None,
                 mapping: Mapping[str, str] | None = None, optimizer: bool = False,
                 strict: bool = False):
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise TypeError("InitCheckpoint.path must be a model_dir, checkpoint prefix or "
                            f".weights.h5 file, got {path!r}")
        self.path = os.fspath(path)
        self.include = _check_include(include)
        self.mapping = _check_mapping(mapping)
        self.optimizer = check_bool("InitCheckpoint", "optimizer", optimizer)
        self.strict = check_bool("InitCheckpoint", "strict", strict)
        self.report: Report | None = None  # what the last load did

    def preflight(self, context: ActionContext) -> None:
        """Before anything is written to model_dir: a missing path, an unreadable
        checkpoint or a shape mismatch is bad configuration, and fails the Trainer's
        construction (the CLI: one line, exit 2), not the first step after the lock."""
        if list_checkpoints(context.checkpointer.restore_directory).paths:
            return  # a resumed run never reads the source
        optimizer = context.optimizer if self.optimizer else None
        with self._opened() as source:
            self._plan(source, context.model, optimizer)

    def on_train_begin(self, context: ActionContext, step: int) -> None:
        """Loads only into a run that restored nothing from its own model_dir."""
        if step != 0 or list_checkpoints(context.checkpointer.restore_directory).paths:
            logging.info("tputrain: InitCheckpoint: %s has its own checkpoint (step %d); not "
                         "loading %s", context.model_dir, step, self.path)
            return
        self.report = self.load(context.model, context.optimizer if self.optimizer else None,
                                context.strategy)

    @contextlib.contextmanager
    def _opened(self) -> Iterator[Source]:
        """The source checkpoint, its files open until the block ends."""
        resolved = resolve_path(self.path)
        with contextlib.ExitStack() as stack:
            yield (read_h5(resolved, stack) if resolved.endswith(".h5")
                   else read_tf_checkpoint(resolved))

    def load(self, model: keras.Model, optimizer: Any = None,
             strategy: tf.distribute.Strategy | None = None) -> Report:
        """Loads the checkpoint's weights (and `optimizer`'s slots, when given) into
        `model`, in `strategy`'s scope; logs and returns what it did."""
        if self.optimizer and optimizer is None:
            raise ValueError("InitCheckpoint(optimizer=True) needs the optimizer to load into")
        with self._opened() as source:
            plan = self._plan(source, model, optimizer)
            assign(plan.matches, entries_of(source), strategy)
            assign(plan.slots, source.slots, strategy)
        used = {m.key for m in plan.matches} | {
            source.placed[m.key][1] for m in plan.matches if m.key in source.placed}
        report = Report(source.path, [(m.name, m.key) for m in plan.matches], plan.excluded,
                        plan.missing, sorted(set(source.weights) - used), len(plan.slots),
                        plan.slots_missing)
        _log(report, source)
        return report

    def _plan(self, source: Source, model: keras.Model, optimizer: Any) -> Plan:
        """What a load would assign, checked (names, shapes, slots) without assigning."""
        seeds = {id(s) for s in seed_generator_states(model)}
        variables = [v for v in _unique(model.variables) if id(v) not in seeds]
        places = h5_places(model) if source.kind == "h5" else {}
        paths = model_paths(model) if source.placed else None
        matches, excluded, missing = match_weights(variables, source, self.include,
                                                   self.mapping, places, paths)
        if self.strict and missing:
            raise ValueError(f"InitCheckpoint(strict=True): {source.path} has no "
                             f"{_names(missing)}; it has {_names(sorted(source.weights))}")
        if not matches:
            raise ValueError(
                f"InitCheckpoint: no variable of this model is in {source.path} (this model: "
                f"{_names([v.path for v in variables])}; the checkpoint: "
                f"{_names(sorted(source.weights))}): check include= and mapping=")
        check_shapes(matches, entries_of(source), source.path)
        slots, slots_missing = [], []
        if optimizer is not None:
            if not source.slots:
                raise ValueError(f"InitCheckpoint(optimizer=True): {source.path} has no "
                                 "optimizer slots (only tputrain and other TF checkpoints "
                                 "with an `optimizer` do); use optimizer=False")
            slots, slots_missing = match_slots(optimizer, variables, matches, source)
            check_shapes(slots, source.slots, source.path)
        return Plan(matches, excluded, missing, slots, slots_missing)


def _same_place(name: str, path: str | None, source: Source) -> str | None:
    """`path` if the source's weight there is this one as a subclassed model saves it:
    "<model>/<weight>" (the layer left out, so a model's kernels share one name and
    are ambiguous); None otherwise (a functional model's new head keeps its own name)."""
    placed = source.placed.get(path) if path else None
    parts = name.split("/")
    saved_as = f"{parts[0]}/{parts[-1]}"
    if placed is None or len(parts) < 3:
        return None
    return path if placed[1] == saved_as or saved_as in source.ambiguous else None


def entries_of(source: Source) -> dict[str, Entry]:
    """The source's weights by name and by place (`Source.placed`)."""
    return {**source.weights, **{path: entry for path, (entry, _) in source.placed.items()}}


def _unique(variables: Sequence[Any]) -> Iterator[Any]:
    seen = set()
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            yield variable


def _log(report: Report, source: Source) -> None:
    """One line: how much was loaded, what kept its initial value and why, and
    what the checkpoint had that nothing took."""
    total = len(report.loaded) + len(report.excluded) + len(report.missing)
    parts = [f"loaded {len(report.loaded)} of {total} model variables from {report.path}"]
    if report.slots_loaded or report.slots_missing:
        parts.append(f"{report.slots_loaded} optimizer slots (not in the checkpoint: "
                     f"{_names(report.slots_missing)})")
    parts.append(f"left at their initial values: not in the checkpoint: "
                 f"{_names(report.missing)}; outside include: {_names(report.excluded)}")
    parts.append(f"checkpoint variables not used: {_names(report.unused)}")
    if source.ambiguous:
        parts.append(f"names saved twice in the checkpoint (not used): "
                     f"{_names(sorted(source.ambiguous))}")
    log = logging.warning if report.missing else logging.info
    log("tputrain: InitCheckpoint: %s", "; ".join(parts))
