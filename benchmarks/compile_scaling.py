"""Compile time of the trainer's real step against depth (issue 24's table): SPMD vs pipelined,
scanned vs unrolled, plus what a warm restart and two processes compile.

Run from the repository root on a quiet machine (about 7 minutes on 2 cores; the unrolled
L=64 cells dominate):

    .venv/bin/python benchmarks/compile_scaling.py
    .venv/bin/python benchmarks/compile_scaling.py --quick      # a smoke run of every row

It writes `benchmarks/results/compile_scaling.json` and prints the README table.

Cells: for every number of decoder layers L and variant, one fresh Python process builds the
trainer exactly as `train.py configs/base.yml num_decoder_layers=L num_pipeline_microbatches=8
global_batch_size=16 steps=2 dataset_type=synthetic <variant keys>` does (`build_trainer` on the
`tiny` width; `global_batch_size` fixed so every variant computes the same step) and reports

- `step_compile_s` (wall) and `step_compile_cpu_s` (process CPU: all threads, XLA's included;
  the fairer figure on a shared machine) of the step's compile alone: for SPMD the span of
  `jax.jit(step).lower(...).compile()`, for the pipelined variants `MpmdFunction.compile` (trace,
  partition, placement, program, every task compile), timed from outside;
- `trainer_compile_s`: what `train.py` logs as "step compiled in" (the same span);
- pipelined: the engine's `compile_stats` (XLA compiles, loaded copies) and the programs it
  compiled, by name.

Each cell runs `--repeats` times (default 3); the table shows medians. Variants: `spmd_scanned`,
`pp4_scanned` (pipeline_parallelism=4, 1f1b, scan_layers=true: the default) and
`pp4_unrolled` (scan_layers=false). Rows (goal):

1. PP=4 scanned / SPMD scanned at L=32, wall and CPU (<= 1.5);
2. PP=4 scanned, L=64 / L=4 (<= 1.1; flat in depth);
3. PP=4 scanned / unrolled at every L >= 8 (< 1; <= 0.3 at L=32);
4. `engine_overhead` compile `mpmd_4groups` / `jax.jit` (`benchmarks/engine_overhead.py
   --compile-only`, run as a subprocess; <= 1.5);
5. 2 processes x pipeline_parallelism=2: task programs each process compiles, against one
   process compiling both groups (`python -m MaxText.launch`, the trainer's log line);
6. a restart with a warm `jax_cache_dir`: real XLA compiles of the whole trainer build (JAX's
   backend-compile events minus its cache hits; 0).

The machine may be shared: the load average at start and end is stored with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = (4, 8, 16, 32, 64)
COMMON = (
    "num_pipeline_microbatches=8",
    "global_batch_size=16",
    "steps=2",
    "dataset_type=synthetic",
)
VARIANTS = {
    "spmd_scanned": ("scan_layers=true",),
    "pp4_scanned": ("scan_layers=true", "pipeline_parallelism=4", "pipeline_schedule=1f1b"),
    "pp4_unrolled": ("scan_layers=false", "pipeline_parallelism=4", "pipeline_schedule=1f1b"),
}
GOALS = {
    "pp4_scanned_over_spmd_scanned_L32_max": 1.5,
    "pp4_scanned_L64_over_L4_max": 1.1,
    "pp4_scanned_over_unrolled_L32_max": 0.3,
    "pp4_scanned_over_unrolled_every_L_ge_8_max": 1.0,
    "engine_overhead_mpmd_4groups_over_jit_max": 1.5,
    "restart_real_compiles": 0,
}
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _argv(layers: int, variant: str, *extra: str) -> list[str]:
    return ["configs/base.yml", f"num_decoder_layers={layers}", *COMMON, *VARIANTS[variant], *extra]


def measure_one(layers: int, variant: str) -> dict:
    """Builds the trainer for one cell in this process; returns its figures."""
    import jax

    import jaxpp_integration as jaxpp
    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.config import load_config
    from MaxText.errors import UserError
    from MaxText.train_step import build_trainer

    argv = _argv(layers, variant)
    try:
        config, devs = devices.start(load_config(argv))
    except UserError as e:
        return {"error": str(e).splitlines()[0]}
    mesh = sharding.make_mesh(config, devs)

    # Spies, installed from outside: wall and process CPU time of the step's compile.
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
    except UserError as e:
        return {"error": str(e).splitlines()[0]}
    finally:
        jax.jit, jax.stages.Lowered.compile = real_jit, real_lowered_compile
        jaxpp.api.MpmdFunction.compile = original
    start, end = marks["mpmd"] if config.is_pipelined else (marks["start"], marks["end"])
    out = {
        "argv": argv,
        "trainer_compile_s": trainer.compile_seconds,
        "step_compile_s": end[0] - start[0],
        "step_compile_cpu_s": end[1] - start[1],
        "devices": len(devs),
        "jax": jax.__version__,
    }
    if config.is_pipelined:
        stats = trainer.train_step.compile_stats
        out.update(
            xla_compiles=stats.compiles,
            persistent_hits=stats.persistent_hits,
            executables_loaded=stats.loads,
            compiled_programs=list(stats.compiled),
            stage_layers=list(config.stage_layers),
        )
    return out


def restart_one(layers: int, cache: str) -> dict:
    """Builds the pp4_scanned trainer with `jax_cache_dir=cache`; the real XLA compiles of the
    whole build (initialisation included): JAX's backend-compile events minus cache hits."""
    import jax

    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.cluster.compile_cache import compilation_cache
    from MaxText.config import load_config
    from MaxText.train_step import build_trainer

    seen = {BACKEND_COMPILE: 0, CACHE_HIT: 0}

    def on_event(event, **_):
        if event == CACHE_HIT:
            seen[CACHE_HIT] += 1

    def on_duration(event, duration, **_):
        if event == BACKEND_COMPILE:
            seen[BACKEND_COMPILE] += 1

    config, devs = devices.start(load_config(_argv(layers, "pp4_scanned")))
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    with compilation_cache(cache):
        trainer = build_trainer(config, sharding.make_mesh(config, devs))
        trainer.init_state()
    stats = trainer.train_step.compile_stats
    return {
        "real_compiles": seen[BACKEND_COMPILE] - seen[CACHE_HIT],
        "cache_reads": seen[CACHE_HIT],
        "step_xla_compiles": stats.compiles,
        "step_persistent_hits": stats.persistent_hits,
        "step_loads": stats.loads,
    }


def _child(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, *args]
    t0 = time.perf_counter()
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # no cache carried between cells
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    result = json.loads(lines[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def run_cell(layers: int, variant: str, repeats: int, timeout: float) -> dict:
    """`repeats` fresh processes of one cell; medians of the timings, the runs kept."""
    runs = [_child(["--one", str(layers), variant], timeout) for _ in range(repeats)]
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"], "runs": runs}
    cell = dict(ok[0])
    for field in ("step_compile_s", "step_compile_cpu_s", "trainer_compile_s"):
        cell[field] = statistics.median(r[field] for r in ok)
    cell["runs"] = runs
    return cell


def restart_row(layers: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile_scaling_cache_") as cache:
        cold = _child(["--restart", str(layers), cache], timeout)
        warm = _child(["--restart", str(layers), cache], timeout)
    return {"layers": layers, "cold": cold, "warm": warm}


_COMPILED_HERE = re.compile(
    r"process (\d+): task programs of groups \[([\d, ]*)\] compiled here: (\d+) XLA compiles, "
    r"(\d+) read from jax_cache_dir, (\d+) loaded"
)


def processes_row(layers: int, timeout: float) -> dict:
    """2 processes x pp=2 (one group each) against 1 process with both groups: the task
    programs each compiles, from the trainer's log line."""
    out: dict = {"layers": layers}
    with tempfile.TemporaryDirectory(prefix="compile_scaling_procs_") as tmp:
        keys = [
            "configs/base.yml",
            f"num_decoder_layers={layers}",
            *(k for k in COMMON if not k.startswith("steps=")),
            "steps=1",
            "pipeline_parallelism=2",
            "enable_checkpointing=false",
            "eval_interval=0",
            f"base_output_directory={tmp}",
            "jax_cache_dir=",
        ]
        env = dict(os.environ)
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env.pop("XLA_FLAGS", None)  # the trainer emulates the devices each process needs
        launch = [sys.executable, "-m", "MaxText.launch", "--num_processes", "2", "--"]
        for name, cmd in (
            ("one_process", [sys.executable, "train.py", *keys, "run_name=one"]),
            ("two_processes", [*launch, *keys, "run_name=two"]),
        ):
            try:
                done = subprocess.run(
                    cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
                )
            except subprocess.TimeoutExpired:
                out[name] = {"error": f"timed out after {timeout:.0f} s"}
                continue
            found = [
                {
                    "process": int(m.group(1)),
                    "groups": [int(g) for g in m.group(2).split(",") if g.strip()],
                    "xla_compiles": int(m.group(3)),
                    "cache_reads": int(m.group(4)),
                    "loaded": int(m.group(5)),
                }
                for m in _COMPILED_HERE.finditer(done.stdout + done.stderr)
            ]
            if done.returncode != 0 or not found:
                tail = ((done.stdout + done.stderr).strip().splitlines() or ["no output"])[-1]
                out[name] = {"error": f"exit {done.returncode}: {tail}"}
            else:
                out[name] = sorted(found, key=lambda f: f["process"])
    return out


def engine_overhead_row(timeout: float) -> dict:
    """`benchmarks/engine_overhead.py --compile-only` in a subprocess; its compile ratios."""
    with tempfile.TemporaryDirectory(prefix="compile_scaling_eo_") as tmp:
        out = Path(tmp) / "engine_overhead.json"
        cmd = [sys.executable, "-m", "benchmarks.engine_overhead", "--compile-only"]
        cmd += ["--out", str(out)]
        env = dict(os.environ)
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        written = out.with_name("engine_overhead_compile.json")
        if done.returncode != 0 or not written.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"error": f"exit {done.returncode}: {tail}"}
        compile_ = json.loads(written.read_text())["compile"]
    return {
        "wall_ratio": compile_["ratio_vs_jit"]["mpmd_4groups"],
        "cpu_ratio": compile_["cpu_ratio_vs_jit"]["mpmd_4groups"],
        "median_s": compile_["median_s"],
        "median_cpu_s": compile_["median_cpu_s"],
        "compile_stats": compile_.get("mpmd_compile_stats", {}).get("mpmd_4groups"),
    }


def ratios(cells: dict, field: str) -> dict:
    """The goal ratios of one timing field (None where a cell is missing)."""

    def t(v, n):
        return cells.get(v, {}).get(str(n), {}).get(field)

    def over(a, b):
        return a / b if a and b else None

    layers = sorted({int(k) for v in cells.values() for k in v})
    return {
        "pp4_scanned_over_spmd_scanned": {
            str(n): over(t("pp4_scanned", n), t("spmd_scanned", n)) for n in layers
        },
        "pp4_scanned_over_unrolled": {
            str(n): over(t("pp4_scanned", n), t("pp4_unrolled", n)) for n in layers
        },
        "pp4_scanned_L64_over_L4": over(t("pp4_scanned", 64), t("pp4_scanned", 4)),
        "pp4_unrolled_L64_over_L4": over(t("pp4_unrolled", 64), t("pp4_unrolled", 4)),
    }


def _fmt(x, spec=".2f") -> str:
    return "—" if x is None else format(x, spec)


def readme_table(result: dict) -> str:
    """The README's table: one row per goal of issue 24, wall and CPU."""
    w, c = result["ratios_wall"], result["ratios_cpu"]
    goals = result["goals"]
    deep = [n for n in w["pp4_scanned_over_unrolled"] if int(n) >= 8]
    worst = lambda r: max((r["pp4_scanned_over_unrolled"][n] or 0 for n in deep), default=None)  # noqa: E731
    rows = [
        (
            "PP=4 scanned / SPMD scanned compile, L=32",
            w["pp4_scanned_over_spmd_scanned"].get("32"),
            c["pp4_scanned_over_spmd_scanned"].get("32"),
            f"<= {goals['pp4_scanned_over_spmd_scanned_L32_max']}",
        ),
        (
            "PP=4 scanned, L=64 / L=4",
            w["pp4_scanned_L64_over_L4"],
            c["pp4_scanned_L64_over_L4"],
            f"<= {goals['pp4_scanned_L64_over_L4_max']}",
        ),
        (
            "PP=4 scanned / unrolled, L=32",
            w["pp4_scanned_over_unrolled"].get("32"),
            c["pp4_scanned_over_unrolled"].get("32"),
            f"<= {goals['pp4_scanned_over_unrolled_L32_max']}",
        ),
        (
            f"PP=4 scanned / unrolled, worst of L={', '.join(deep)}",
            worst(w) if deep else None,
            worst(c) if deep else None,
            "< 1",
        ),
    ]
    eo = result.get("engine_overhead") or {}
    rows.append(
        (
            "`engine_overhead` compile `mpmd_4groups` / `jax.jit`",
            eo.get("wall_ratio"),
            eo.get("cpu_ratio"),
            f"<= {goals['engine_overhead_mpmd_4groups_over_jit_max']}",
        )
    )
    lines = ["| measure | wall | CPU | goal |", "|---|---|---|---|"]
    for name, wall, cpu, goal in rows:
        lines.append(f"| {name} | {_fmt(wall)} | {_fmt(cpu)} | {goal} |")
    procs = result.get("processes") or {}
    one, two = procs.get("one_process"), procs.get("two_processes")
    if isinstance(one, list) and isinstance(two, list):
        each = ", ".join(f"process {p['process']}: {p['xla_compiles']}" for p in two)
        lines.append(
            f"| 2 processes x pp=2: task programs compiled per process (L={procs['layers']}) | "
            f"{each} | one process, both groups: {one[0]['xla_compiles']} | only its own |"
        )
    restart = result.get("restart") or {}
    warm = restart.get("warm") or {}
    if "real_compiles" in warm:
        lines.append(
            f"| restart with a warm `jax_cache_dir` (pp=4 scanned, L={restart['layers']}): real "
            f"XLA compiles | {warm['real_compiles']} | ({warm['cache_reads']} cache reads) | 0 |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per cell (median)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    ap.add_argument("--quick", action="store_true", help="L=4 and 8, one run each: a smoke run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/compile_scaling.json")
    ap.add_argument("--one", nargs=2, metavar=("L", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--restart", nargs=2, metavar=("L", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one or args.restart:
        os.chdir(ROOT)
        if args.one:
            print(json.dumps(measure_one(int(args.one[0]), args.one[1])), flush=True)
        else:
            print(json.dumps(restart_one(int(args.restart[0]), args.restart[1])), flush=True)
        return
    if args.quick:
        args.layers, args.repeats = [4, 8], 1

    from benchmarks.machine import machine_info

    info = machine_info()
    info["loadavg_start"] = os.getloadavg()
    t_start = time.perf_counter()
    cells: dict = {v: {} for v in args.variants}
    result: dict = {"machine": info, "goals": GOALS, "repeats": args.repeats, "cells": cells}

    def save(partial: bool):
        result["partial"] = partial
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    for n in args.layers:
        for v in args.variants:
            print(f"L={n:3d} {v:14s} ...", end=" ", flush=True)
            cells[v][str(n)] = c = run_cell(n, v, args.repeats, args.timeout)
            if "step_compile_s" in c:
                print(f"{c['step_compile_s']:7.2f} s wall, {c['step_compile_cpu_s']:6.2f} s CPU")
            else:
                print(c["error"])
            save(partial=True)
    deepest = max(args.layers)
    print("restart with a warm jax_cache_dir ...", flush=True)
    result["restart"] = restart_row(deepest, args.timeout)
    print("2 processes x pp=2 ...", flush=True)
    result["processes"] = processes_row(deepest, args.timeout)
    print("engine_overhead compile ...", flush=True)
    result["engine_overhead"] = engine_overhead_row(args.timeout)
    info["loadavg_end"] = os.getloadavg()
    info["wall_time_s"] = time.perf_counter() - t_start
    result["ratios_wall"] = ratios(cells, "step_compile_s")
    result["ratios_cpu"] = ratios(cells, "step_compile_cpu_s")
    save(partial=False)

    for field, label in (("step_compile_s", "wall"), ("step_compile_cpu_s", "CPU")):
        print(f"\nstep compile, {label} seconds (median of {args.repeats})")
        print(f"{'L':>3s} | " + " | ".join(f"{v:>14s}" for v in args.variants))
        for n in args.layers:
            row = [cells[v][str(n)].get(field) for v in args.variants]
            print(f"{n:3d} | " + " | ".join(f"{_fmt(x):>14s}" for x in row))
    print()
    print(readme_table(result))
    print(
        f"\nmachine: {info['cpu_count']} CPUs, load avg {info['loadavg_start'][0]:.1f} -> "
        f"{info['loadavg_end'][0]:.1f}; wrote {args.out} in {info['wall_time_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
