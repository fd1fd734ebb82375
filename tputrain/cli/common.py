"""What the absl commands share: the gin flags, building the Trainer, exit codes."""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, NoReturn, Sequence

import gin
from absl import app, flags, logging

from tputrain.checkpointing.run_directory import RunDirectory
from tputrain.config.parsing import ConfigError, parse_gin, require_bound
from tputrain.config.registry import configure_devices
from tputrain.task import Task
from tputrain.trainer import Trainer

FLAGS = flags.FLAGS

# Exit codes (docs/fault_tolerance.md): 0 done; 1 training failed (e.g. a non-finite
# loss, corrupt data or a full disk mid-run, a lost worker); 2 bad config or input, found
# before any training; 3 a multi-worker task never joined; 42 preempted (SIGTERM).
EXIT_TRAINING_FAILED = 1
EXIT_BAD_INPUT = 2

VERTEX_CHECKPOINT_DIR = "AIP_CHECKPOINT_DIR"  # set by Vertex AI (docs/vertex.md)

GIN_FLAGS = ("gin_file", "gin_param", "gin_search_path", "gin_import")


def define_gin_flags(flag_values: flags.FlagValues = FLAGS, model_dir: bool = True) -> None:
    """The gin flags shared by every command that reads a gin config; `model_dir` False
    for a command with no model_dir of its own (`tputrain tune`: a study folder)."""
    flags.DEFINE_multi_string("gin_file", [], "Gin config file(s); later files override "
                              "earlier ones.", flag_values=flag_values)
    flags.DEFINE_multi_string("gin_param", [], "Gin binding(s), e.g. "
                              "'Trainer.train_steps=100'.", flag_values=flag_values)
    flags.DEFINE_multi_string("gin_search_path", [], "Folder(s) searched for gin files and "
                              "includes.", flag_values=flag_values)
    flags.DEFINE_multi_string("gin_import", [], "Python module(s) to import before parsing, "
                              "e.g. a module defining your Task.", flag_values=flag_values)
    if model_dir:
        flags.DEFINE_string("model_dir", None, "Overrides Trainer.model_dir.",
                            flag_values=flag_values)
        # `--model_dir=$DIR` with DIR unset would train in the config's model_dir instead.
        flags.register_validator("model_dir", lambda value: value is None or bool(value.strip()),
                                 "is empty (an unset shell variable?): pass a directory, or "
                                 "leave the flag out to use the config's Trainer.model_dir",
                                 flag_values=flag_values)
    flags.DEFINE_bool("deterministic", False, "Enable TF op determinism: bitwise reproducible "
                      "runs and resumes, at some speed cost.", flag_values=flag_values)


def list_in_help(names: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> None:
    """Lists these flags in --help of the running command.

    A console script is its own __main__, and absl's --help shows only the flags
    of the main module (named by sys.argv[0]), not those of the module that
    defined them.
    """
    for name in names:
        flag_values.register_key_flag_for_module(sys.argv[0], flag_values[name])


def reject_arguments(argv: Sequence[str]) -> None:
    """absl passes positional arguments through; none of the commands takes any. Bad
    configuration: one line and exit 2 (absl's UsageError exits 1 with a usage dump)."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}: every setting is a --flag "
             "(a value with spaces must be quoted; see --help)")


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """absl's flag parsing, but a bad flag value (`--step=abc`, a failed validator) is
    bad configuration: one line and exit 2, not absl's exit 1."""
    try:
        return flag_values(list(argv))
    except flags.Error as error:
        fail(f"{str(error).strip().splitlines()[0]} (see --help)")


def run_command(main: Callable[[list[str]], None]) -> None:
    """`app.run(main)` with `parse_flags`: every absl command exits 2 on a bad flag."""
    app.run(main, flags_parser=parse_flags)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    print(f"tputrain: error: {message}", file=sys.stderr)
    sys.exit(code)


def error_message(error: BaseException) -> str:
    """The error's own message, without the lines gin appends ("In call to ..."), but
    naming the configurable they name (whose bindings to check)."""
    text, *calls = str(error).split("\n  In call to configurable")
    text = text.strip() or type(error).__name__
    names = [m.group(1) for m in (re.match(r" '([\w.]+)'", call) for call in calls) if m]
    if not names or isinstance(error, OSError):  # a disk's or network's: no binding to check
        return text
    method = _task_method(error)
    if method:  # e.g. a Task's binding, found wrong when the Trainer builds its model
        return f"{text} (raised in {method}, called by {names[0]}: check their bindings)"
    return f"{text} (raised in {names[0]}: check its bindings)"


def _task_method(error: BaseException) -> str | None:
    """"Task.method" of the innermost frame of a `Task`'s method the error passed."""
    found, trace = None, error.__traceback__
    while trace is not None:
        owner = trace.tb_frame.f_locals.get("self")
        if isinstance(owner, Task):
            found = f"{type(owner).__name__}.{trace.tb_frame.f_code.co_name}"
        trace = trace.tb_next
    return found


def parse_gin_flags(data_files: Sequence[str] = ()) -> None:
    """Parses the gin flags and applies the device bindings (`split_cpu.num_devices`),
    before anything starts TensorFlow's runtime; a bad config exits with one line.
    `data_files`: a model_dir's config, parsed without running its imports."""
    if not FLAGS.gin_file and not FLAGS.gin_param and not data_files:
        fail("pass --gin_file=CONFIG (e.g. --gin_file=digits.gin); `tputrain --help` lists "
             "the commands and flags")
    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_param, FLAGS.gin_search_path, FLAGS.gin_import,
                  data_files=data_files)
    except ConfigError as error:
        fail(str(error))
    try:
        configure_devices()  # gin only records split_cpu.num_devices: apply it now
    except (RuntimeError, ValueError, TypeError) as error:  # e.g. TF already started
        fail(error_message(error))


def configured_task(bindings: Sequence[str] = ("Trainer.task",)) -> Task:
    """The Task of the first bound of `bindings`, built once (commands that use the
    task outside a Trainer, or in several); ConfigError when none is bound."""
    for binding in bindings:
        try:
            reference = gin.query_parameter(binding)
        except ValueError:
            continue
        task = (reference.scoped_configurable_fn()
                if hasattr(reference, "scoped_configurable_fn") else reference)
        if not isinstance(task, Task):
            raise ConfigError(f"{binding} must be a tputrain.Task, got {type(task).__name__}")
        return task
    require_bound(bindings[-1])  # raises with the fix
    raise AssertionError("unreachable")


def default_operative_config() -> list[str]:
    """No --gin_file: the operative config that `tputrain run` wrote to model_dir (for
    commands that act on a finished or running job: export, eval), to parse as data:
    its `import` lines are not run (pass `parse_gin_flags` what this returns)."""
    if not FLAGS.gin_file and not FLAGS.model_dir and not FLAGS.gin_param:
        fail("pass --model_dir=DIR of a run (its config is read from there), or --gin_file=CONFIG")
    if FLAGS.gin_file or not FLAGS.model_dir:
        return []
    operative = RunDirectory(FLAGS.model_dir).operative_config
    if not os.path.isfile(operative):
        fail(f"{operative} does not exist (yet): pass the run's --gin_file (a tputrain.fit run "
             "has no gin config: export or evaluate it from its script, docs/serving.md)")
    return [operative]


def build_trainer(model_dir: str | None = None,
                  trainer_class: type[Trainer] = Trainer) -> Trainer:
    """The gin-configured Trainer (inputs validated before anything is written) in
    `model_dir`; when None, in Vertex AI's $AIP_CHECKPOINT_DIR if set (a job's output
    must outlive its machine), else in the config's `Trainer.model_dir`. Commands that
    only read a run pass `trainer_class=tputrain.jobs.sidecar.ReadOnlyTrainer`."""
    if model_dir is None and os.environ.get(VERTEX_CHECKPOINT_DIR):
        model_dir = os.environ[VERTEX_CHECKPOINT_DIR]
        logging.info("tputrain: model_dir %s (from $%s)", model_dir, VERTEX_CHECKPOINT_DIR)
    try:
        require_bound("Trainer.task")
        if model_dir is None:
            require_bound("Trainer.model_dir")
    except ConfigError as error:
        fail(str(error))
    return trainer_class(model_dir=model_dir) if model_dir else trainer_class()
