"""`tputrain [COMMAND] [flags]`: picks the command and hands it the rest of argv.

`tputrain --help` lists the commands from `SUMMARIES` without importing any of
them, and a command imports only its own module: the commands import the
library, and with it TensorFlow, which listing them does not need.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

DEFAULT_COMMAND = "run"  # `tputrain --gin_file=...` trains

# One line each for `tputrain --help` (and the CLI reference's table).
SUMMARIES = {
    "run": "train a gin config (the default: `tputrain --gin_file=...` runs it)",
    "launch": "run N local worker processes as one MultiWorkerMirrored cluster",
    "diagnose": "where a step's time goes: input, compute or communication, and the knob to turn",
    "goodput": "where a job's wall-clock time went, restarts included (--model_dir=DIR)",
    "audit-precision": "which layers drift in bf16/fp16, and does it change the metrics?",
    "write-tfrecords": "convert .npz/.csv arrays into sharded TFRecords with a manifest",
    "vertex-spec": "write (or --submit) a Vertex AI CustomJob that trains a gin config",
    "export": "write a checkpoint as a SavedModel for serving (best or latest, or --step)",
    "eval": "evaluate a checkpoint (latest or --step), or --continuous each new one as it appears",
}
_HELP = (["--help"], ["-h"], ["help"])


def module_name(command: str) -> str:
    """`tputrain audit-precision` lives in `tputrain.cli.audit_precision`."""
    if command not in SUMMARIES:
        raise KeyError(f"no tputrain command {command!r}: use one of {', '.join(SUMMARIES)}")
    return f"tputrain.cli.{command.replace('-', '_')}"


def command_module(command: str) -> ModuleType:
    """The module of `tputrain <command>`, imported now and not at start-up (see above)."""
    return importlib.import_module(module_name(command))


def overview() -> str:
    """`tputrain --help`: the commands, one line each."""
    width = max(map(len, SUMMARIES))
    lines = ["usage: tputrain [COMMAND] [flags]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in SUMMARIES.items()]
    lines += ["", "`tputrain COMMAND --help` shows a command's flags; with no command, "
              "`tputrain` trains (`tputrain run --help` lists the training flags)."]
    return "\n".join(lines)


def console_main() -> None:
    """Entry point of the `tputrain` console script (and `python -m tputrain.run`)."""
    if sys.argv[1:] in _HELP:
        print(overview())
        sys.exit(0)
    command, usage_name = DEFAULT_COMMAND, "tputrain"
    if len(sys.argv) > 1 and sys.argv[1] in SUMMARIES:
        command = sys.argv.pop(1)
        usage_name = f"tputrain {command}"
    sys.argv[0] = usage_name  # absl's usage line (and --help's flag list) names the command
    command_module(command).console_main()
