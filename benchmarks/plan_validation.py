"""The planner's bytes per group against the trainer's measured ones (tiny and small, pp 2 and
4, every schedule), and what that first-step measurement costs.

    python benchmarks/plan_validation.py [--models tiny,small] [--pp 2,4]   (~15 min on 2 cores)
    python benchmarks/plan_validation.py --first-step [--layers 32]          (~10 min on 2 cores)

Per row, in one process per (model, pp) (each needs its own number of emulated devices):
- planned: `MaxText.planning.auto.make_plan` (what `python -m MaxText.plan` prints: the step
  compiled on abstract inputs), per group `live_peak_bytes` (live values at every instruction) and
  `peak_bytes` (plus the largest XLA temporaries of the group's tasks);
- measured: the trainer's own step (`train_step.build_trainer`, real parameters, one step on a
  zero batch) through `measured_train_step`, the device buffers alive after every instruction,
  the largest device of each group: what the trainer writes as `peak_bytes_per_group`.
On a CPU host device buffers do not include XLA's temporaries, so the check is the live peak;
on a GPU the trainer reads `peak_bytes_in_use`, which does, and compares with `peak_bytes`.
Virtual-stage schedules at pp=4 need 8 stages: those rows use num_decoder_layers=8.
Results: benchmarks/results/plan_validation.json and a markdown table on stdout.

`--first-step`: the trainer measures its first step's bytes per group (`measured_train_step`,
as `train.py` does); that step must not stall. At `num_decoder_layers=L pipeline_parallelism=4`
(tiny, 8 microbatches, synthetic data), scanned and unrolled, each in its own process: the wall
time of the measured first step and of the next two plain steps (each until its metrics are
ready), and the ratio first / second (goal: <= 2). Results: benchmarks/results/first_step.json
and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "plan_validation.json"
SCHEDULES = [  # (schedule, num_pipeline_repeats)
    ("gpipe", 1),
    ("1f1b", 1),
    ("eager_1f1b", 1),
    ("zero_bubble", 1),
    ("interleaved_1f1b", 2),
    ("dualpipev", 2),
]


def rows_for(model: str, pp: int) -> list[list[str]]:
    out = []
    for schedule, repeats in SCHEDULES:
        keys = [
            f"model_name={model}",
            f"pipeline_parallelism={pp}",
            f"pipeline_schedule={schedule}",
            f"num_pipeline_repeats={repeats}",
            "num_pipeline_microbatches=8",
            "dataset_type=synthetic",
            "enable_checkpointing=false",
        ]
        if pp * repeats > {"tiny": 4, "small": 6}[model]:
            keys.append("num_decoder_layers=8")
        out.append(keys)
    return out


def measure(keys: list[str]) -> dict:
    """One row, in this process (devices already set up for the largest row)."""
    import jax
    import numpy as np

    from MaxText import sharding
    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.planning import auto as plan_auto
    from MaxText.planning.hardware import cpu_hardware
    from MaxText.train_step import batch_shapes, build_trainer, measured_train_step

    config = load_config([str(CONFIGS_DIR / "base.yml"), *keys])
    t0 = time.perf_counter()
    planned = plan_auto.make_plan(config, cpu_hardware(config.num_devices))
    plan_s = time.perf_counter() - t0
    trainer = build_trainer(config, sharding.make_mesh(config, jax.devices()[: config.num_devices]))
    batch = trainer.put_batch(
        {k: np.zeros(v.shape, v.dtype) for k, v in batch_shapes(config).items()}
    )
    _, _, measured = measured_train_step(trainer, trainer.init_state(), batch)
    live = [g.live_peak_bytes for g in planned.groups]
    return {
        "keys": keys,
        "stage_layers": list(config.stage_layers),
        "planned_live_peak_bytes": live,
        "planned_peak_bytes": [g.peak_bytes for g in planned.groups],
        "measured_peak_bytes": measured,
        "error": [p / m - 1.0 for p, m in zip(live, measured)],
        "plan_seconds": plan_s,
    }


def child(model: str, pp: int) -> None:
    from MaxText.cluster import devices

    devices.setup(pp)
    results = []
    for keys in rows_for(model, pp):
        results.append(measure(keys))
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps(results))


def table(results: list[dict]) -> str:
    lines = [
        "| model | pp | schedule | planned live peak per group (MB) | measured (MB) "
        "| worst error |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        keys = dict(k.split("=", 1) for k in r["keys"])
        layers = f" ({keys['num_decoder_layers']} layers)" if "num_decoder_layers" in keys else ""
        mb = lambda xs: ", ".join(f"{x / 1e6:.2f}" for x in xs)  # noqa: E731
        worst = max(r["error"], key=abs)
        lines.append(
            f"| {keys['model_name']}{layers} | {keys['pipeline_parallelism']} | "
            f"{keys['pipeline_schedule']} | {mb(r['planned_live_peak_bytes'])} | "
            f"{mb(r['measured_peak_bytes'])} | {100 * worst:+.1f}% |"
        )
    return "\n".join(lines)


FIRST_STEP_OUT = REPO / "benchmarks" / "results" / "first_step.json"


def first_step(layers: int, scan: str) -> dict:
    """One trainer's measured first step against its next plain steps, in this process."""
    import jax
    import numpy as np

    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.train_step import batch_shapes, build_trainer, measured_train_step

    keys = [
        f"num_decoder_layers={layers}",
        "pipeline_parallelism=4",
        f"scan_layers={scan}",
        "num_pipeline_microbatches=8",
        "dataset_type=synthetic",
        "enable_checkpointing=false",
    ]
    config = load_config([str(CONFIGS_DIR / "base.yml"), *keys])
    mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
    trainer = build_trainer(config, mesh)
    batch = trainer.put_batch(
        {k: np.zeros(v.shape, v.dtype) for k, v in batch_shapes(config).items()}
    )
    state = trainer.init_state()
    t0 = time.perf_counter()
    state, metrics, peaks = measured_train_step(trainer, state, batch)
    jax.block_until_ready(metrics)
    seconds = [time.perf_counter() - t0]
    for _ in range(2):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - t0)
    measured = trainer.train_step.last_device_bytes
    return {
        "keys": keys,
        "instructions": trainer.train_step.report().num_instructions,
        "step_seconds": seconds,
        "first_over_second": seconds[0] / seconds[1],
        "peak_bytes_per_group": peaks,
        "checks_at_peaks": len(measured.checked),
        "check_mismatches": len(measured.mismatches()),
        "compile_seconds": trainer.compile_seconds,
    }


def first_step_table(rows: list[dict]) -> str:
    lines = [
        "| layers | scan_layers | instructions | step 1 (measured) | step 2 | step 3 | 1 / 2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        keys = dict(k.split("=", 1) for k in r["keys"])
        s1, s2, s3 = r["step_seconds"]
        lines.append(
            f"| {keys['num_decoder_layers']} | {keys['scan_layers']} | {r['instructions']} | "
            f"{s1:.2f} s | {s2:.2f} s | {s3:.2f} s | {r['first_over_second']:.2f} |"
        )
    return "\n".join(lines)


def run_first_step(layers: int) -> int:
    rows = []
    for scan in ("true", "false"):
        proc = subprocess.run(
            [sys.executable, __file__, "--first-step-child", str(layers), scan],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(f"scan_layers={scan} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = {"rows": rows, "goal_first_over_second": 2.0}
    out["git_commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    out["loadavg"] = __import__("os").getloadavg()
    FIRST_STEP_OUT.write_text(json.dumps(out, indent=1))
    print(first_step_table(rows))
    return 0 if all(r["first_over_second"] <= 2.0 for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--child", nargs=2, default=None)
    parser.add_argument("--first-step", action="store_true", help="first vs second step time")
    parser.add_argument("--layers", type=int, default=32, help="--first-step: decoder layers")
    parser.add_argument("--first-step-child", nargs=2, default=None)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return 0
    if args.first_step_child:
        print(json.dumps(first_step(int(args.first_step_child[0]), args.first_step_child[1])))
        return 0
    if args.first_step:
        return run_first_step(args.layers)
    results = []
    for model in args.models.split(","):
        for pp in map(int, args.pp.split(",")):
            proc = subprocess.run(
                [sys.executable, __file__, "--child", model, str(pp)],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                raise RuntimeError(f"{model} pp={pp} failed:\n{proc.stderr[-3000:]}")
            results.extend(json.loads(proc.stdout.strip().splitlines()[-1]))
    out = {
        "rows": results,
        "equal": all(e == 0 for r in results for e in r["error"]),
        "within_1_percent": all(abs(e) <= 0.01 for r in results for e in r["error"]),
    }
    out["git_commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    OUT.write_text(json.dumps(out, indent=1))
    print(table(results))
    return 0 if out["within_1_percent"] else 1


if __name__ == "__main__":
    sys.exit(main())
