"""`tputrain launch --workers N <run flags>`: N local worker processes, one cluster.

Starts N `tputrain` training processes on this machine, each with a TF_CONFIG
that puts them in one `MultiWorkerMirroredStrategy` cluster on free 127.0.0.1
ports. For testing multi-worker code and for using several processes on one
big machine; on a real cluster, run `tputrain` on every host with its own
TF_CONFIG instead (the same program).

Worker output is prefixed with `[worker i]`. If a worker fails, the others are
expected to fail too (their collectives lose a peer); any still running after
`--peer_exit_timeout` seconds are stopped (SIGTERM, then SIGKILL). SIGTERM or
Ctrl-C to the launcher is forwarded to every worker, which checkpoint and exit
42; a worker still starting (no handler yet) dies by it, preempted all the same.
The launcher exits 0 if every worker succeeded, 42 if every worker was preempted
(or the signal came before any started), else with the first failure's code (1 for
a worker killed by a signal the launcher did not forward).

Note: TF's gRPC servers listen on all interfaces, not only 127.0.0.1; on a
shared network run the launcher inside a private network namespace (e.g.
`unshare -rn`, then bring up `lo`) or behind a firewall.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import NoReturn, Sequence

from tputrain.distribution.launch import Launcher
from tputrain.fault_tolerance.preemption_early import PREEMPTED_EXIT_CODE, take_early_signal


def build_parser() -> argparse.ArgumentParser:
    """argparse, not absl: the launcher's own flags are few, and every other flag
    passes through to the workers unparsed."""
    parser = _Parser(
        prog="tputrain launch",
        description="Run N local tputrain workers as one MultiWorkerMirroredStrategy cluster. "
                    "Other flags (--gin_file, --gin_param, --model_dir...) go to every worker.")
    parser.add_argument("--workers", type=_at_least_one, required=True,
                        help="number of worker processes")
    parser.add_argument("--peer_exit_timeout", type=float, default=60.0,
                        help="seconds to let the other workers fail on their own after one "
                             "failed, before stopping them")
    return parser


def _at_least_one(text: str) -> int:
    """--workers: a whole number of processes, at least one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} workers: pass --workers=1 or more")
    return value


class _Parser(argparse.ArgumentParser):
    """One line and exit 2 for a bad flag, as the other commands (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        print(f"tputrain launch: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's flags, the flags every worker gets)."""
    return build_parser().parse_known_args(list(argv))


def console_main(argv: Sequence[str] | None = None) -> None:
    """`tputrain launch`: see the module docstring."""
    args, run_args = parse_args(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith(("--gin_file", "--gin_param")) for a in run_args):
        print("tputrain launch: error: pass the training flags too, e.g. "
              "--gin_file=digits.gin --model_dir=/tmp/run", file=sys.stderr)
        sys.exit(2)
    launcher = Launcher(args.workers, run_args, args.peer_exit_timeout)
    replaced = {signum: signal.signal(signum, lambda s, f: launcher.forward(signal.SIGTERM, s))
                for signum in (signal.SIGTERM, signal.SIGINT)}
    early = take_early_signal(replaced)  # held since the command's first line
    if early is not None:
        _stop(f"signal {early} before the workers started; nothing to save")
    launcher.start()
    code = launcher.wait()
    if code == PREEMPTED_EXIT_CODE and launcher.received is not None:
        _stop(f"preempted ({signal.Signals(launcher.received).name})")
    sys.exit(code)


def _stop(reason: str) -> NoReturn:
    """The launcher's last line when it was signalled: a preemption, rerun to resume."""
    print(f"tputrain launch: {reason}: rerun the same command to resume (exit code "
          f"{PREEMPTED_EXIT_CODE})", file=sys.stderr, flush=True)
    sys.exit(PREEMPTED_EXIT_CODE)
