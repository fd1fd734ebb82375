"""benchmarks/report.py: the benchmark table in docs/performance.md is generated from
benchmarks/results/ (one dated file a run), so the page cannot drift from the results."""

import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z_]+(-[A-Za-z0-9_]+)?\.json$")


def load(name: str):
    """A script of benchmarks/ (outside the package), imported by its path."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def test_the_page_holds_the_table_report_generates_from_the_results():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert load("report").render(page, RESULTS) == page, (
        "docs/performance.md is stale: run `python benchmarks/report.py`")


def test_every_result_file_is_dated_and_has_its_row():
    table = load("report").table(RESULTS)
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        assert NAME.match(path.name), path.name
        date, benchmark, tag = load("report").parse_name(path)
        assert f"| {date} | {benchmark} | {tag or '-'} |" in table
        assert load("report").headlines(json.loads(path.read_text())), (
            f"{path.name}: report.py finds no headline ratio in it")


def test_no_benchmark_json_is_kept_outside_the_results_folder():
    assert not list((ROOT / "docs").rglob("*.json"))


def test_a_row_gives_the_headline_ratios_against_their_goals_and_the_load(tmp_path):
    goal = {"measured": 0.95, "measured_cpu_time": 1.012, "goal": 1.0, "met": False}
    guard = {"measured": 0.99, "measured_cpu_time": 0.97, "goal": 0.99, "met": True}
    (tmp_path / "2030-01-02-train_loop-abc1234.json").write_text(json.dumps({
        "machine": {"load_average_before": [1.5, 1, 1], "load_average_after": [2.25, 1, 1]},
        "goals": {"mlp.tputrain_best_vs_keras_fit_best": goal,
                  "mlp.tputrain_vs_tputrain_no_guard": guard}}))
    (tmp_path / "2030-01-01-resume_time.json").write_text(json.dumps({
        "late_vs_early": {"host": 1.03, "distributed": 1.47}}))
    (tmp_path / "2030-01-03-input_pipeline.json").write_text(json.dumps({
        "load_average_before": [0.5, 1, 1], "goals": {"tfrecord_input_vs_naive >= 3": True}}))
    rows = [line for line in load("report").table(tmp_path).splitlines()
            if line.startswith("| 2030")]
    assert rows[0].startswith("| 2030-01-01 | resume_time | - |") and "1.47" in rows[0]
    assert rows[1].startswith("| 2030-01-02 | train_loop | abc1234 |")
    # judged on CPU time: 1.012 meets 1.0 although the wall-clock ratio did not
    assert "1.012 (goal 1.0: met)" in rows[1] and "0.970 (goal 0.99: not met)" in rows[1]
    assert rows[1].endswith("| 1.5 / 2.2 |")
    assert rows[2] == ("| 2030-01-03 | input_pipeline | - | tfrecord_input_vs_naive >= 3: met "
                       "| 0.5 |")


def test_a_remat_row_gives_each_plans_memory_ratios_and_the_load(tmp_path):
    ratios = {"xla": {"peak_rss_mib": 0.9, "step_peak_mib": 0.48, "step_cpu_seconds": 1.25},
              "executor": {"peak_rss_mib": 0.6, "step_peak_mib": 0.41, "step_cpu_seconds": 1.1}}
    (tmp_path / "2030-01-01-remat-b8.json").write_text(json.dumps({
        "benchmark": "remat", "load_average_1min": {"min": 3.25, "max": 9.5},
        "plans": {plan: {"ratios_remat_over_none": r} for plan, r in ratios.items()}}))
    row = load("report").table(tmp_path).splitlines()[-1]
    assert row == ("| 2030-01-01 | remat | b8 | xla: remat / no remat, peak RSS 0.90, step peak "
                   "0.48, CPU time 1.25<br>executor: remat / no remat, peak RSS 0.60, step peak "
                   "0.41, CPU time 1.10 | 3.2-9.5 |")


def test_a_script_writes_its_result_to_a_dated_file_without_overwriting(tmp_path):
    results = load("result_file")
    today = datetime.date.today().isoformat()
    first = results.write({"ratios": {}}, None, "resume", folder=tmp_path)
    second = results.write({"ratios": {}}, None, "resume", tag="quiet", folder=tmp_path)
    third = results.write({"ratios": {}}, None, "resume", folder=tmp_path)
    assert [first.name, second.name, third.name] == [
        f"{today}-resume.json", f"{today}-resume-quiet.json", f"{today}-resume-run2.json"]
    assert json.loads(first.read_text())["date"].startswith(today)


def test_a_restart_row_gives_the_cache_ratios_per_config_and_the_load(tmp_path):
    (tmp_path / "2030-01-01-restart_compile.json").write_text(json.dumps({
        "benchmark": "restart_compile", "load_before": [1.5, 1, 1], "load_after": [2.0, 1, 1],
        "results": [{"config": "digits.gin", "ratio_to_first_loop": 0.61,
                     "ratio_compile": 0.4}]}))
    row = load("report").table(tmp_path).splitlines()[-1]
    assert row == ("| 2030-01-01 | restart_compile | - | digits.gin: with cache / without, "
                   "to first loop 0.61, compile 0.40 | 1.5 / 2.0 |")


def test_a_guard_cost_row_gives_each_setups_paired_ratio_against_the_goal(tmp_path):
    setups = {"replica_1.mlp": {"guard_on_vs_off_cpu_paired": 0.996},
              "workers_2.mlp": {"guard_on_vs_off_cpu_paired": 0.9812}}
    (tmp_path / "2030-01-01-guard_cost.json").write_text(json.dumps({
        "benchmark": "guard_cost", "goal": 0.99, "setups": setups,
        "machine": {"load_average_1min": {"min": 2.0, "max": 4.5}}}))
    row = load("report").table(tmp_path).splitlines()[-1]
    assert row == ("| 2030-01-01 | guard_cost | - | replica_1.mlp guard on vs off (CPU, paired) "
                   "0.996 (goal 0.99: met)<br>workers_2.mlp guard on vs off (CPU, paired) "
                   "0.981 (goal 0.99: not met) | 2.0-4.5 |")


def _grid_result(ours: float, fit: float | None, load: float, emulation: str = "",
                 cpu: str = "Xeon", flags: str | None = None) -> dict:
    """A train_loop result of the MobileNet on 2 replicas in bf16, as the grid reads it."""
    goals = {"mobilenet.tputrain_best_vs_keras_fit_best": {"measured_cpu_time_paired": ours}}
    if fit is not None:
        goals["mobilenet.tputrain_fit_vs_keras_fit_best"] = {"measured_cpu_time_paired": fit}
    machine = {"cpu": cpu, "load_average_before": [load, 1, 1],
               "load_average_after": [load, 1, 1], **({"emulation": emulation} if emulation else {}),
               **({"cpu_flags": flags} if flags is not None else {})}
    fits = {"keras_fit": {"steps_per_cpu_second": 2.0, "best_steps_per_call": 10},
            "keras_fit_xla": {"steps_per_cpu_second": 3.0, "best_steps_per_call": 20}}
    return {"machine": machine, "goals": goals, "workloads": {"mobilenet": {
        "replicas": 2, "precision": "mixed_bfloat16", "repeats": 5,
        "tputrain_xla_plan": "auto: off", **fits}}}


def test_the_grid_has_the_latest_cell_per_cpu_with_fits_best_and_losses_marked(tmp_path):
    for name, result in (("2030-01-01-train_loop-old", _grid_result(0.5, 0.5, 9.0)),
                         ("2030-01-02-train_loop-new", _grid_result(1.234, 0.987, 2.0)),
                         ("2030-01-02-train_loop-emu", _grid_result(1.1, None, 3.0, "X=1")),
                         ("2020-01-02-train_loop-before", _grid_result(2.0, 2.0, 1.0))):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    report = load("report")
    original, report.GRID_SINCE = report.GRID_SINCE, "2030-01-01"
    try:
        rows = report.grid(tmp_path).splitlines()[2:]
    finally:
        report.GRID_SINCE = original
    assert rows == [
        "| Xeon (flags not recorded) | mobilenet | 2 | mixed_bfloat16 | 1.23 | 0.99 (loss) | "
        "strategy, XLA, 20 steps a call (of 2) | auto: off | 5 | 2.0 / 2.0 | "
        "`2030-01-02-train_loop-new.json` |",
        "| Xeon (flags not recorded), emulating X=1 | mobilenet | 2 | mixed_bfloat16 | 1.10 | - "
        "| strategy, XLA, 20 steps a call (of 2) | auto: off | 5 | 3.0 / 3.0 | "
        "`2030-01-02-train_loop-emu.json` |"]


def test_one_cpu_name_of_two_kinds_has_a_row_each_and_a_flagless_file_its_days_kind(tmp_path):
    """An AVX2-only AMD EPYC and an AVX-512 one are machines of two kinds: keyed on the
    name only, one's cell replaced the other's. A file that recorded no flags takes
    those its CPU's other files of the same day recorded, when they agree."""
    for name, result in (
            ("2030-01-01-train_loop-avx2", _grid_result(1.1, 1.0, 1.0, cpu="EPYC",
                                                        flags="avx2")),
            ("2030-01-02-train_loop-avx512", _grid_result(1.2, 1.0, 1.0, cpu="EPYC",
                                                          flags="avx512f avx2")),
            ("2030-01-02-train_loop-amx", _grid_result(1.3, 1.0, 1.0, cpu="Xeon",
                                                       flags="avx512f amx_bf16 avx2")),
            ("2030-01-02-train_loop-flagless", _grid_result(1.4, 1.0, 1.0, cpu="Xeon"))):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    report = load("report")
    original, report.GRID_SINCE = report.GRID_SINCE, "2030-01-01"
    try:
        rows = [row.split(" | ")[:5] for row in report.grid(tmp_path).splitlines()[2:]]
    finally:
        report.GRID_SINCE = original
    assert rows == [["| EPYC (AVX-512)", "mobilenet", "2", "mixed_bfloat16", "1.20"],
                    ["| EPYC (AVX2)", "mobilenet", "2", "mixed_bfloat16", "1.10"],
                    ["| Xeon (AMX)", "mobilenet", "2", "mixed_bfloat16", "1.40"]]
