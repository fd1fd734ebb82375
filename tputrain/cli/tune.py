"""`tputrain tune --spec=SPEC --gin_file=F --study_dir=DIR`: search a tuning spec with Optuna.

Each trial trains the gin config with the trial's bindings in its own model_dir
under --study_dir, reporting the spec's metric at each evaluation; the pruner
stops trials that trail (docs/tracking.md). The study is kept in
DIR/study.db: run the same command again after a kill and it continues. At the
end: a table of the trials (state, metric, step, params) and the best trial's
bindings, ready for a gin file. Needs `pip install 'tputrain[tune]'`.
Exits 0 when done; 2 for a bad spec or a config every trial refuses (that trial
is not counted toward the spec's trials); 42 when the study stopped on SIGTERM or
Ctrl-C, or a trial was preempted: the running trials save, and rerunning the same
command resumes them.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from typing import Any

from absl import flags

from tputrain.cli.common import (GIN_FLAGS, define_gin_flags, fail, list_in_help,
                                 reject_arguments, run_command)
from tputrain.fault_tolerance.preemption_early import PREEMPTED_EXIT_CODE, take_early_signal
from tputrain.tuning.spec import SpecError, load_spec

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    define_gin_flags(flag_values, model_dir=False)  # each trial's is under --study_dir
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("spec", None, "The tuning spec (YAML): parameters, metric, goal, "
                        "trials, parallel.", **fv)
    flags.DEFINE_string("study_dir", None, "The study's folder: study.db, and each trial's "
                        "model_dir and log.", **fv)
    flags.DEFINE_integer("trials", None, "Overrides the spec's trial count.", **fv)
    flags.DEFINE_integer("parallel", None, "Overrides the spec's trials at once.", **fv)
    list_in_help((*GIN_FLAGS, "spec", "study_dir", "trials", "parallel"), flag_values)


def _run_args() -> list[str]:
    """The flags every trial's `tputrain run` gets (its bindings come after)."""
    args = [f"--gin_file={path}" for path in FLAGS.gin_file]
    args += [f"--gin_param={binding}" for binding in FLAGS.gin_param]
    args += [f"--gin_search_path={path}" for path in FLAGS.gin_search_path]
    args += [f"--gin_import={module}" for module in FLAGS.gin_import]
    return args + (["--deterministic"] if FLAGS.deterministic else [])


def refuse_model_dir(argv: list[str]) -> None:
    """`--model_dir` (habit from `tputrain run`) named as what tune takes instead, rather
    than absl's "unknown flag"."""
    if any(arg == "--model_dir" or arg.startswith("--model_dir=") for arg in argv[1:]):
        fail("each trial has its own model_dir under --study_dir: pass --study_dir, "
             "not --model_dir")


def main(argv: list[str]) -> None:
    reject_arguments(argv)
    if not FLAGS.spec or not FLAGS.study_dir or not FLAGS.gin_file:
        fail("pass --spec=SPEC.yaml, --study_dir=DIR and --gin_file=CONFIG")
    try:
        spec = load_spec(FLAGS.spec)
        import optuna  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except SpecError as error:
        fail(str(error))
    except ImportError:
        fail("tputrain tune needs Optuna: pip install 'tputrain[tune]'")
    from tputrain.tuning import study as engine  # pylint: disable=import-outside-toplevel
    from tputrain.tuning.table import best_lines, trials_table  # pylint: disable=import-outside-toplevel
    overrides = {"trials": FLAGS.trials, "parallel": FLAGS.parallel}
    spec = dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v})
    runner = engine.StudyRunner(spec, FLAGS.study_dir, _run_args())
    stop_on_signals(runner)
    try:
        study = runner.run()
    except engine.TrialConfigError as error:
        fail(str(error))
    except engine.StudyStopped as error:  # its trials saved: a preemption, rerun resumes
        print(f"tputrain tune: {error}", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT_CODE)
    print(trials_table(study, spec))
    print("\n".join(best_lines(study, spec)), flush=True)


def stop_on_signals(runner: Any) -> None:
    """SIGTERM and Ctrl-C stop the study as a preemption: the running trials save and the
    tuner exits 42 (rerun to resume), as `tputrain run` and `launch` do. A signal held
    since the command's first line (`preemption_early`) stops it now."""
    def handle(signum: int, frame: Any) -> None:
        del frame
        runner.stop(f"stopped ({signal.Signals(signum).name})")

    replaced = {signum: signal.signal(signum, handle) for signum in (signal.SIGTERM, signal.SIGINT)}
    early = take_early_signal(replaced)
    if early is not None:
        handle(early, None)


def console_main() -> None:
    """`tputrain tune`."""
    refuse_model_dir(sys.argv)
    define_flags()
    run_command(main)
