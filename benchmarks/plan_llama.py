"""Plans of Llama 2 7B and 70B on H100s at pipeline_parallelism 4 and 8: even vs auto stage split.

    python benchmarks/plan_llama.py [--only NAME]      (~minutes per row on a 2-core CPU)

Each row runs `python -m MaxText.plan ... pipeline_stage_layers=auto remat_policy=auto --json`
in its own process (each needs its own number of emulated devices): it plans the even split with
remat full everywhere, chooses remat per stage for it, chooses split and remat together, and
plans the chosen split (kept only if it fits and is faster). Results:
benchmarks/results/plan_llama.json and a markdown table. Nothing is allocated: the real step is
compiled on abstract inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.plan_rows import run_rows

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "plan_llama.json"

COMMON = ["dataset_type=synthetic", "pipeline_stage_layers=auto", "remat_policy=auto"]
ROWS = {
    "llama2-7b pp4 fsdp2": [
        "model_name=llama2-7b",
        "pipeline_parallelism=4",
        "ici_fsdp_parallelism=2",
        "global_batch_size=32",
        "num_pipeline_microbatches=8",
    ],
    "llama2-7b pp8": [
        "model_name=llama2-7b",
        "pipeline_parallelism=8",
        "global_batch_size=16",
        "num_pipeline_microbatches=16",
    ],
    "llama2-70b pp4 fsdp8": [
        "model_name=llama2-70b",
        "pipeline_parallelism=4",
        "ici_fsdp_parallelism=8",
        "global_batch_size=64",
        "num_pipeline_microbatches=8",
    ],
    "llama2-70b pp8 fsdp8": [
        "model_name=llama2-70b",
        "pipeline_parallelism=8",
        "ici_fsdp_parallelism=8",
        "global_batch_size=128",
        "num_pipeline_microbatches=16",
    ],
    "llama2-70b pp8 fsdp8 microbatch": [
        "model_name=llama2-70b",
        "pipeline_parallelism=8",
        "ici_fsdp_parallelism=8",
        "global_batch_size=128",
        "num_pipeline_microbatches=16",
        "gradient_reduction=microbatch",
    ],
    "llama2-70b pp4 fsdp8 microbatch": [
        "model_name=llama2-70b",
        "pipeline_parallelism=4",
        "ici_fsdp_parallelism=8",
        "global_batch_size=64",
        "num_pipeline_microbatches=8",
        "gradient_reduction=microbatch",
    ],
}


def run_row(name: str, keys: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "MaxText.plan",
                "configs/base.yml",
                *keys,
                *COMMON,
                "--hardware",
                "h100",
                "--json",
                str(out),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t0
        print(proc.stdout, file=sys.stderr)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"{name}: plan failed:\n{proc.stderr[-3000:]}")
        return {
            "name": name,
            "keys": keys,
            "plan_seconds": round(seconds, 1),
            "exit_code": proc.returncode,
            "text": proc.stdout,
            "log": [line for line in proc.stderr.splitlines() if "auto" in line or "plan:" in line],
            "plan": json.loads(out.read_text()),
        }


def main() -> None:
    results = run_rows(ROWS, OUT, run_row)
    for r in results.values():
        print(f"## {r['name']} ({r['plan_seconds']} s)\n{r['text']}")
    print(table(results))


def table(results: dict) -> str:
    """The README's table, from the saved results."""
    import re

    lines = [
        "| row | stage split | remat per stage (auto) | largest peak per device | predicted step "
        "| vs remat full everywhere | vs even split | bubble | MFU | plan time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        plan = r["plan"]
        peak = max(g["peak_bytes"] for g in plan["groups"]) / 1e9
        remat = re.search(r"remat per stage \[(.*?)\]", r["text"])
        remat = remat.group(1).replace("'", "") if remat else ""
        split = plan["stage_layers"]
        split = f"{split[0]} x {len(split)}" if len(set(split)) == 1 else ",".join(map(str, split))
        p = plan["predicted"]
        full = re.search(r"vs (\S+) s with remat full on every stage \((\S+)x\)", r["text"])
        full = f"{full.group(1)} s ({full.group(2)}x)" if full else ""
        even = re.search(r"  even: .*; step (\S+) s", r["text"])
        even = f"{even.group(1)} s" if even else "(even kept)"
        lines.append(
            f"| {r['name']} | {split} | {remat} | {peak:.1f} GB "
            f"({'fits' if plan['fits'] else 'does not fit'}) | {p['step_time_s']:.2f} s | "
            f"{full} | {even} | {100 * p['bubble']:.1f} % | {100 * p['mfu']:.1f} % | "
            f"{r['plan_seconds']:.0f} s |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
