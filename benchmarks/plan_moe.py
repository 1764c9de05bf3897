"""Plans of Mixtral-8x7B and Qwen3-30B-A3B on H100s at pipeline x expert parallelism: memory per
group, predicted step, MFU, and the step's collectives (all-to-alls, gradient reductions) as the
planner sees them.

    python benchmarks/plan_moe.py [--only NAME]      (minutes per row on a 2-core CPU)

Each row runs `python -m MaxText.plan ... --hardware h100 --json` in its own process (each needs
its own number of emulated devices): the trainer's real step compiled on abstract inputs, nothing
allocated. The Mixtral rows are the candidates for 64 H100s (8 nodes of 8: the expert axis inside
a node); the planner's choice is the fastest that fits. Results: benchmarks/results/plan_moe.json
and the README's table (`table`). Every figure is deterministic (compiled programs, HLO counts,
the cost model), so the results are committed as they come out of any machine.
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
OUT = REPO / "benchmarks" / "results" / "plan_moe.json"

COMMON = ["dataset_type=synthetic", "max_target_length=4096"]
MIXTRAL = ["model_name=mixtral-8x7b", "global_batch_size=128"]
QWEN = ["model_name=qwen3-30b-a3b", "global_batch_size=64"]
ROWS = {
    "mixtral-8x7b pp8 ep8 (64)": [*MIXTRAL, "pipeline_parallelism=8", "ici_expert_parallelism=8",
                                  "num_pipeline_microbatches=16"],
    "mixtral-8x7b pp4 ep8 data2 (64)": [*MIXTRAL, "pipeline_parallelism=4",
                                        "ici_expert_parallelism=8", "ici_data_parallelism=2",
                                        "num_pipeline_microbatches=8"],
    "mixtral-8x7b pp8 ep4 data2 (64)": [*MIXTRAL, "pipeline_parallelism=8",
                                        "ici_expert_parallelism=4", "ici_data_parallelism=2",
                                        "num_pipeline_microbatches=16"],
    "qwen3-30b-a3b pp2 ep8 (16)": [*QWEN, "pipeline_parallelism=2", "ici_expert_parallelism=8",
                                   "num_pipeline_microbatches=8"],
    "qwen3-30b-a3b pp4 ep4 (16)": [*QWEN, "pipeline_parallelism=4", "ici_expert_parallelism=4",
                                   "num_pipeline_microbatches=8"],
}  # fmt: skip


def run_row(name: str, keys: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "MaxText.plan", "configs/base.yml", *keys, *COMMON,
               "--hardware", "h100", "--json", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        print(proc.stdout, file=sys.stderr)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"{name}: plan failed:\n{proc.stderr[-3000:]}")
        return {
            "name": name,
            "keys": keys + COMMON,
            "plan_seconds": round(seconds, 1),
            "exit_code": proc.returncode,
            "text": proc.stdout,
            "plan": json.loads(out.read_text()),
        }


def chosen(results: dict, prefix: str) -> str | None:
    """The row of `prefix` the planner would run: the fastest predicted step that fits."""
    rows = [r for name, r in results.items() if name.startswith(prefix) and r["plan"]["fits"]]
    best = min(rows, key=lambda r: r["plan"]["predicted"]["step_time_s"], default=None)
    return best["name"] if best else None


def main() -> None:
    print(table(run_rows(ROWS, OUT, run_row)))


def table(results: dict) -> str:
    """The README's table, from the saved results."""
    lines = [
        "| row | fits | largest peak / device | predicted step | bubble | MFU | all-to-all per "
        "step (launches over all groups, bytes per device of the busiest group) | all-to-all "
        "share | gradient reductions per step | "
        "params total / active |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    picks = {chosen(results, "mixtral"), chosen(results, "qwen3")}
    for r in results.values():
        plan, moe = r["plan"], r["plan"]["moe"]
        peak = max(g["peak_bytes"] for g in plan["groups"]) / 1e9
        p = plan["predicted"]
        a2a = moe["all_to_all"]
        grads = plan.get("gradients", {}).get("reductions", {})
        reductions = "; ".join(
            f"{kind} {c['launches']} over {axes}"
            for kind, by_axes in grads.items()
            for axes, c in by_axes.items()
        )
        mark = " (chosen)" if r["name"] in picks else ""
        lines.append(
            f"| {r['name']}{mark} | {'yes' if plan['fits'] else 'no'} | {peak:.1f} GB | "
            f"{p['step_time_s']:.2f} s | {100 * p['bubble']:.1f} % | {100 * p['mfu']:.1f} % | "
            f"{a2a['launches']}, {max(a2a['bytes_per_device']) / 1e9:.2f} GB | "
            f"{100 * moe['all_to_all_share']:.1f} % | {reductions} | "
            f"{moe['params_total'] / 1e9:.1f}B / {moe['params_active'] / 1e9:.1f}B |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
