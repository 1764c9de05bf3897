"""Benchmark sweep: run the real trainer over a grid of pipeline settings; one CSV row per point.

    python benchmarks/sweep.py configs/base.yml --pipeline-parallelism 1,2,4 \\
        --schedules gpipe,1f1b,interleaved_1f1b --microbatches 4,8,16 [key=value ...]

Each point is one `train.py` run in its own process (so each gets the device count it needs: the
trainer emulates CPU devices when there is no accelerator), `--warmup` + `--steps` + 1 steps with
a metrics record every step, evaluation, TensorBoard and checkpoints off. Any other trainer key is
passed through as `key=value` (e.g. `model_name=tiny dataset_type=synthetic`).

Points. Every (pipeline_parallelism, schedule, microbatches) of the grid with
pipeline_parallelism > 1, plus the SPMD baseline `pipeline_parallelism=1` (gradient accumulation
over the same microbatches; the schedule does not apply) once per microbatch count — whether or not
1 is in `--pipeline-parallelism`, unless `--no-baseline`. `interleaved_1f1b` runs
`--interleaved-repeats` (default 2) virtual stages per group, `dualpipev` 2, the others 1.
Before anything runs, each point's configuration is loaded and validated by the trainer's own
`MaxText.config.load_config`; an invalid combination (e.g. interleaved_1f1b needs the microbatches
to be a multiple of pipeline_parallelism, or more stages than layers) is skipped with the
trainer's message as the reason, printed and kept in the CSV (`status=skipped`).

Columns (see `COLUMNS`): the point and its resolved config, step time (median over the timed
steps), tokens/s/device, TFLOP/s/device and MFU at that step time (the trainer's formulas, from
its metrics.jsonl), compile time (the trainer's `compile_seconds`), the simulated bubble and peak
live activations per rank of the schedule with unit costs (forward 1, backward 2;
`jaxpp_integration.schedules.simulate`), and the measured peak live bytes per group of the last
step (the engine's accounting, `last_memory`; pipelined points only).

How the per-point figures are read. The trainer writes metrics.jsonl (its documented contract);
compile time and live bytes are not in it, so each point runs in a small worker
(`sweep.py --worker`) that calls the unmodified `MaxText.train.main(argv)` and keeps a reference
to the `Trainer` it builds (by wrapping `MaxText.train.build_trainer` from outside) to read
`trainer.compile_seconds` and `trainer.train_step.last_memory` after training. Step time: the
trainer logs, per step, the interval between consecutive step completions; it reads step N's
metrics after dispatching step N+1, and when a pipelined step's dispatch does not return before
the step has run (small CPU programs), step N's interval holds step N+1's work and the last
step's is ~0. The sweep therefore runs one step more than it times and takes the median of the
intervals after the warm-up, the last one excluded: each is one whole step either way.

Outputs in `--out` (default `benchmarks/results/sweep`): `sweep.csv`, `sweep.json` (rows, command,
machine, wall time), `sweep_step_time_bubble.png` (step time and simulated bubble vs microbatches,
one line per schedule and pipeline size, the baseline dashed), `sweep_memory.png` (peak live
bytes per group per point). The trainer's own run directories go to `--runs-dir`
(default `outputs/sweep`, git-ignored).

CPU figures: emulated devices share the host's cores, so step times cannot show a pipeline
speed-up (two cores cap it); the simulated bubble and the live bytes per group carry over to GPUs.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COLUMNS = [
    "point",
    "status",
    "reason",
    "pipeline_parallelism",
    "schedule",
    "num_pipeline_microbatches",
    "num_pipeline_repeats",
    "num_stages",
    "num_devices",
    "global_batch_size",
    "max_target_length",
    "config",
    "timed_steps",
    "step_time_s",
    "step_time_min_s",
    "tokens_per_s_per_device",
    "tflops_per_s_per_device",
    "mfu",
    "compile_s",
    "simulated_bubble",
    "simulated_peak_live_activations",
    "peak_live_bytes_per_group",
    "peak_activation_bytes_per_group",
    "final_loss",
    "wall_s",
    "run_dir",
]
# keys the sweep sets on every point; pass them through its own flags instead
SWEEP_KEYS = {
    "ici_pipeline_parallelism": "--pipeline-parallelism",
    "pipeline_parallelism": "--pipeline-parallelism",
    "pipeline_schedule": "--schedules",
    "num_pipeline_microbatches": "--microbatches",
    "steps": "--steps / --warmup",
    "log_period": "(always 1)",
    "run_name": "(one per point)",
    "base_output_directory": "--runs-dir",
}
FIXED = {
    "eval_interval": "0",
    "enable_tensorboard": "false",
    "enable_progress_bar": "false",
    "enable_checkpointing": "false",
}


@dataclass
class Point:
    pp: int
    schedule: str  # "spmd" for the baseline
    microbatches: int
    repeats: int
    argv: list[str] = field(default_factory=list)
    row: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.pp == 1:
            return f"pp1_spmd_m{self.microbatches}"
        rep = f"_v{self.repeats}" if self.repeats > 1 else ""
        return f"pp{self.pp}_{self.schedule}{rep}_m{self.microbatches}"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/sweep.py",
        description="Run the trainer over a grid of pipeline settings; write a CSV and plots.",
    )
    p.add_argument("config", help="trainer YAML, e.g. configs/base.yml")
    p.add_argument("overrides", nargs="*", help="trainer key=value overrides for every point")
    p.add_argument("--pipeline-parallelism", type=_int_list, default=[1, 2, 4])
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    p.add_argument("--microbatches", type=_int_list, default=[4, 8, 16])
    p.add_argument("--interleaved-repeats", type=int, default=2)
    p.add_argument("--no-baseline", action="store_true", help="no pipeline_parallelism=1 rows")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per point (>= 1)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/sweep"))
    p.add_argument("--runs-dir", default=str(REPO / "outputs/sweep"))
    p.add_argument("--quiet", action="store_true", help="no per-point lines, progress bar only")
    args = p.parse_intermixed_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step includes first-call costs)")
    args.schedules = [s.strip().lower() for s in args.schedules.split(",") if s.strip()]
    from jaxpp_integration.schedules import SCHEDULE_NAMES

    for s in args.schedules:
        if s not in SCHEDULE_NAMES:
            p.error(f"unknown schedule {s!r}; use some of {', '.join(SCHEDULE_NAMES)}")
    for kv in args.overrides:
        key = kv.split("=", 1)[0]
        if "=" not in kv:
            p.error(f"{kv!r}: trainer overrides are key=value")
        if key in SWEEP_KEYS:
            p.error(f"{key} is set by the sweep for each point; use {SWEEP_KEYS[key]}")
    return args


# ------------------------------------------------------------------------------------ the grid


def make_points(args) -> list[Point]:
    points = []
    if not args.no_baseline:
        points += [Point(1, "spmd", m, 1) for m in args.microbatches]
    for pp in args.pipeline_parallelism:
        if pp == 1:
            continue
        for sched in args.schedules:
            repeats = {"interleaved_1f1b": args.interleaved_repeats, "dualpipev": 2}.get(sched, 1)
            points += [Point(pp, sched, m, repeats) for m in args.microbatches]
    return points


def point_argv(args, point: Point, run_name: str) -> list[str]:
    argv = [args.config, *args.overrides]
    argv += [
        f"ici_pipeline_parallelism={point.pp}",
        f"num_pipeline_microbatches={point.microbatches}",
        f"steps={args.warmup + args.steps + 1}",
        "log_period=1",
        f"run_name={run_name}",
        f"base_output_directory={args.runs_dir}",
        *(f"{k}={v}" for k, v in FIXED.items() if not any(o.startswith(k + "=") for o in argv)),
    ]
    if point.pp > 1:
        argv.append(f"pipeline_schedule={point.schedule}")
        if not any(o.startswith("num_pipeline_repeats=") for o in args.overrides):
            argv.append(f"num_pipeline_repeats={point.repeats}")
    return argv


def validate(point: Point) -> str | None:
    """None if the trainer accepts the point's config, else its one-line reason; fills the row."""
    from MaxText.config import ConfigError, load_config

    try:
        cfg = load_config(point.argv)
    except ConfigError as e:
        return str(e)
    point.repeats = cfg.num_pipeline_repeats if point.pp > 1 else 1
    point.row.update(
        num_pipeline_repeats=point.repeats,
        num_stages=cfg.num_stages if point.pp > 1 else 1,
        num_devices=cfg.num_devices,
        global_batch_size=cfg.global_batch_size,
        max_target_length=cfg.max_target_length,
    )
    if point.pp > 1:
        from jaxpp_integration.schedules import ScheduleError, schedule_from_name
        from jaxpp_integration.schedules.simulate import Costs, simulate

        try:
            sim = simulate(
                schedule_from_name(point.schedule, cfg.num_stages, point.pp),
                point.microbatches,
                Costs(),
            )
        except ScheduleError as e:
            return str(e).splitlines()[0]
        point.row.update(
            simulated_bubble=round(sim.bubble, 6),
            simulated_peak_live_activations=";".join(map(str, sim.peak_live_activations)),
        )
    return None


# ------------------------------------------------------------------------------- one point


def child_env() -> dict[str, str]:
    """The environment of a point: no inherited CPU device count (the trainer sets its own)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def read_metrics(path: Path, warmup: int, steps: int) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records if "step_time_s" in r}
    timed = [by_step[s] for s in range(warmup + 1, warmup + steps + 1) if s in by_step]
    if not timed:
        raise ValueError(f"{path} has no records for steps {warmup + 1}..{warmup + steps}")
    step_time = statistics.median(r["step_time_s"] for r in timed)

    def at_median(key: str) -> float:  # these are all proportional to 1 / step time
        return statistics.median(r[key] * r["step_time_s"] for r in timed) / step_time

    last = max(records, key=lambda r: r["step"])
    return {
        "timed_steps": len(timed),
        "step_time_s": step_time,
        "step_time_min_s": min(r["step_time_s"] for r in timed),
        "tokens_per_s_per_device": at_median("tokens_per_s_per_device"),
        "tflops_per_s_per_device": at_median("tflops_per_s_per_device"),
        "mfu": at_median("mfu"),
        "final_loss": last["loss"],
    }


def run_point(args, point: Point, run_name: str, log) -> None:
    run_dir = Path(args.runs_dir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    sidecar = run_dir / "sweep_worker.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(sidecar), *point.argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = None, e.stdout or "", e.stderr or ""
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
    point.row["wall_s"] = round(time.perf_counter() - t0, 2)
    point.row["run_dir"] = _rel(run_dir)
    (run_dir / "stdout.txt").write_text(stdout)
    (run_dir / "stderr.txt").write_text(stderr)
    if code != 0:
        tail = [ln for ln in (stderr or stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        why = f"timed out after {args.timeout:g} s" if code is None else f"exit code {code}"
        point.row.update(status="failed", reason=f"{why}: {tail[0][:300]}")
        log(f"  {point.name}: FAILED ({point.row['reason']}); logs in {point.row['run_dir']}")
        return
    try:
        point.row.update(read_metrics(run_dir / "metrics.jsonl", args.warmup, args.steps))
    except (OSError, ValueError, KeyError) as e:
        point.row.update(status="failed", reason=f"metrics unreadable: {e}")
        log(f"  {point.name}: FAILED ({point.row['reason']})")
        return
    info = json.loads(sidecar.read_text()) if sidecar.exists() else {}
    if "compile_s" in info:
        point.row["compile_s"] = round(info["compile_s"], 3)
    for key in ("peak_live_bytes_per_group", "peak_activation_bytes_per_group"):
        if info.get(key):
            point.row[key] = ";".join(str(int(b)) for b in info[key])
    point.row["status"] = "ok"
    log(
        f"  {point.name}: {point.row['step_time_s'] * 1e3:.1f} ms/step, "
        f"{point.row['tokens_per_s_per_device']:,.0f} tokens/s/device, "
        f"compile {point.row.get('compile_s', float('nan')):.1f} s"
        + (
            f", simulated bubble {point.row['simulated_bubble']:.1%}"
            if "simulated_bubble" in point.row
            else ""
        )
    )


def worker(sidecar: str, train_argv: list[str]) -> int:
    """One point: the unmodified trainer entry point, plus what its Trainer object knows."""
    import MaxText.train as train_mod

    built = []
    build = train_mod.build_trainer

    def build_and_keep(*a, **k):
        trainer = build(*a, **k)
        built.append(trainer)
        return trainer

    train_mod.build_trainer = build_and_keep
    code = train_mod.main(train_argv)
    info: dict = {"exit_code": code}
    if built:
        trainer = built[-1]
        info["compile_s"] = getattr(trainer, "compile_seconds", None)
        memory = getattr(trainer.train_step, "last_memory", None)  # MPMD steps only
        if memory is not None:
            info["peak_live_bytes_per_group"] = list(memory.peak_bytes)
            info["peak_activation_bytes_per_group"] = list(memory.peak_activation_bytes)
    Path(sidecar).write_text(json.dumps(info) + "\n")
    return code


# --------------------------------------------------------------------------------------- plots


def _num(row: dict, key: str) -> float | None:
    value = row.get(key)
    return None if value in (None, "") else float(value)


def plot_step_time_and_bubble(rows: list[dict], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax_t, ax_b = fig.subplots(1, 2)
    series: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        if r.get("status") in ("ok", "failed"):
            series.setdefault((int(r["pipeline_parallelism"]), r["schedule"]), []).append(r)
    # colour per line, marker per pipeline size, line style per schedule: schedules with equal
    # bubbles (GPipe and 1F1B have the same one) stay visible where their lines overlap
    markers = {2: "o", 4: "s", 8: "^"}
    dashes = {"gpipe": ":", "1f1b": "-", "interleaved_1f1b": "-.", "spmd": "--"}
    for i, ((pp, sched), rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: int(r["num_pipeline_microbatches"]))
        label = "SPMD baseline (pp=1)" if pp == 1 else f"{sched} pp={pp}"
        style = dict(
            marker=markers.get(pp, "D"),
            markersize=9 - 1.5 * (i % 3),
            linestyle=dashes.get(sched, (0, (5, 1, 1, 1))),
            linewidth=2.2 if sched == "gpipe" else 1.5,
            color="black" if pp == 1 else f"C{i}",
        )
        pts = [
            (int(r["num_pipeline_microbatches"]), 1e3 * _num(r, "step_time_s"))
            for r in rs
            if r.get("status") == "ok"
        ]
        if pts:
            ax_t.plot(*zip(*pts, strict=True), label=label, **style)
        if pp > 1:
            bub = [(int(r["num_pipeline_microbatches"]), _num(r, "simulated_bubble")) for r in rs]
            bub = [(m, 100 * b) for m, b in bub if b is not None]
            if bub:
                ax_b.plot(*zip(*bub, strict=True), label=label, **style)
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches per step")
        ax.grid(alpha=0.3)
        ms = sorted({int(r["num_pipeline_microbatches"]) for r in rows})
        if ms:
            ax.set_xticks(ms, [str(m) for m in ms])
    ax_t.set_ylabel("step time (ms, median)")
    ax_t.set_title("measured step time")
    ax_b.set_ylabel("bubble (% of rank-time idle)")
    ax_b.set_title("simulated bubble (forward 1, backward 2)")
    ax_b.set_ylim(bottom=0)
    for ax in (ax_t, ax_b):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_memory(rows: list[dict], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    have = [r for r in rows if r.get("status") == "ok" and r.get("peak_live_bytes_per_group")]
    fig = Figure(figsize=(max(8, 0.9 * len(have) + 3), 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if not have:
        ax.text(0.5, 0.5, "no pipelined point with measured live bytes", ha="center")
        ax.set_axis_off()
    else:
        n_groups = max(len(r["peak_live_bytes_per_group"].split(";")) for r in have)
        width = 0.8 / n_groups
        for g in range(n_groups):
            xs, total, acts = [], [], []
            for i, r in enumerate(have):
                per = [int(b) for b in r["peak_live_bytes_per_group"].split(";")]
                act = [int(b) for b in (r.get("peak_activation_bytes_per_group") or "").split(";")]
                if g < len(per):
                    xs.append(i - 0.4 + (g + 0.5) * width)
                    total.append(per[g] / 2**20)
                    acts.append(act[g] / 2**20 if g < len(act) else 0.0)
            color = f"C{g}"
            ax.bar(xs, total, width, color=color, alpha=0.45, label=f"group {g}: all live")
            ax.bar(xs, acts, width, color=color, label=f"group {g}: activations")
        ax.set_xticks(range(len(have)), [r["point"] for r in have], rotation=30, ha="right")
        ax.set_ylabel("peak live MiB (engine accounting)")
        ax.set_title("peak live bytes per pipeline group (last measured step)")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


# ---------------------------------------------------------------------------------------- main


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k, "") for k in COLUMNS})


def machine_info() -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "git_commit": commit,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2:])
    args = parse_args(argv)
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    sweep_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    points = make_points(args)
    runnable = []
    for point in points:
        point.argv = point_argv(args, point, f"sweep{sweep_id}_{point.name}")
        point.row = {
            "point": point.name,
            "pipeline_parallelism": point.pp,
            "schedule": point.schedule,
            "num_pipeline_microbatches": point.microbatches,
            "num_pipeline_repeats": point.repeats,
            "config": " ".join(shlex.quote(a) for a in point.argv),
        }
        reason = validate(point)
        if reason is not None:
            point.row.update(status="skipped", reason=reason)
            print(f"skip {point.name}: {reason}")
        else:
            runnable.append(point)
    print(
        f"{len(runnable)} point(s) to run, {len(points) - len(runnable)} skipped; "
        f"{args.warmup} warm-up + {args.steps} timed step(s) each; "
        f"trainer runs in {_rel(Path(args.runs_dir))}",
        flush=True,
    )
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    bar = tqdm(runnable, unit="point", dynamic_ncols=True, file=sys.stderr)
    log = (lambda msg: None) if args.quiet else (lambda msg: bar.write(msg, file=sys.stdout))
    for point in bar:
        bar.set_postfix_str(point.name)
        run_point(args, point, f"sweep{sweep_id}_{point.name}", log)
    bar.close()
    wall = time.perf_counter() - t0
    rows = [p.row for p in points]
    write_csv(rows, out / "sweep.csv")
    plot_step_time_and_bubble(rows, out / "sweep_step_time_bubble.png")
    plot_memory(rows, out / "sweep_memory.png")
    n_ok = sum(r.get("status") == "ok" for r in rows)
    n_failed = sum(r.get("status") == "failed" for r in rows)
    (out / "sweep.json").write_text(
        json.dumps(
            {
                "command": "python benchmarks/sweep.py " + " ".join(shlex.quote(a) for a in argv),
                "machine": machine_info(),
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
                "wall_time_s": wall,
                "points": len(points),
                "ok": n_ok,
                "failed": n_failed,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(
        f"{n_ok} ok, {n_failed} failed, {len(points) - len(runnable)} skipped in {wall:.0f} s; "
        f"wrote {_rel(out / 'sweep.csv')}, {_rel(out / 'sweep_step_time_bubble.png')}, "
        f"{_rel(out / 'sweep_memory.png')}"
    )
    return 1 if n_failed else 0


if __name__ == "__main__":
    sys.exit(main())
