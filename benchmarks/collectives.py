"""Gradient reductions per step of the trainer, per `gradient_reduction` mode (exact, no timing).

Run from the repository root (it only compiles, on abstract inputs: ~15-30 minutes on 2 CPU
cores, most of it the three Llama 2 70B plans):

    .venv/bin/python benchmarks/collectives.py [--quick]

For each row the trainer's real step is built and compiled by the planner
(`MaxText.planning.cost_model`, nothing allocated) and its report read
(`cost_model.gradient_communication`): reduction launches per step (all-reduce and
reduce-scatter of the loop and `reduce_r` tasks, by mesh axes, a collective inside a layer
scan counted once per trip), those inside the loop tasks, the launches and bytes (of each
collective's result) per step per device of the busiest group (a device runs its own group's
collectives only), the gradient accumulator bytes per device of the largest group, and the
memory issue 37 is about: the largest group's XLA temporaries and peak per device, and whether
the plan fits.

- `tiny` (configs/base.yml defaults: scanned layers), pipeline_parallelism=2 with
  ici_data_parallelism=2, and with ici_data_parallelism=2 x ici_fsdp_parallelism=2; m = 4, 8,
  16 microbatches (global batch 64); modes step / microbatch / auto (planned for this CPU host:
  XLA:CPU reports no device memory, so auto scatters over fsdp, as the trainer here does);
- Llama 2 70B at pipeline_parallelism=8 x ici_fsdp_parallelism=8 (global batch 128, 16
  microbatches, remat full), planned for an H100 (80 GB), each mode in its own process
  (`python -m MaxText.plan ... --json`): 64 emulated devices; and `auto` with unrolled layers
  (`scan_layers=false`), whose XLA:CPU temporaries the planner judges by the per-layer bound
  (`MaxText/planning/layer_bound.py`; the row keeps XLA:CPU's figure and the bound).

Writes `benchmarks/results/collectives.json` and prints the table of benchmarks/README.md.
`--quick`: m = 4 only and no 70B rows (a check that the script works). `--only 70b` (or
`tiny`): those rows only, the others kept from the existing results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "collectives.json"

MODES = ("step", "microbatch", "auto")
MESHES = {
    "pp2 data2": ["ici_data_parallelism=2"],
    "pp2 data2 fsdp2": ["ici_data_parallelism=2", "ici_fsdp_parallelism=2"],
}
TINY = ["pipeline_parallelism=2", "global_batch_size=64", "dataset_type=synthetic"]
LLAMA_70B = [
    "model_name=llama2-70b",
    "pipeline_parallelism=8",
    "ici_fsdp_parallelism=8",
    "global_batch_size=128",
    "num_pipeline_microbatches=16",
    "remat_policy=full",
    "dataset_type=synthetic",
]


def summary(plan: dict) -> dict:
    """The table's columns from one plan (`Plan.as_json`): its `gradients` report and memory."""
    report = plan["gradients"]
    launches, by_axes = 0, {}
    for kind, axes in report["reductions"].items():
        for where, c in axes.items():
            launches += c["launches"]
            by_axes[f"{kind} {where}"] = c["launches"]
    return {
        "launches_per_step": launches,
        "launches_by_axes": by_axes,
        "in_loop_tasks": sum(report["in_loop_tasks"].values()),
        # a device runs its own group's collectives: the busiest group's
        "launches_per_step_per_device": max(g["launches"] for g in report["reductions_per_group"]),
        "bytes_per_step_per_device": max(g["bytes"] for g in report["reductions_per_group"]),
        "grad_bytes_per_device": max(report["grad_bytes"]),
        "deferred_axes": report["deferred_axes"],
        "scattered_axes": report["scattered_axes"],
        "temp_bytes_per_device": max(g["temp_bytes"] for g in plan["groups"]),
        "peak_bytes_per_device": max(g["peak_bytes"] for g in plan["groups"]),
        "fits": plan["fits"],
        **({"temporaries": plan["temporaries"]} if "temporaries" in plan else {}),
    }


def plan_tiny(mesh_keys: list, m: int, mode: str) -> dict:
    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.planning import cost_model
    from MaxText.planning.hardware import cpu_hardware

    config = load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            *TINY,
            *mesh_keys,
            f"num_pipeline_microbatches={m}",
            f"gradient_reduction={mode}",
        ]
    )
    return cost_model.plan_pipelined(config, cpu_hardware(config.num_devices)).as_json()


def plan_70b(mode: str, *extra: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        cmd = [
            sys.executable,
            "-m",
            "MaxText.plan",
            "configs/base.yml",
            *LLAMA_70B,
            *extra,
            f"gradient_reduction={mode}",
            "--hardware",
            "h100",
            "--json",
            str(path),
        ]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # it emulates 64
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if not path.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        return json.loads(path.read_text())


def table(rows: list) -> str:
    from MaxText.planning.cost_model import format_bytes

    out = [
        "| config | m | mode | reductions per step, all groups (by axes) | in loop tasks | "
        "per device: launches / bytes per step | gradients per device | XLA temporaries / "
        "peak per device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        axes = ", ".join(f"{k} {v}" for k, v in r["launches_by_axes"].items())
        out.append(
            f"| {r['config']} | {r['m']} | {r['mode']} | {r['launches_per_step']} ({axes}) | "
            f"{r['in_loop_tasks']} | {r['launches_per_step_per_device']} / "
            f"{format_bytes(r['bytes_per_step_per_device'])} | "
            f"{format_bytes(r['grad_bytes_per_device'])} | {_memory(r, format_bytes)} |"
        )
    return "\n".join(out)


def _memory(row: dict, fmt) -> str:
    text = f"{fmt(row['temp_bytes_per_device'])} / {fmt(row['peak_bytes_per_device'])}"
    if "temporaries" in row:  # judged by the per-layer bound
        xla = max(row["temporaries"]["compiler_temp_bytes"])
        text += f" (XLA:CPU's: {fmt(xla)}; per-layer bound)"
    return text + ("" if row["fits"] else ", does not fit")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="m=4 only, no Llama 2 70B rows")
    parser.add_argument("--only", choices=("tiny", "70b"), default=None)
    args = parser.parse_args()
    from MaxText.cluster import devices

    devices.setup(num_devices=8)
    t0 = time.perf_counter()
    rows = []
    kept = json.loads(OUT.read_text())["rows"] if args.only else []
    if args.only == "70b":
        rows = [r for r in kept if r["config"].startswith("tiny")]
    for name, keys in MESHES.items() if args.only != "70b" else ():
        for m in (4,) if args.quick else (4, 8, 16):
            for mode in MODES:
                row = {"config": f"tiny {name}", "m": m, "mode": mode}
                row.update(summary(plan_tiny(keys, m, mode)))
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    if args.only == "tiny":
        rows += [r for r in kept if not r["config"].startswith("tiny")]
    elif not args.quick:
        for mode in MODES:
            row = {"config": "llama2-70b pp8 fsdp8 (H100)", "m": 16, "mode": mode}
            row.update(summary(plan_70b(mode)))
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
        row = {"config": "llama2-70b pp8 fsdp8 (H100) unrolled", "m": 16, "mode": "auto"}
        row.update(summary(plan_70b("auto", "scan_layers=false")))
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    out = {
        "what": "gradient reduction launches and bytes per step, and gradient bytes per device, "
        "from the compiled HLO of the trainer's step (planner, abstract inputs)",
        "tiny": TINY,
        "llama2_70b": LLAMA_70B,
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    if not args.quick:
        OUT.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {OUT}")
    print(table(rows))


if __name__ == "__main__":
    main()
