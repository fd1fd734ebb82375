"""Where a benchmark's result goes: `benchmarks/results/<date>-<name>[-<tag>].json`.

The benchmarks' history is one dated file a run in one folder, never overwritten,
so a regression can be read against every earlier run; `benchmarks/report.py`
regenerates docs/performance.md's table from that folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """`--out` and `--tag`, the same on every benchmark script."""
    parser.add_argument(
        "--out", default=None,
        help=f"where the JSON goes: a path, or - for stdout (default: "
             f"benchmarks/results/<today>-{name}[-<tag>].json; stdout with --quick)")
    parser.add_argument("--tag", default="",
                        help="appended to the default file name: what this run is (a commit, 'fresh')")


def dated_path(name: str, tag: str = "", folder: Path = RESULTS) -> Path:
    """Today's file for `name`; `-run2`, `-run3`... when that one exists already."""
    stem = f"{datetime.date.today().isoformat()}-{name}" + (f"-{tag}" if tag else "")
    path, run = folder / f"{stem}.json", 1
    while path.exists():
        run += 1
        path = folder / f"{stem}-run{run}.json" if not tag else folder / f"{stem}_run{run}.json"
    return path


def write(report: dict[str, Any], out: str | None, name: str, tag: str = "",
          quick: bool = False, folder: Path = RESULTS) -> Path | None:
    """Stamps the run's date and time, then writes the JSON: to `out` ("-": stdout),
    else to stdout for a smoke run (`quick`), else to today's file in `folder`."""
    report.setdefault("date", datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    text = json.dumps(report, indent=1, default=float)
    if out == "-" or (out is None and quick):
        print(text)
        sys.stdout.flush()
        return None
    path = Path(out) if out else dated_path(name, tag, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path
