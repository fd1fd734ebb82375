"""Regenerates docs/performance.md's benchmark table from benchmarks/results/.

    python benchmarks/train_loop.py --repeats 5   # writes benchmarks/results/<today>-train_loop.json
    python benchmarks/report.py                   # rewrites the page between its markers
    python benchmarks/report.py --check           # exit 1 if the page is stale

One row a result file (`<date>-<benchmark>[-<tag>].json`) by date: its headline
ratios against their goals and the machine's load average where the run
recorded it; then the last training-loop result in that order, in full. Rows are never
edited by hand: tests/test_benchmark_report.py checks that the page is what this
script generates.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-([a-z_]+)(?:-([A-Za-z0-9_]+))?\.json$")
LABELS = {
    "tputrain": "tputrain, defaults (jit_compile auto, guard on)",
    "tputrain_no_xla": "tputrain, jit_compile=False",
    "tputrain_no_guard": "tputrain, guard off",
    "tputrain_no_xla_no_guard": "tputrain, jit_compile=False, guard off",
    "hand_loop": "hand-written loop",
    "keras_fit": "Keras `fit` (its defaults)",
    "keras_fit_xla": "Keras `fit`, XLA",
    "hand_loop_no_strategy": "hand-written loop, no strategy",
    "keras_fit_no_strategy": "Keras `fit`, no strategy",
    "keras_fit_xla_no_strategy": "Keras `fit`, XLA, no strategy",
    "orbit": "Orbit",
    "tputrain_bf16": "tputrain, mixed_bfloat16",
    "tputrain_program_1": "tputrain, one step per XLA launch (steps_per_program=1)",
    "tputrain_xla": "tputrain, jit_compile=True",
    "tputrain_fit": "`tputrain.fit` on the compiled Keras model (its defaults)",
}
# The training loop's headline goals: (goal names, the first present wins), label.
HEADLINE_GOALS = [
    (("mlp.tputrain_best_vs_keras_fit_best",), "MLP vs `fit` at its best"),
    (("transformer.tputrain_best_vs_keras_fit_best",), "Transformer vs `fit` at its best"),
    (("mlp.tputrain_vs_tputrain_no_guard",), "MLP guard on vs off"),
    (("transformer.tputrain_vs_tputrain_no_guard",), "Transformer guard on vs off"),
    (("mlp.tputrain_vs_hand_loop_best", "mlp.tputrain_vs_hand_loop"), "MLP vs hand loop"),
    (("transformer.tputrain_vs_hand_loop_best", "transformer.tputrain_vs_hand_loop"),
     "Transformer vs hand loop"),
    (("transformer.bf16_vs_float32",), "bf16 vs float32"),
    (("conv.tputrain_best_vs_keras_fit_best",), "Conv net vs `fit` at its best"),
    (("conv.tputrain_vs_hand_loop_best", "conv.tputrain_vs_hand_loop"), "Conv net vs hand loop"),
    (("conv.tputrain_vs_orbit",), "Conv net vs Orbit"),
    (("mobilenet.tputrain_best_vs_keras_fit_best",), "MobileNet vs `fit` at its best"),
    (("mobilenet.tputrain_fit_vs_keras_fit_best",), "MobileNet `tputrain.fit` vs `fit` at its best"),
    (("efficientnetb0.tputrain_best_vs_keras_fit_best",), "EfficientNetB0 vs `fit` at its best"),
    (("efficientnetb0.tputrain_fit_vs_keras_fit_best",),
     "EfficientNetB0 `tputrain.fit` vs `fit` at its best"),
]
# Issue 55's grid (`grid`): these workloads' training-loop results from this date on,
# the latest a (CPU, emulation, workload, replicas, precision).
GRID_WORKLOADS = ("mobilenet", "efficientnetb0", "conv", "mlp", "transformer")
GRID_SINCE = "2026-11-29"
FIT_CONFIGURATIONS = {"keras_fit": "strategy", "keras_fit_xla": "strategy, XLA",
                      "keras_fit_no_strategy": "no strategy",
                      "keras_fit_xla_no_strategy": "no strategy, XLA"}
RESUME_RATIOS = {"exact_resume_vs_skip_resume_cpu": "exact resume on vs off",
                 "guard_on_vs_off_cpu": "guard on vs off",
                 "update_on_each_device_vs_tensorflow_kernels_cpu":
                     "update on each device vs TF kernels"}
COMMUNICATION_RATIOS = {"mirrored.2_replicas_bf16_vs_fp32": "2 split-CPU replicas",
                        "mirrored.4_replicas_bf16_vs_fp32": "4 split-CPU replicas",
                        "workers_2.pack_0_bf16_vs_fp32": "2 workers",
                        "workers_4.pack_0_bf16_vs_fp32": "4 workers"}


def parse_name(path: pathlib.Path) -> tuple[str, str, str]:
    """(date, benchmark, tag) of a result file; tag "" when it has none."""
    match = NAME.match(path.name)
    if not match:
        raise ValueError(f"{path.name}: a result file is named <YYYY-MM-DD>-<benchmark>[-<tag>].json")
    return match.group(1), match.group(2), match.group(3) or ""


def result_files(folder: pathlib.Path) -> list[tuple[pathlib.Path, dict[str, Any]]]:
    """Every result, by the name's date, then the time the run recorded
    (older files have none), then the name."""
    results = [(path, json.loads(path.read_text())) for path in folder.glob("*.json")]
    return sorted(results, key=lambda item: (parse_name(item[0])[0],
                                             str(item[1].get("date", "")), item[0].name))


def judged(value: float, goal: float) -> str:
    return f"{value:.3f} (goal {goal}: {'met' if value >= goal else 'not met'})"


def train_loop_headlines(report: dict[str, Any]) -> list[str]:
    """CPU-time ratios (the goals are judged on them: other jobs disturb them less)."""
    cells = []
    for names, label in HEADLINE_GOALS:
        goal = next((report["goals"][n] for n in names if n in report["goals"]), None)
        if goal:
            value = goal.get("measured_cpu_time") or goal["measured"]
            cells.append(f"{label} {judged(value, goal['goal'])}")
    return cells


def resume_headlines(report: dict[str, Any]) -> list[str]:
    ratios, goals = report["ratios"], report.get("goal", {})
    cells = []
    for name, wanted in goals.items():
        if name in ratios:
            bound = float(str(wanted).lstrip(">= "))
            cells.append(f"{name.replace('_', ' ')} (wall) {judged(ratios[name], bound)}")
    cells += [f"{label} (CPU) {ratios[name]:.3f}" for name, label in RESUME_RATIOS.items()
              if name in ratios]
    return cells


def remat_headlines(report: dict[str, Any]) -> list[str]:
    """Per plan (XLA, executor): memory and CPU time with remat over without."""
    cells = []
    for plan, result in report["plans"].items():
        ratios = result["ratios_remat_over_none"]
        cells.append(f"{plan}: remat / no remat, peak RSS {ratios['peak_rss_mib']:.2f}, "
                     f"step peak {ratios['step_peak_mib']:.2f}, "
                     f"CPU time {ratios['step_cpu_seconds']:.2f}")
    return cells


def restart_headlines(report: dict[str, Any]) -> list[str]:
    """Per config: a rerun's start-to-first-loop and compile time, each case over
    `neither` (cache and lean tracing off); an older file: cache over no cache."""
    lines = []
    for result in report["results"]:
        if "ratios_vs_neither" not in result:
            lines.append(f"{result['config']}: with cache / without, to first loop "
                         f"{result['ratio_to_first_loop']:.2f}, compile {result['ratio_compile']:.2f}")
            continue
        lines += [f"{result['config']}: {case} / neither, to first loop "
                  f"{ratios['to_first_loop']:.2f}, compile {ratios['compile']:.2f}, "
                  f"start-up {ratios['startup']:.2f}, " + (
                      f"CPU to first loop {ratios['cpu_to_first_loop']:.2f}"
                      if "cpu_to_first_loop" in ratios else
                      f"whole-process CPU {ratios['process_cpu']:.2f}")
                  for case, ratios in result["ratios_vs_neither"].items()]
    return lines


def guard_cost_headlines(report: dict[str, Any]) -> list[str]:
    """Per setup (replicas or workers, workload): guard on over off, paired CPU time."""
    return [f"{setup} guard on vs off (CPU, paired) "
            f"{judged(result['guard_on_vs_off_cpu_paired'], report['goal'])}"
            for setup, result in report["setups"].items()]


def exit_time_headlines(report: dict[str, Any]) -> list[str]:
    """Per case: seconds from the last line to the exit against the bound (Keras
    `fit`'s own beside them), and the processor kind."""
    cells = [f"{case} {goal['seconds']:.2f} s (bound {goal['bound']:.2f}: "
             f"{'met' if goal['met'] else 'not met'})" for case, goal in report["goals"].items()]
    fit = report["cases"].get("keras_model_fit")
    if fit:
        cells.append(f"keras_model_fit {fit['last_line_to_exit_median']:.2f} s")
    cpu = report.get("machine", {}).get("cpu", {})
    cells.append("AVX-512" if cpu.get("avx512") else "no AVX-512")
    return cells


def headlines(report: dict[str, Any]) -> list[str]:
    """The few ratios a reader compares across runs, by what the result holds."""
    if report.get("benchmark") == "guard_cost":
        return guard_cost_headlines(report)
    if report.get("benchmark") == "exit_time":
        return exit_time_headlines(report)
    if report.get("benchmark") == "keras_inputs":  # old pipeline's CPU a batch over the new
        return [f"{name.replace('_', ' ')}: unbatch+batch / rebatch CPU a batch "
                f"{result['unbatch_batch_vs_keras_task_cpu']:.2f}"
                for name, result in report["results"].items()]
    if "max_over_min" in report:  # resume_time --positions: first batch, max/min CPU over positions
        return [f"first batch max/min CPU, {mode} {value:.2f}"
                for mode, value in report["max_over_min"].items()]
    goals = report.get("goals", {})
    if any(isinstance(goal, dict) for goal in goals.values()):  # train_loop: measured ratios
        return train_loop_headlines(report)
    if "workloads" in report and not goals:  # train_loop between tputrain's own plans
        return [f"{workload}.{name} (CPU, paired) {value:.3f}"
                for workload, result in report["workloads"].items()
                for name, value in result.get("ratios_cpu_time_paired", {}).items()]
    if goals:  # input_pipeline: each goal's statement, met or not
        return [f"{goal}: {'met' if met else 'not met'}" for goal, met in report["goals"].items()]
    if "late_vs_early" in report:
        return [f"late vs early resume, {mode} {value:.2f}"
                for mode, value in report["late_vs_early"].items()]
    if "goal" in report:
        return resume_headlines(report)
    if report.get("benchmark") == "remat" and "plans" in report:
        return remat_headlines(report)
    if report.get("benchmark") == "restart_compile":
        return restart_headlines(report)
    if report.get("benchmark") == "compile_replicas":  # N replicas over 1, medians
        return [f"{name} N/1 replicas: compile {ratio['compile']:.2f}x, "
                f"train() CPU {ratio['train_cpu']:.2f}x"
                for name, ratio in report["ratios_n_over_1"].items()]
    if "ratios_remat_over_none" in report:
        ratios = report["ratios_remat_over_none"]
        return [f"remat / no remat, peak RSS {ratios['peak_rss_mib']:.2f}",
                f"remat / no remat, step time {ratios['step_seconds']:.2f}"]
    return [f"bf16 vs fp32 all-reduce, {label}: {report['ratios'][name]['steps_per_cpu_second']:.2f}"
            for name, label in COMMUNICATION_RATIOS.items() if name in report.get("ratios", {})]


def load_average(report: dict[str, Any]) -> str:
    """The 1-minute load average before / after the run, where it was recorded."""
    machine = report.get("machine") or report.get("environment") or report
    if "load_before" in machine:  # restart_compile: the os.getloadavg() triples
        machine = {"load_average_before": machine["load_before"],
                   "load_average_after": machine["load_after"]}
    if isinstance(machine.get("load_average_1min"), dict):  # remat: over the run
        return "{min:.1f}-{max:.1f}".format(**machine["load_average_1min"])
    values = [machine.get(f"load_average_{when}") for when in ("before", "after")]
    values = [v[0] if isinstance(v, list) else v for v in values]
    return " / ".join(f"{v:.1f}" for v in values if v is not None) or "-"


def table(folder: pathlib.Path = RESULTS) -> str:
    lines = ["| date | benchmark | tag | headline ratios (> 1: the first is faster) | load average |",
             "|---|---|---|---|---|"]
    for path, report in result_files(folder):
        date, benchmark, tag = parse_name(path)
        lines.append(f"| {date} | {benchmark} | {tag or '-'} | {'<br>'.join(headlines(report))} "
                     f"| {load_average(report)} |")
    return "\n".join(lines)


def kind_label(flags: str | None) -> str:
    """The instruction sets that decide which plan wins, from `lscpu`'s flags."""
    if flags is None:
        return "flags not recorded"
    names = set(flags.split())
    if "amx_bf16" in names:
        return "AMX"
    if "avx512f" in names:
        return "AVX-512"
    return "AVX2" if "avx2" in names else "no AVX2"


def day_flags(results: list[tuple[pathlib.Path, dict[str, Any]]]) -> dict[tuple[str, str], str]:
    """(date, CPU name) -> the flags its files of that day recorded, where they agree: a
    file of that day that recorded none ran on the same machine."""
    seen: dict[tuple[str, str], set[str]] = {}
    for path, report in results:
        machine = report.get("machine", {})
        if machine.get("cpu_flags") is not None:
            key = (parse_name(path)[0], machine.get("cpu", "-"))
            seen.setdefault(key, set()).add(machine["cpu_flags"])
    return {key: next(iter(flags)) for key, flags in seen.items() if len(flags) == 1}


def _grid_cells(path: pathlib.Path, report: dict[str, Any],
                flags_of_day: dict[tuple[str, str], str]) -> dict[tuple, str]:
    """One grid row a workload of the file: keyed (CPU and its kind, workload, replicas,
    precision)."""
    machine, goals, cells = report.get("machine", {}), report.get("goals", {}), {}
    name_of_cpu = machine.get("cpu", "-")
    flags = machine.get("cpu_flags", flags_of_day.get((parse_name(path)[0], name_of_cpu)))
    cpu = f"{name_of_cpu} ({kind_label(flags)})" + (
        f", emulating {machine['emulation']}" if machine.get("emulation") else "")
    for name in GRID_WORKLOADS:
        result = report.get("workloads", {}).get(name)
        if not result or f"{name}.tputrain_best_vs_keras_fit_best" not in goals:
            continue
        ratios = [goals.get(f"{name}.{key}_vs_keras_fit_best", {}).get("measured_cpu_time_paired")
                  for key in ("tputrain_best", "tputrain_fit")]
        fits = {n: result[n] for n in FIT_CONFIGURATIONS if "steps_per_cpu_second" in result.get(n, {})}
        best = max(fits, key=lambda n: fits[n]["steps_per_cpu_second"])
        key = (cpu, GRID_WORKLOADS.index(name), result["replicas"], result["precision"])
        cells[key] = " | ".join([
            cpu, name, str(result["replicas"]), result["precision"],
            *[f"{r:.2f}" + ("" if r >= 1.0 else " (loss)") if r else "-" for r in ratios],
            f"{FIT_CONFIGURATIONS[best]}, {fits[best]['best_steps_per_call']} steps a call "
            f"(of {len(fits)})", result.get("tputrain_xla_plan", "-").replace("|", "\\|"),  # a trial's table
            str(result["repeats"]),
            load_average(report), f"`{path.name}`"])
    return cells


def grid(folder: pathlib.Path = RESULTS) -> str:
    """Issue 55's grid: tputrain's defaults and `tputrain.fit` over Keras `fit` at its best
    (CPU time, paired: the median over rounds of the within-round ratio), a row group
    for each CPU and kind (`kind_label`)."""
    cells: dict[tuple, str] = {}
    results = result_files(folder)
    flags_of_day = day_flags(results)
    for path, report in results:
        date, benchmark, _ = parse_name(path)
        if benchmark == "train_loop" and date >= GRID_SINCE:
            cells.update(_grid_cells(path, report, flags_of_day))  # a later file replaces the cell
    lines = ["| CPU | workload | replicas | precision | tputrain / `fit` at its best | "
             "`tputrain.fit` / `fit` at its best | `fit`'s best | tputrain's XLA plan | rounds "
             "| load average | file |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {cells[key]} |" for key in sorted(cells)])


def contender_rows(workload: dict[str, Any]) -> list[str]:
    rows = []
    for name, label in LABELS.items():
        result = workload.get(name, {})
        if "steps_per_second" in result:
            rows.append(f"| | {label} | {result['best_steps_per_call']} | "
                        f"{result['steps_per_second']:.3g} | {result['steps_per_cpu_second']:.3g} |")
    return rows


def goal_rows(report: dict[str, Any]) -> list[str]:
    lines = [("| ratio | measured (wall) | CPU time | CPU time, paired | goal | "
              "met (wall / CPU / paired) |"), "|---|---|---|---|---|---|"]
    for key, goal in report["goals"].items():
        cells, met = [], ["yes" if goal["met"] else "no"]
        for field in ("measured_cpu_time", "measured_cpu_time_paired"):
            value = goal.get(field)
            cells.append(f"{value:.3f}" if value else "-")
            met.append("-" if not value else ("yes" if value >= goal["goal"] else "no"))
        lines.append(f"| {key} | {goal['measured']:.3f} | {' | '.join(cells)} | {goal['goal']} | "
                     f"{' / '.join(met)} |")
    return lines


def detail(path: pathlib.Path, report: dict[str, Any]) -> str:
    """One training-loop result in full: every contender's rates and every goal."""
    machine = report["machine"]
    lines = [(f"`{path.name}`: `{report['command']}`; TensorFlow {machine['tensorflow']}, "
              f"Keras {machine['keras']}, {machine['cores']} cores, load average "
              f"{load_average(report)} (before / after)."), "",
             "| workload | contender | best steps/call | steps/s (median) | steps per CPU-s |",
             "|---|---|---|---|---|"]
    for name, workload in report["workloads"].items():
        rows = contender_rows(workload)
        if rows:
            rows[0] = rows[0].replace("| |", f"| {workload.get('model', name)} |", 1)
        lines += rows
    return "\n".join(lines + [""] + goal_rows(report))


def replace_between(text: str, marker: str, body: str) -> str:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def render(text: str, folder: pathlib.Path = RESULTS) -> str:
    """`text` (the page) with the table and the latest training-loop detail regenerated."""
    text = replace_between(text, "results", table(folder))
    text = replace_between(text, "grid", grid(folder))
    loops = [(path, report) for path, report in result_files(folder)
             if parse_name(path)[1].startswith("train_loop")]
    return replace_between(text, "train_loop_latest", detail(*loops[-1])) if loops else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = PAGE.read_text()
    new = render(text)
    if args.check:
        print("up to date" if new == text else f"{PAGE} is stale: run python benchmarks/report.py")
        return int(new != text)
    PAGE.write_text(new)
    print(f"rewrote {PAGE} from {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
