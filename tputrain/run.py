"""`python -m tputrain.run --gin_file=F [--gin_param=...]`: train a gin config.

The `tputrain` console script runs this too; `tputrain <command>` dispatches to
the other commands (see `COMMANDS`), and with no command it trains.
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

from absl import app, flags, logging

from tputrain.launch import watch_launcher

FLAGS = flags.FLAGS


def define_gin_flags() -> None:
    """The gin flags shared by every tputrain command."""
    flags.DEFINE_multi_string("gin_file", [], "Gin config file(s); later files override earlier ones.")
    flags.DEFINE_multi_string("gin_param", [], "Gin binding(s), e.g. 'Trainer.train_steps=100'.")
    flags.DEFINE_multi_string("gin_search_path", [], "Folder(s) searched for gin files and includes.")
    flags.DEFINE_multi_string("gin_import", [], "Python module(s) to import before parsing, "
                              "e.g. a module defining your Task.")
    flags.DEFINE_string("model_dir", None, "Overrides Trainer.model_dir.")
    flags.DEFINE_bool("deterministic", False, "Enable TF op determinism: bitwise reproducible "
                      "runs and resumes, at some speed cost.")


def parse_gin_flags() -> None:
    """Parses the gin flags and applies the device bindings (`split_cpu.num_devices`),
    before anything starts TensorFlow's runtime; a bad config exits with one line."""
    from tputrain.config import ConfigError, parse_gin
    from tputrain.strategy import configure_devices

    if not FLAGS.gin_file and not FLAGS.gin_param:
        raise app.UsageError("pass --gin_file=CONFIG (e.g. --gin_file=digits.gin)")
    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_param, FLAGS.gin_search_path, FLAGS.gin_import)
    except ConfigError as error:
        _fail(str(error))
    try:
        configure_devices()  # gin only records split_cpu.num_devices: apply it now
    except (RuntimeError, ValueError, TypeError) as error:  # e.g. TF already started
        _fail(_message(error))


def _fail(message: str, code: int = 2) -> None:
    print(f"tputrain: error: {message}", file=sys.stderr)
    sys.exit(code)


def build_trainer():
    """Builds the gin-configured Trainer (inputs validated before anything is written)."""
    from tputrain.config import ConfigError, require_bound
    from tputrain.trainer import Trainer

    try:
        require_bound("Trainer.task")
        if FLAGS.model_dir is None:
            require_bound("Trainer.model_dir")
    except ConfigError as error:
        _fail(str(error))
    kwargs = {"model_dir": FLAGS.model_dir} if FLAGS.model_dir else {}
    return Trainer(**kwargs)


def _exit_preempted_before_training(signum: int, frame: Any) -> None:
    """SIGTERM while the Trainer is built: nothing to save yet; exit 42 all the same,
    so a scheduler sees a preemption (rerun resumes) and not a crash (-15)."""
    del frame
    from tputrain.preemption import PREEMPTED_EXIT_CODE

    print(f"tputrain: signal {signum} before training started; nothing to save: rerun the "
          f"same command to resume (exit code {PREEMPTED_EXIT_CODE})", file=sys.stderr)
    sys.exit(PREEMPTED_EXIT_CODE)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    # Until train() installs its own watcher (and after it restores this one).
    signal.signal(signal.SIGTERM, _exit_preempted_before_training)
    watch_launcher()  # a worker of `tputrain launch` stops when the launcher dies
    from tputrain.cluster import join_watchdog  # registers join_watchdog before parsing

    parse_gin_flags()
    from tputrain.config import write_operative_config

    if FLAGS.deterministic:
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    try:
        with join_watchdog():  # multi-worker: a task that never starts is named, not waited on
            trainer = build_trainer()
    except (ValueError, TypeError, OSError) as error:  # bad input: one line naming the fix
        logging.debug("tputrain: building the trainer failed", exc_info=True)
        _fail(_message(error), EXIT_BAD_INPUT)
    if trainer.is_chief:
        write_operative_config(trainer.model_dir)
    results = _train(trainer)
    if trainer.is_chief:
        write_operative_config(trainer.model_dir)
    logging.info("tputrain: done at step %d: %s", int(trainer.step.numpy()),
                 " | ".join(f"{k} {v:.4g}" for k, v in results.items()))


# Exit codes (docs/fault_tolerance.md): 0 done; 1 training failed (e.g. a non-finite
# loss, corrupt data or a full disk mid-run, a lost worker); 2 bad config or input, found
# before any training; 3 a multi-worker task never joined; 42 preempted (SIGTERM).
EXIT_TRAINING_FAILED = 1
EXIT_BAD_INPUT = 2


def _message(error: BaseException) -> str:
    """The error's own message, without the lines gin appends ("In call to ...")."""
    text = str(error).split("\n  In call to configurable")[0].strip()
    return text or type(error).__name__


def _train(trainer):
    """Runs training; known failures end in one line (preemption exits 42 by itself)."""
    import tensorflow as tf

    from tputrain.checkpoint import CheckpointMismatchError, NonFiniteStateError
    from tputrain.data import CorruptRecordError, FeatureSpecError
    from tputrain.guard import NonFiniteError
    from tputrain.validate import InputDataError, ModelDirError

    try:
        return trainer.train()
    except CheckpointMismatchError as error:  # found at restore, before any step
        _fail(_message(error), EXIT_BAD_INPUT)
    except (CorruptRecordError, InputDataError, FeatureSpecError, ModelDirError,
            NonFiniteError, NonFiniteStateError) as error:  # found mid-run
        _fail(_message(error), EXIT_TRAINING_FAILED)
    except tf.errors.UnavailableError as error:
        if trainer.num_hosts == 1:
            raise
        # A peer died: TF aborts the collectives (heartbeats stop) rather than hang.
        _fail(f"lost a worker ({_message(error).splitlines()[0]}): rerun the job to resume "
              "from the last checkpoint", EXIT_TRAINING_FAILED)


# `tputrain <command>`: module with a `console_main()` each; `run` is the default.
COMMANDS = {"run": "tputrain.run", "launch": "tputrain.launch", "vertex-spec": "tputrain.vertex"}
COMMANDS["audit-precision"] = "tputrain.audit"
COMMANDS["diagnose"] = "tputrain.diagnose"
COMMANDS["write-tfrecords"] = "tputrain.write_tfrecords_cli"


def list_in_help(names) -> None:
    """Lists these flags in --help of the running command.

    A console script is its own __main__, and absl's --help shows only the flags
    of the main module, not those of the tputrain module that defined them.
    """
    for name in names:
        FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


# One line each for `tputrain --help` (kept here: importing the commands loads TensorFlow).
SUMMARIES = {
    "run": "train a gin config (the default: `tputrain --gin_file=...` runs it)",
    "launch": "run N local worker processes as one MultiWorkerMirrored cluster",
    "diagnose": "is this training job waiting on its input? (input stall, bottleneck)",
    "audit-precision": "which layers drift in bf16/fp16, and does it change the metrics?",
    "write-tfrecords": "convert .npz/.csv arrays into sharded TFRecords with a manifest",
    "vertex-spec": "write (or --submit) a Vertex AI CustomJob that trains a gin config",
}


def overview() -> str:
    """`tputrain --help`: the commands, one line each."""
    width = max(map(len, SUMMARIES))
    lines = ["usage: tputrain [COMMAND] [flags]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in SUMMARIES.items()]
    lines += ["", "`tputrain COMMAND --help` shows a command's flags; with no command, "
              "`tputrain` trains (`tputrain run --help` lists the training flags)."]
    return "\n".join(lines)


def console_main() -> None:
    """Entry point of the `tputrain` console script."""
    if sys.argv[1:] in (["--help"], ["-h"], ["help"]):
        print(overview())
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        command = sys.argv.pop(1)
        sys.argv[0] = f"tputrain {command}"  # absl's usage line names the command
        if command != "run":
            importlib.import_module(COMMANDS[command]).console_main()
            return
    define_gin_flags()
    list_in_help(("gin_file", "gin_param", "gin_search_path", "gin_import", "model_dir",
                  "deterministic"))
    app.run(main)


if __name__ == "__main__":
    console_main()
