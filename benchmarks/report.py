"""Regenerates the training-loop sections of docs/performance.md from the benchmark JSON.

    python benchmarks/train_loop.py --repeats 5 > docs/benchmarks/train_loop.json
    python benchmarks/train_loop.py --fresh --repeats 5 ... > docs/benchmarks/train_loop_fresh.json
    python benchmarks/report.py    # rewrites each section between its markers

Each JSON in SECTIONS that exists is rendered between its own pair of markers.
"""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = {"train_loop": "docs/benchmarks/train_loop.json",
            "train_loop_fresh": "docs/benchmarks/train_loop_fresh.json",
            "train_loop_no_strategy": "docs/benchmarks/train_loop_no_strategy.json"}
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
}


def contender_rows(workload: dict) -> list[str]:
    rows = []
    for name, label in LABELS.items():
        result = workload.get(name, {})
        if "steps_per_second" in result:
            rows.append(f"| | {label} | {result['best_steps_per_call']} | "
                        f"{result['steps_per_second']:.3g} | {result['steps_per_cpu_second']:.3g} |")
    return rows


def section(report: dict) -> str:
    machine = report["machine"]
    lines = [f"`{report['command']}`: TensorFlow {machine['tensorflow']}, Keras "
             f"{machine['keras']}, {machine['cores']} cores, load average "
             f"{machine['load_average_before'][0]:.1f} before and "
             f"{machine['load_average_after'][0]:.1f} after the run.", "",
             "| workload | contender | best steps/call | steps/s (median) | steps per CPU-s |",
             "|---|---|---|---|---|"]
    for name, workload in report["workloads"].items():
        rows = contender_rows(workload)
        rows[0] = rows[0].replace("| |", f"| {workload.get('model', name)} |", 1)
        lines += rows
    lines += ["", "CPU time, paired: the median over rounds of the two contenders' ratio "
              "within each round (steadier on a shared machine than the ratio of medians).",
              "", "| ratio | measured (wall) | CPU time | CPU time, paired | goal | "
              "met (wall / CPU / paired) |", "|---|---|---|---|---|---|"]
    for key, goal in report["goals"].items():
        cells, met = [], ["yes" if goal["met"] else "no"]
        for field in ("measured_cpu_time", "measured_cpu_time_paired"):
            value = goal.get(field)
            cells.append(f"{value:.3f}" if value else "-")
            met.append("-" if not value else ("yes" if value >= goal["goal"] else "no"))
        lines.append(f"| {key} | {goal['measured']:.3f} | {' | '.join(cells)} | {goal['goal']} | "
                     f"{' / '.join(met)} |")
    return "\n".join(lines)


def rewrite(text: str, marker: str, report: dict) -> str:
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + section(report) + "\n" + text[stop:]


def main() -> None:
    page = ROOT / "docs/performance.md"
    text = page.read_text()
    for marker, path in SECTIONS.items():
        source = ROOT / path
        if source.exists():
            text = rewrite(text, marker, json.loads(source.read_text()))
            print(f"rewrote the {marker} section of {page} from {source}")
    page.write_text(text)


if __name__ == "__main__":
    main()
