"""The row loop of the planner benchmarks (`plan_llama.py`, `plan_moe.py`): each named row of
keys is planned by the benchmark's `run_row`, and the results file is rewritten after every row,
so an interrupted run keeps the rows done and `--only NAME` replans one row, keeping the others.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def run_rows(rows: dict[str, list[str]], out: Path, run_row: Callable[[str, list], dict]) -> dict:
    """The results (row name -> `run_row(name, keys)`) after running the rows the command line
    asks for (`--only NAME`: that one; else all), those of earlier runs kept from `out`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None, help="plan only this row")
    args = parser.parse_args()
    results = json.loads(out.read_text()) if out.exists() else {}
    for name, keys in rows.items():
        if args.only and args.only != name:
            continue
        results[name] = run_row(name, keys)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    return results
