"""Compile time of the trainer's real step against depth: SPMD vs pipelined, unrolled vs scanned.

Run from the repository root (several minutes on 2 CPU cores; L=64 unrolled rows dominate):

    . .venv/bin/activate && python benchmarks/compile_scaling.py [--layers 4 16 32 64]

It prints a table and writes `benchmarks/results/compile_scaling.json`.

What is measured: for every number of decoder layers L and every variant below, one fresh Python
process builds the trainer exactly as `train.py configs/base.yml num_decoder_layers=L
num_pipeline_microbatches=8 steps=2 dataset_type=synthetic <variant overrides>` does
(`MaxText.train_step.build_trainer` on the tiny width) and reports

- `step_compile_s`: the step's compile alone — for SPMD the trainer's own `compile_seconds`
  (`jax.jit(step).lower(...).compile()`), for the pipelined variants the wall time of
  `MpmdFunction.compile` (trace, partition, placement, program, every task compile), timed by
  wrapping that method from outside;
- `trainer_compile_s`: the trainer's `compile_seconds`, the figure `train.py` logs as "step
  compiled in": for the pipelined trainer it also includes making the first state (its
  initialiser's compile and run), so it is larger than `step_compile_s`;
- for pipelined variants, the engine's `compile_stats` (XLA compiles, executables loaded onto
  other groups, task instances reusing an executable).

Variants: `spmd_unrolled` (scan_layers=false), `spmd_scanned` (scan_layers=true), `pp4_unrolled`
(pipeline_parallelism=4, 1f1b), `pp4_scanned` (the same with scan_layers=true) and
`pp4_interleaved_scanned` (interleaved_1f1b, 2 virtual stages per group, scan_layers=true).
A variant the trainer refuses (a config error, e.g. scanned layers with pipelining before that
lands, or L=4 layers over 8 virtual stages) is recorded with its one-line error, not timed.

One process per cell so no compilation cache or warm JAX state carries over between cells; the
cells run one after another in L-major order. The machine may be shared: the load average at
start and end is stored with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = (4, 16, 32, 64)
COMMON = ("num_pipeline_microbatches=8", "steps=2", "dataset_type=synthetic")
VARIANTS = {
    "spmd_unrolled": ("scan_layers=false",),
    "spmd_scanned": ("scan_layers=true",),
    "pp4_unrolled": ("scan_layers=false", "pipeline_parallelism=4", "pipeline_schedule=1f1b"),
    "pp4_scanned": ("scan_layers=true", "pipeline_parallelism=4", "pipeline_schedule=1f1b"),
    "pp4_interleaved_scanned": (
        "scan_layers=true",
        "pipeline_parallelism=4",
        "pipeline_schedule=interleaved_1f1b",
        "num_pipeline_repeats=2",
    ),
}
GOALS = {
    "pp4_scanned_over_spmd_scanned_max": 1.0,
    "pp4_scanned_L64_over_L4_max": 1.3,
}


def measure_one(layers: int, variant: str) -> dict:
    """Builds the trainer for one cell in this process; returns its figures."""
    import jax

    import jaxpp_integration as jaxpp
    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.config import ConfigError, load_config
    from MaxText.train_step import build_trainer

    argv = ["configs/base.yml", f"num_decoder_layers={layers}", *COMMON, *VARIANTS[variant]]
    try:
        config = load_config(argv)
        devs = devices.setup(**config.device_args())
    except ConfigError as e:
        return {"error": str(e).splitlines()[0]}
    mesh = sharding.make_mesh(config, devs)

    # Spies, installed from outside: the wall and CPU time (process_time: all threads of this
    # process, so XLA's own worker threads count; less inflated than wall time when other
    # processes compete for the cores) of the step's compile.
    marks: dict = {}
    real_jit, real_lowered_compile = jax.jit, jax.stages.Lowered.compile
    original = jaxpp.api.MpmdFunction.compile

    def now():
        return time.perf_counter(), time.process_time()

    def jit_spy(fun, *a, **k):  # SPMD: the trainer times from jax.jit(train_step) to compile()
        if getattr(fun, "__name__", "") == "train_step" and "start" not in marks:
            marks["start"] = now()
        return real_jit(fun, *a, **k)

    def lowered_compile_spy(self, *a, **k):
        out = real_lowered_compile(self, *a, **k)
        if "start" in marks and "end" not in marks:
            marks["end"] = now()
        return out

    def mpmd_compile_spy(self, *args):
        start = now()
        try:
            return original(self, *args)
        finally:
            if "mpmd" not in marks:
                marks["mpmd"] = (start, now())

    jax.jit, jax.stages.Lowered.compile = jit_spy, lowered_compile_spy
    jaxpp.api.MpmdFunction.compile = mpmd_compile_spy
    try:
        trainer = build_trainer(config, mesh)
    except ConfigError as e:
        return {"error": str(e).splitlines()[0]}
    finally:
        jax.jit, jax.stages.Lowered.compile = real_jit, real_lowered_compile
        jaxpp.api.MpmdFunction.compile = original
    start, end = marks["mpmd"] if config.is_pipelined else (marks["start"], marks["end"])
    out = {
        "argv": argv,
        "trainer_compile_s": trainer.compile_seconds,
        "devices": len(devs),
        "jax": jax.__version__,
    }
    out["step_compile_s"] = end[0] - start[0]
    out["step_compile_cpu_s"] = end[1] - start[1]
    if config.is_pipelined:
        stats = getattr(trainer.train_step, "compile_stats", None)
        if stats is not None:
            out["xla_compiles"] = stats.compiles
            out["executables_loaded"] = stats.loads
            out["task_cache_hits"] = stats.cache_hits
            out["task_compile_s_sum"] = sum(stats.seconds.values())
        out["stage_layers"] = list(config.stage_layers)
    return out


def run_cell(layers: int, variant: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--one", str(layers), variant]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    result = json.loads(lines[-1])
    result["process_wall_s"] = wall
    return result


def ratios(cells: dict, field: str) -> dict:
    """The goal ratios (and the unrolled ones for comparison) of one timing field."""

    def t(v, n):
        return cells.get(v, {}).get(str(n), {}).get(field)

    out: dict = {"pp4_scanned_over_spmd_scanned": {}, "pp4_unrolled_over_spmd_scanned": {}}
    for n in sorted({int(k) for v in cells.values() for k in v}):
        base = t("spmd_scanned", n)
        for v in ("pp4_scanned", "pp4_unrolled"):
            if base and t(v, n):
                out[f"{v}_over_spmd_scanned"][str(n)] = t(v, n) / base
    for v in VARIANTS:
        ls = sorted(int(k) for k, c in cells.get(v, {}).items() if field in c)
        if len(ls) >= 2:
            out[f"{v}_L{ls[-1]}_over_L{ls[0]}"] = t(v, ls[-1]) / t(v, ls[0])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/compile_scaling.json")
    ap.add_argument("--one", nargs=2, metavar=("L", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        os.chdir(ROOT)
        print(json.dumps(measure_one(int(args.one[0]), args.one[1])), flush=True)
        return

    from benchmarks.machine import machine_info

    info = machine_info()
    info["loadavg_start"] = os.getloadavg()
    t_start = time.perf_counter()
    cells: dict = {v: {} for v in args.variants}
    for n in args.layers:
        for v in args.variants:
            print(f"L={n:3d} {v:24s} ...", end=" ", flush=True)
            cells[v][str(n)] = c = run_cell(n, v, args.timeout)
            if "step_compile_s" in c:
                print(f"{c['step_compile_s']:7.2f} s wall, {c['step_compile_cpu_s']:6.2f} s CPU")
            else:
                print(c["error"])
            partial = {"machine": info, "goals": GOALS, "cells": cells, "partial": True}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(partial, indent=2, default=str) + "\n")
    info["loadavg_end"] = os.getloadavg()
    info["wall_time_s"] = time.perf_counter() - t_start
    result = {
        "machine": info,
        "goals": GOALS,
        "cells": cells,
        "ratios_wall": ratios(cells, "step_compile_s"),
        "ratios_cpu": ratios(cells, "step_compile_cpu_s"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    for field, label in (("step_compile_s", "wall"), ("step_compile_cpu_s", "CPU")):
        print(f"\nstep compile, {label} seconds")
        print(f"{'L':>3s} | " + " | ".join(f"{v:>23s}" for v in args.variants))
        for n in args.layers:
            row = [cells[v][str(n)].get(field) for v in args.variants]
            print(f"{n:3d} | " + " | ".join(f"{x:23.2f}" if x else f"{'—':>23s}" for x in row))
        for k, v in result[f"ratios_{'wall' if label == 'wall' else 'cpu'}"].items():
            print(f"  {k}: {json.dumps(v) if isinstance(v, dict) else f'{v:.2f}'}")
    print(
        f"goals: pp4_scanned / spmd_scanned <= {GOALS['pp4_scanned_over_spmd_scanned_max']} at "
        f"every L; pp4_scanned L64 / L4 <= {GOALS['pp4_scanned_L64_over_L4_max']}"
    )
    print(
        f"machine: {info['cpu_count']} CPUs, load avg {info['loadavg_start'][0]:.1f} -> "
        f"{info['loadavg_end'][0]:.1f}; wrote {args.out} in {info['wall_time_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
