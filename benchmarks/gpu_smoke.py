"""GPU smoke run: the first command to run on one GPU node, and what to compare its numbers with.

    python benchmarks/gpu_smoke.py [--pp 2,4] [--steps 10] [key=value ...]

For each pipeline_parallelism P of `--pp`, in a process of its own (so each row starts with empty
GPUs): Llama 2 7B shapes in bfloat16 (`model_name=llama2-7b`, synthetic data, 4096-token rows, one
row per GPU) on all GPUs of this node, fsdp = GPUs / P, with the planner's choice of schedule,
microbatches, stage split and remat per stage (the `auto` keys, decided for these GPUs as
`train.py` decides them). It trains `--steps` steps and prints one row per P: step time,
TFLOP/s/device, MFU and peak HBM per pipeline group, each with the planner's prediction beside it
in parentheses (the plan is read off the trainer's own compiled step, no extra compile). Extra
`key=value` arguments go to every run (e.g. `num_decoder_layers=16` on smaller GPUs).

Results: `benchmarks/results/gpu_smoke.json` (with the machine and XLA flags) and the markdown
table on stdout. Measured: step time is the median over the steps after the first two (the first
also measures the bytes per group); peak HBM is each group's largest `peak_bytes_in_use` over the
run (XLA temporaries included, like the plan's peak). On a host without GPUs it exits with code
2 and one line. `--cpu` runs the same path on emulated CPU devices, to check the script itself
(give a small model and explicit parallelism, e.g. `--cpu model_name=tiny ici_fsdp_parallelism=1
dtype=float32`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from MaxText.cluster import gpu_host, xla_flags

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "gpu_smoke.json"
GB = 1e9
WARMUP_STEPS = 2  # not in the median: the first measures bytes per group, the second settles

RUN_KEYS = [
    "model_name=llama2-7b",
    "dtype=bfloat16",
    "ici_fsdp_parallelism=-1",
    "pipeline_schedule=auto",
    "num_pipeline_microbatches=auto",
    "pipeline_stage_layers=auto",
    "remat_policy=auto",
    "dataset_type=synthetic",
    "eval_interval=0",
    "log_period=1",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "enable_progress_bar=false",
]


def _fail(message: str) -> int:
    print(f"gpu_smoke: {message}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------ one row (child)


def run_row(pp: int, steps: int, keys: list[str], out: Path, cpu: bool) -> int:
    """Trains one configuration and writes its row to `out`; returns the exit code."""
    if not cpu:
        xla_flags.apply_gpu_defaults("gpu")  # before the backend starts (logged below)
        import jax

        platform = jax.devices()[0].platform
        if platform != "gpu":
            gpus = gpu_host.visible_gpu_count()
            return _fail(
                f"JAX runs on {platform.upper()} on this host with {gpus} GPUs (nvidia-smi); run "
                "./setup.sh here (it installs jax[cuda12]), then run this again"
            )

    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.cluster.compile_cache import compilation_cache
    from MaxText.config import CONFIGS_DIR, ConfigError, load_config
    from MaxText.data import make_data
    from MaxText.metrics import setup_logging
    from MaxText.planning import flops
    from MaxText.planning.auto import resolve_auto
    from MaxText.planning.cost_model import plan_compiled
    from MaxText.planning.hardware import local_hardware
    from MaxText.train import run
    from MaxText.train_step import build_trainer

    setup_logging()
    print(f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            str(CONFIGS_DIR / "base.yml"),
            *RUN_KEYS,
            f"pipeline_parallelism={pp}",
            f"steps={steps}",
            f"base_output_directory={tmp}",
            f"run_name=gpu_smoke_pp{pp}",
            f"hardware={'cpu' if cpu else 'gpu'}",
            *keys,
        ]
        try:
            config, devs = devices.start(load_config(argv))
        except ConfigError as e:
            return _fail(f"config error: {e}")
        with compilation_cache(config.jax_cache_dir):
            config = resolve_auto(config)  # the planner's choice for these devices
            trainer = build_trainer(config, sharding.make_mesh(config, devs))
            hardware = local_hardware(config)
            plan = plan_compiled(config, hardware, trainer.train_step, trainer.abstract_state)
            run(config, trainer, make_data(config))
        records = [json.loads(line) for line in Path(config.metrics_file).read_text().splitlines()]

    times = [r["step_time_s"] for r in records[WARMUP_STEPS:]] or [records[-1]["step_time_s"]]
    step_time = statistics.median(times)
    device = devs[0]
    peak = flops.peak_tflops(config, device.platform, device.device_kind)
    tflops_per_step = flops.training_flops_per_step(config).total / config.num_devices / 1e12
    predicted_time = plan.predicted["step_time_s"]
    groups = [list(trainer.mpmd_mesh.unstack[g].devices.flat) for g in range(config.mesh_pipeline)]
    stats = [[d.memory_stats() or {} for d in group] for group in groups]
    if all("peak_bytes_in_use" in s for group in stats for s in group):
        peak_bytes = [max(int(s["peak_bytes_in_use"]) for s in group) for group in stats]
        hbm_source = "peak_bytes_in_use"
    else:  # CPU devices keep no memory statistics: the live device buffers of the first step
        peak_bytes = records[0]["peak_bytes_per_group"]
        hbm_source = "device buffers (no memory stats)"
    row = {
        "pp": pp,
        "fsdp": config.mesh_fsdp,
        "devices": config.num_devices,
        "device_kind": device.device_kind,
        "schedule": config.pipeline_schedule,
        "num_pipeline_repeats": config.num_pipeline_repeats,
        "microbatches": config.num_pipeline_microbatches,
        "stage_layers": list(config.stage_layers),
        "stage_remat": list(config.stage_remat),
        "steps": steps,
        "step_time_s": step_time,
        "predicted_step_time_s": predicted_time,
        "tflops_per_device": tflops_per_step / step_time,
        "predicted_tflops_per_device": tflops_per_step / predicted_time,
        "mfu": tflops_per_step / step_time / peak.tflops,
        "predicted_mfu": plan.predicted["mfu"],
        "peak_tflops_per_device": peak.tflops,
        "peak_bytes_per_group": peak_bytes,
        "predicted_peak_bytes_per_group": [g.peak_bytes for g in plan.groups],
        "peak_bytes_source": hbm_source,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
    }
    out.write_text(json.dumps(row, indent=1))
    return 0


# --------------------------------------------------------------------------------- the command


def table(rows: list[dict]) -> str:
    lines = [
        "| pp x fsdp | schedule, microbatches | stage layers | remat | step s | TFLOP/s/device "
        "| MFU | peak HBM per group, GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        schedule = r["schedule"] + (
            f" x{r['num_pipeline_repeats']}" if r["num_pipeline_repeats"] > 1 else ""
        )
        hbm = " · ".join(
            f"{m / GB:.3g} ({p / GB:.3g})"
            for m, p in zip(r["peak_bytes_per_group"], r["predicted_peak_bytes_per_group"])
        )
        lines.append(
            f"| {r['pp']} x {r['fsdp']} | {schedule}, {r['microbatches']} "
            f"| {','.join(map(str, r['stage_layers']))} | {','.join(r['stage_remat'])} "
            f"| {r['step_time_s']:.3f} ({r['predicted_step_time_s']:.3f}) "
            f"| {r['tflops_per_device']:.3g} ({r['predicted_tflops_per_device']:.3g}) "
            f"| {100 * r['mfu']:.1f}% ({100 * r['predicted_mfu']:.1f}%) | {hbm} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_smoke.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pp", default="2,4", help="pipeline_parallelism values, e.g. 2,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--cpu", action="store_true", help="check the script on CPU devices")
    parser.add_argument("--row", type=int, default=0, help=argparse.SUPPRESS)  # one row (child)
    parser.add_argument("--row-out", type=Path, default=None, help=argparse.SUPPRESS)
    args, keys = parser.parse_known_args(argv)
    if args.row:
        return run_row(args.row, args.steps, keys, args.row_out, args.cpu)
    if args.steps <= WARMUP_STEPS:
        return _fail(f"--steps={args.steps}: give more than {WARMUP_STEPS} (warm-up steps)")
    gpus = gpu_host.visible_gpu_count()
    if gpus == 0 and not args.cpu:  # before jax: no backend (nor GPU memory) in this process
        return _fail("no GPU on this host (nvidia-smi lists none); run it on a GPU node")
    pps = [int(p) for p in args.pp.split(",") if p.strip()]
    rows = []
    for pp in pps:
        if not args.cpu and gpus % pp:
            print(f"gpu_smoke: pp={pp} skipped: {gpus} GPUs are not a multiple of it", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            row_out = Path(tmp) / "row.json"
            cmd = [sys.executable, __file__, "--row", str(pp), "--row-out", str(row_out)]
            cmd += ["--steps", str(args.steps), *(["--cpu"] if args.cpu else []), *keys]
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code != 0:
                return code  # the row said why
            rows.append(json.loads(row_out.read_text()))
    if not rows:
        return _fail(f"no row ran (--pp {args.pp} on {gpus} GPUs)")
    from benchmarks.machine import machine_info

    result = {
        "command": "python benchmarks/gpu_smoke.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine_info(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print("(in parentheses: the planner's prediction for the same configuration)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
