"""Test setup: split the CPU into 4 logical devices before TensorFlow starts.

Multi-replica behaviour is tested for real: MirroredStrategy over 2 or 4 of
these logical CPUs runs the same collectives as over GPUs.
"""

import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The support modules (tiny, faults, processes, ...) live in tests/support/ and are
# imported by bare name (`import tiny`, `--gin_import=faults`): here, and in every
# child process a test starts (the CLI, `tputrain launch` workers), through PYTHONPATH.
_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)
if _SUPPORT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [_SUPPORT, os.environ.get("PYTHONPATH")]))

# One temporary folder for the run (TMPDIR, which tempfile and the child processes read):
# what a test or a library leaves under it (TFDS's empty `tmp*tfds` folders, a killed
# worker's scratch) goes with it, so repeated runs do not fill the disk.
_OWN_TMP = None
if "PYTEST_XDIST_WORKER" not in os.environ:
    _OWN_TMP = tempfile.mkdtemp(prefix="tputrain-test-tmp-")
    os.environ["TMPDIR"] = tempfile.tempdir = _OWN_TMP

# One persistent XLA compilation cache for the whole run: the process that starts
# pytest makes it, its xdist workers and every child process (launch workers, the
# CLI) inherit it through TF_XLA_FLAGS, so a program compiled once (the same tiny
# models' steps and per-device updates, hundreds of times) is read back after.
# TensorFlow writes each entry to a temporary file and renames it into place.
_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
_OWN_XLA_CACHE = None
if _CACHE_FLAG not in os.environ.get("TF_XLA_FLAGS", ""):
    _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="tputrain-test-xla-cache-")
    os.environ["TF_XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("TF_XLA_FLAGS"), f"{_CACHE_FLAG}={_OWN_XLA_CACHE}",
        "--tf_xla_persistent_cache_device_types=CPU"]))

# tputrain's own cache (the digits TFRecords, the CPU's measured peak FLOP/s) in one
# folder for the run, not the user's ~/.cache: a peak probed while three workers
# share two cores reads low, and the user's runs would have kept it.
_OWN_CACHE = None
if "TPUTRAIN_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["TPUTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tputrain-test-cache-")

import pytest  # noqa: E402

import tputrain  # noqa: E402,F401  (first: its import of TF drops TF's start-up noise)
import tensorflow as tf  # noqa: E402

NUM_CPU_DEVICES = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_CPU_DEVICES)


# ------------------------------------------------------------ scheduling under -n N
#
# `pytest -n 4` (CI, on 2 cores: a third and fourth worker fill the time the others
# wait on child processes) balances tests over 4 workers. Two markers decide its wall time:
# - `@pytest.mark.same_worker("group")` (on a test, or a module's `pytestmark`):
#   tests that share a module- or session-scoped fixture run on one worker, or each
#   worker computes the fixture (minutes for the replica-equivalence ones). A group
#   is one unit of work for xdist.
# - `@pytest.mark.start_early(order)`: the longest units start first (lowest order
#   first), or a worker can be left running one at the end while the others idle;
#   then the other `slow` tests, then the rest.
# xdist's scheduler runs in the controlling process, which collects no tests, so it
# reads the `same_worker` marks from the test files' source (`same_worker_groups`).
# (Not pytest.mark.xdist_group: `--dist loadgroup` of pytest-xdist 3.8 renames node
# ids through `item._nodeid`, which pytest 9 no longer has, so it groups nothing.)

_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked `slow` (the whole suite: about 45 minutes "
                          "on 2 cores); without it, and without -m, they are deselected")


def pytest_configure(config):
    config.addinivalue_line("markers", "same_worker(group): run on the worker of its group")
    config.addinivalue_line("markers", "start_early(order): start before the rest, lowest first")


def _marks_in(node) -> list:
    """The `pytest.mark.same_worker(...)` calls in a decorator or a `pytestmark` value."""
    import ast

    values = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    return [value for value in values if isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute) and value.func.attr == "same_worker"]


def suite_files(directory: str = _TESTS) -> list[str]:
    """Every `test_*.py` under `directory` (tests/ and its folders, as tests/loop/), sorted
    by path. Their base names are unique (pytest's default import mode needs it), so a
    node id's file name alone names its module."""
    found = []
    for folder, subfolders, names in os.walk(directory):
        subfolders[:] = sorted(name for name in subfolders
                               if name not in ("support", "__pycache__") and not name.startswith("."))
        found += [os.path.join(folder, name) for name in names
                  if name.startswith("test_") and name.endswith(".py")]
    return sorted(found)


def same_worker_groups(directory: str = _TESTS) -> dict[str, str]:
    """node id prefix (`file.py::` or `file.py::test`, the file's base name) -> group,
    from the source of every test file under `directory`."""
    import ast

    groups = {}
    for path in suite_files(directory):
        name = os.path.basename(path)
        with open(path) as source:
            tree = ast.parse(source.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    getattr(target, "id", None) == "pytestmark" for target in node.targets):
                for mark in _marks_in(node.value):
                    groups[f"{name}::"] = mark.args[0].value
            elif isinstance(node, ast.FunctionDef):
                for decorator in node.decorator_list:
                    for mark in _marks_in(decorator):
                        groups[f"{name}::{node.name}"] = mark.args[0].value
    return groups


def _group_of(nodeid: str, groups: dict[str, str]) -> str:
    name = _name(nodeid)
    module, _, test = name.partition("::")
    test = test.split("[", 1)[0]
    return groups.get(f"{module}::{test}") or groups.get(f"{module}::") or nodeid


def _name(nodeid: str) -> str:
    return nodeid.rsplit("/", 1)[-1]


def _start_rank(item) -> tuple[int, int]:
    early = item.get_closest_marker("start_early")
    if early is not None:
        return 0, early.args[0]
    return (1 if item.get_closest_marker("slow") else 2), 0


def pytest_unconfigure(config):
    for own in (_OWN_XLA_CACHE, _OWN_CACHE, _OWN_TMP):  # the process that made it, after every worker
        if own:
            shutil.rmtree(own, ignore_errors=True)


# The default tier's time budget (12 minutes on 2 cores) leaves out these tests too: each
# is a costly variant whose promise a sibling in the default tier keeps (named after
# it), or an end-to-end run of what in-process tests cover. They run with --slow.
# An entry without "[...]" names every parameter of the test.
SLOW_TIER = {
    "serving/test_keras_saving.py::test_merged_exports_serve_the_trained_outputs":
        "trains a 2-replica LoRA model (module fixture); test_a_merged_copy_has_no_lora_and_the_same_outputs",
    "serving/test_keras_saving.py::test_a_kept_lora_saved_model_serves_the_factors_apart": "the same fixture",
    "serving/test_keras_saving.py::test_a_kept_lora_keras_file_is_the_base_beside_keras_hubs_factor_file":
        "the same fixture",
    "serving/test_keras_saving.py::test_int8_is_measured_against_float32_and_saved": "the same fixture",
    "loop/test_compile_cache.py::test_a_rerun_reads_the_programs_back_and_a_changed_model_compiles_anew":
        "four CLI runs; the suite itself runs on one shared persistent cache",
    "loop/test_compile_cache.py::test_tensorflow_started_before_tputrain_is_said_once": "a CLI run",
    "runtime/test_gcs.py::test_gs_model_dir_and_data_save_restore_and_resume_exactly":
        "an emulated bucket; test_missing_bucket_is_named_before_training",
    "tracking/test_mlflow_tracker.py::test_one_run_across_a_resume_with_no_step_twice":
        "three processes against MLflow; the tracker's in-process tests",
    "observe/test_console.py::test_the_cli_on_two_replicas_prints_plain_lines_once_and_no_noise":
        "a 2-replica CLI run; test_an_xla_run_prints_no_tensorflow_line",
    "observe/test_console.py::test_show_progress_false_silences_it": "a script run",
    "observe/test_console.py::test_tensorflow_imported_first_is_told_once_how_to_silence_its_start_up[tputrain]":
        "[keras]",
    "jobs/test_diagnose.py::test_steps_per_fetch_trains_and_resumes_bitwise_the_same":
        "test_trainer's steps_per_fetch resume",
    "fault_tolerance/test_guard.py::test_compute_gradients_replaced_on_the_instance_keeps_the_exact_check":
        "test_the_exact_check_where_the_loss_is_not_scaled[task0-guard_options0]",
    "fault_tolerance/test_guard.py::test_the_exact_check_where_the_loss_is_not_scaled[task1-guard_options1]":
        "[task0-guard_options0]",
    "fault_tolerance/test_guard.py::test_the_exact_check_where_the_loss_is_not_scaled[task2-guard_options2]":
        "[task0-guard_options0]",
    "fault_tolerance/test_guard.py::test_the_scaled_check_updates_bit_for_bit_as_without_a_guard[adamw-options7-kwargs7]":
        "[adam-options0-kwargs0]",
    "fault_tolerance/test_guard.py::test_a_skipped_step_leaves_batchnorm_statistics_as_they_were[1-auto]": "[2-auto]",
    "fault_tolerance/test_guard.py::test_raise_stops_inside_a_fetch_of_several_steps[1-2-several2]": "[2-5-several1]",
    "test_trainer.py::test_profile_steps_write_a_trace": "a profiler trace",
    "test_trainer.py::test_padded_eval_counts_every_example_once[1-host]": "[2-distributed]",
    "test_trainer.py::test_jit_compile_matches_uncompiled[1]": "[2]",
    "test_trainer.py::test_resume_continues_and_matches_uninterrupted":
        "test_resume.py's kill -9 resumes and test_train_twice_on_one_trainer_continues",
    "loop/test_remat.py::test_training_with_remat_gives_the_same_weights_and_flops[1-mixed_bfloat16]":
        "the float32 parameters",
    "loop/test_remat.py::test_gradients_are_those_without_remat[RematOptions(mode='larger_than', output_size_threshold=1000, layer_names=())-True]":
        "[activations-False], [full-False]",
    "loop/test_remat.py::test_gradients_are_those_without_remat[RematOptions(mode='list_of_layers', output_size_threshold=1024, layer_names=('logits', 'dense_1'))-True]":
        "[activations-False], [full-False]",
    "core/test_tracing.py::test_a_users_control_flow_is_converted_and_the_weights_are_those_of_lean_tracing_off[collective]":
        "[1]",
    "loop/test_step.py::test_steps_per_program_auto_and_where_it_applies":
        "test_steps_per_program_trains_bitwise_as_one_step_a_launch",
    "loop/test_step.py::test_a_guarded_nan_step_under_xla_changes_no_variable[float32-lamb-options3]":
        "the other optimizers' parameters",
    "loop/test_step.py::test_a_guarded_nan_step_under_xla_changes_no_variable[float32-adam-options1]":
        "the other optimizers' parameters",
    "loop/test_step.py::test_a_guarded_nan_step_under_xla_changes_no_variable[float32-adam-options6]":
        "the other optimizers' parameters",
    "loop/test_step.py::test_a_guarded_nan_step_under_xla_changes_no_variable[float32-adam-options5]":
        "the other optimizers' parameters",
    "loop/test_update.py::test_each_device_runs_the_scaled_check_in_its_update_bit_for_bit_as_the_exact":
        "test_guard's test_the_scaled_check_updates_bit_for_bit_as_without_a_guard",
    "loop/test_update.py::test_a_nonfinite_gradient_of_any_one_variable_skips_the_step[1]": "[0]",
    "loop/test_update.py::test_a_nonfinite_gradient_of_any_one_variable_skips_the_step[2]": "[0]",
    "loop/test_update.py::test_a_nonfinite_gradient_of_any_one_variable_skips_the_step[3]": "[0]",
    "loop/test_update.py::test_the_guard_skips_a_bad_step_on_every_device[<lambda>]": "[HugeTargetTask]",
    "loop/test_batch_norm.py::test_auto_runs_a_conv_nets_batch_norms_fused_on_onednn_and_trains_as_keras[1]": "[2]",
    "loop/test_replica_stats.py::test_every_replica_holds_the_global_batches_moving_mean[1]": "[2]",
    "loop/test_random_draws.py::test_onednn_enabled_follows_tf_enable_onednn_opts": "two subprocesses",
    "jobs/test_aggregation.py::test_each_named_eval_set_gets_its_own_host_side_metric":
        "test_two_replicas_f1_over_every_eval_example_once_equals_scikit_learn",
    "test_scalar_variables.py::test_scalar_and_one_element_variables_train_as_without_xla[lamb-update_on_each_device]":
        "the other plans' parameters",
    "test_token_loss.py::test_per_token_normalisation_is_the_same_on_1_2_and_4_replicas_and_with_micro_batches":
        "test_the_loss_is_the_mean_over_the_global_batchs_real_tokens on 1, 2 and 4 replicas",
    "optim/test_lars.py::test_two_replicas_match_one_device": "test_replica_equivalence (every optimizer option)",
    "data/test_mixture.py::test_a_mixture_with_an_empty_component_is_one_line_and_exit_2": "a CLI run",
    "data/test_writer.py::test_an_output_prefix_under_a_file_is_one_line_and_exit_2": "a CLI run",
    "data/test_data.py::test_the_cli_refuses_a_shuffled_empty_shard_in_one_line_and_exit_2": "a CLI run",
    "data/test_augment.py::test_random_augmentation_trains_and_resumes_with_one_warning[tf_image_and_random-named1]":
        "its other parameters",
    "observe/test_console.py::test_a_script_that_sets_up_first_shows_the_strategy_each_loop_and_no_noise":
        "test_a_plain_script_shows_progress_without_absl_prefixes",
    "actions/test_init_checkpoint.py::test_a_resumed_run_keeps_its_own_weights":
        "test_b_starts_from_a_backbone_and_the_log_names_what_was_not_loaded",
    "loop/test_update.py::test_the_guard_raises_with_the_weights_before_the_bad_step":
        "test_guard's raise tests",
    "observe/test_goodput.py::test_the_goodput_command_prints_the_account_and_fails_without_records":
        "the in-process account tests",
    "test_trainer.py::test_the_default_strategy_trains_like_one_device": "test_replica_equivalence",
    "test_trainer.py::test_replicas_match_single_device": "test_replica_equivalence (every option)",
    "checkpointing/test_checkpoint.py::test_a_damaged_state_file_with_no_checkpoint_files_starts_over":
        "test_a_damaged_state_file_resumes_from_the_files_and_keeps_them",
    "fault_tolerance/test_guard.py::test_the_scaled_check_skips_a_nan_and_an_overflowing_square[1e+30]":
        "[nan]",
    "loop/test_update.py::test_gradients_crossing_in_float16_keep_the_exact_check":
        "test_guard's test_a_model_computing_in_float16_keeps_the_exact_check[mixed_float16]",
    "jobs/test_diagnose.py::test_diagnose_on_the_real_clock_reports_what_sleeps_guarantee":
        "the diagnose tests on a test-owned clock",
    "serving/test_keras_saving.py::test_the_export_command_refuses_an_unknown_quantization_in_one_line":
        "test_quantize_refuses_an_unknown_mode",
    "tasks/test_keras_hub_lm.py::test_a_resumed_run_is_bitwise_the_uninterrupted_one":
        "test_resume.py's kill -9 resumes of the built-in tasks",
    "test_trainer.py::test_mfu_and_throughput_in_logs_and_tensorboard":
        "observe/test_goodput.py's test_a_trainer_keeps_a_record_per_process_and_tensorboard_scalars",
    "checkpointing/test_checkpoint.py::test_a_learning_rate_set_between_train_calls_is_kept":
        "test_a_changed_learning_rate_wins_over_the_checkpoint",
    "actions/test_best.py::test_best_checkpoint_resumes_comparing_against_the_kept_best":
        "test_early_stopping_resumes_from_the_evals_up_to_the_restored_step",
    "test_trainer.py::test_gradient_accumulation_matches_one_large_batch":
        "test_replica_equivalence's accumulation option",
    "data/test_positional.py::test_every_record_of_an_epoch_once_over_the_hosts_and_epochs_differ":
        "each record once: test_every_record_of_an_epoch_once_through_2_3_1_hosts_and_batches_64_48_96 "
        "(that epochs differ is checked here only)",
}


def _mark_slow_tier(config, items) -> None:
    """Marks SLOW_TIER's tests `slow`. When the whole tests/ folder was collected (the
    README's command), an entry that names no collected test is an error: a renamed test or
    parameter must not leave the list unseen."""
    matched = set()
    for item in items:
        name = item.nodeid.split("tests/", 1)[-1]
        for key in (name, name.split("[", 1)[0]):
            if key in SLOW_TIER:
                item.add_marker(pytest.mark.slow)
                matched.add(key)
    whole = any(os.path.isdir(arg) and os.path.samefile(arg, _TESTS) for arg in config.args
                ) and not config.getoption("keyword")
    if whole and set(SLOW_TIER) - matched:
        raise pytest.UsageError("conftest.SLOW_TIER names tests that were not collected: "
                                f"{sorted(set(SLOW_TIER) - matched)}")


def pytest_collection_modifyitems(config, items):
    """The default run leaves out the `slow` tier (`--slow`, or any `-m`, keeps it), then
    orders the rest (`_start_rank`)."""
    _mark_slow_tier(config, items)
    if not config.getoption("--slow") and not config.getoption("markexpr"):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    items.sort(key=_start_rank)  # stable: collection order within a rank


def pytest_xdist_make_scheduler(config, log):
    """Under `-n N` (xdist's default `--dist load`): each `same_worker` group is one unit,
    every other test its own, queued in collection order. An explicit --dist wins."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups = same_worker_groups()

    class SameWorkerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid, groups)

    config.option.loadscopereorder = False  # keep start_early's order, not group sizes
    return SameWorkerScheduling(config, log)


# `TPUTRAIN_TEST_CPU_LOG=path` appends each test's CPU seconds (this process and the
# child processes it waited for), wall seconds, node id and the children's CPU seconds
# to `path`, one line a test:
# the default tier is CPU-bound on 2 cores, so its time is cut where the CPU goes.
_CPU_LOG = os.environ.get("TPUTRAIN_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    import resource
    import time

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    own0, children0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    wall0 = time.monotonic()
    yield
    own, children = cpu(resource.RUSAGE_SELF) - own0, cpu(resource.RUSAGE_CHILDREN) - children0
    with open(_CPU_LOG, "a") as log:
        log.write(f"{own + children:.1f} {time.monotonic() - wall0:.1f} {item.nodeid} "
                  f"{children:.1f}\n")


@pytest.fixture(autouse=True)
def _float32_policy():
    """Each test starts (and leaves) the global Keras precision policy at float32."""
    import keras

    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True)
def _clear_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="session")
def one_replica(tmp_path_factory):
    """Every optimizer option trained on 1 replica: the reference of both
    test_replica_equivalence.py and test_replica_equivalence_multiworker.py (one
    `same_worker` group, so one worker computes it once)."""
    from equivalence import train_one_replica

    return train_one_replica(tmp_path_factory.mktemp("one_replica"))


@pytest.fixture(scope="session")
def readme_digits(tmp_path_factory):
    """README command 1, `tputrain --gin_file=digits.gin --model_dir=...` (1200 steps of
    digits), run once for test_run.py and test_export.py (one `same_worker` group): (the
    directory holding model/ and the data cache cache/, the finished process)."""
    root = tmp_path_factory.mktemp("readme_digits")
    env = dict(os.environ, TPUTRAIN_CACHE_DIR=str(root / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    for name in ("TF_CONFIG", "AIP_MODEL_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "tputrain.run", "--gin_file=digits.gin",
                             f"--model_dir={root / 'model'}"],
                            env=env, capture_output=True, text=True, timeout=300, cwd=root)
    return root, result


@pytest.fixture(autouse=True)
def _close_trainers(monkeypatch):
    """Every Trainer a test builds is closed when the test ends (`Trainer.close`), so its
    tf.data iterators end at a known point: freed later by the garbage collector, inside
    another test, an old iterator's end waited up to a minute on tf.data's autotuning
    thread (measured in this suite), with the worker's core idle.

    A Trainer is recorded when its construction completes (`Trainer._launch`, its last
    step): one that refused its arguments has nothing to close. (Not `__init__`: gin
    validates bindings against its signature.)"""
    import weakref

    from tputrain.trainer import Trainer

    built = weakref.WeakSet()
    launch = Trainer._launch

    def recording_launch(self, *args, **kwargs):
        launch(self, *args, **kwargs)
        built.add(self)

    monkeypatch.setattr(Trainer, "_launch", recording_launch)
    yield
    for trainer in list(built):
        trainer.close()
