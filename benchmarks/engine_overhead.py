"""Engine overhead: MPMD step vs `jax.jit`, host dispatch per task, and compile time, in one run.

Run from the repository root (about 75 s on 2 CPU cores):

    . .venv/bin/activate && python benchmarks/engine_overhead.py

It prints a table and writes `benchmarks/results/engine_overhead.json`.

What is measured (the same step function everywhere: a 4-stage MLP, `treduce` over the
microbatches with `jaxpp.Add`, Adam after the loop; 8 emulated CPU devices):

1. Step time, in 5 repeats of interleaved rounds after warm-up, each step `block_until_ready`,
   outputs fed back as the next step's inputs (as a training loop does; the batch is a host
   numpy array given to every variant); the ratio to `jax.jit` is each repeat's ratio of
   median step times, and the figure reported is the median of the 5 repeats:
   - `jit_1dev`      `jax.jit(step)`: the treduce loop as a `fori_loop`, on ONE device;
   - `mpmd_1group`   `mpmd_jit_with_loop` with all 4 stages on one group
                     (`Interleaved1F1B(num_stages=4, mpmd_dim=1)`): the same single device as the
                     reference, so the ratio is the engine's own cost (work split into tasks,
                     host dispatch, lost cross-task fusion) without any pipelining effect;
   - `mpmd_4groups`  `Std1F1B(4)` on 4 groups of one emulated device each.
   The variants are timed round-robin (one step each per round) so a change in background load
   hits all of them alike; the first step's loss of every variant is checked against `jax.jit`.
   For the MPMD variants three extra steps run with `record_times=True` (each task blocked on
   and timed alone) and the median sum of task times is reported, also per task kind
   (before/fwd/bwd/after) in the JSON: it is larger than a normal step because blocking removes
   all overlap between tasks and between host dispatch and device work; the gap is what
   asynchronous dispatch buys, and the per-kind split shows which tasks are expensive.
2. Host dispatch per task instance, on a tiny model (width 8, one row per microbatch) so device
   work is negligible (programs this small run synchronously on the calling thread): the wall
   time of one whole step divided by the number of task instances (median step of each of 5
   repeats, then the median repeat) and by the number of all instructions (tasks, transfers,
   fills and the deletes the runtime folds into its releases). The time spent inside
   `runtime.execute` (the walk of the instruction list alone, without argument checks and
   output wrapping) is measured by wrapping that function from outside, and the cost of one bare
   call of one of the same compiled task executables and one bare cross-group copy (by
   `jax.device_put`, and by `jax_compat.copy_shards`, the copy the runtime makes) are given as
   the floors. A separate set of steps runs a walk prepared with timed executables and timed
   copies (`runtime.executor.prepare`) to split it into task calls, transfers, and the rest
   (releases + the engine's bookkeeping). Tasks and transfers are found through the engine's
   report (`compiled.report()`).
   Besides wall time, the CPU time of the calling thread over the step (`time.thread_time`) is
   reported: it is the host's own work and is less inflated when other processes compete for
   the cores (wall time then includes time the thread waits to be scheduled).
3. Compile time: `jax.jit(step).lower(...).compile()` vs `mpmd_jit_with_loop(step).compile(...)`,
   each after `jax.clear_caches()`, median of a few alternating repetitions; the MPMD figure is
   split into the XLA compiles of its tasks (`compile_program`, wrapped from outside) and the
   rest (tracing, partition, placement, program building). Wall time and the process's CPU time
   (`time.process_time`, all threads) are both reported: CPU time is less inflated when other
   processes load the machine. `mpmd_4groups_threads2` is the same compile with
   `compile_threads=2` (independent task programs compiled concurrently). The engine's
   `compile_stats` say how many XLA compiles ran and how many executables were loaded onto
   another group instead of compiled (`--compile-only` runs just this part).

What CPU figures can and cannot show: the 4 emulated devices share the machine's cores (2 here),
and one XLA CPU device already spreads a large matmul over all cores, so pipelining cannot run
stages in parallel and no speed-up over one device is possible; 4 groups can at best tie with
`jit_1dev`, and any bubble or oversubscription shows up as pure loss. The ratios measure the
engine's overhead on this machine; they do not carry over to GPUs, where each group owns a
device, transfers go over NVLink/NCCL instead of host memcpy, and kernels are asynchronous.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jaxpp_integration as jaxpp  # noqa: E402
from benchmarks.engine_overhead_report import print_compile, print_dispatch, print_steps  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from jaxpp_integration import api as jaxpp_api  # noqa: E402
from jaxpp_integration.jax_compat import copy_shards  # noqa: E402
from jaxpp_integration.runtime import executor as runtime_mod  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

NUM_STAGES = 4
GOALS = {
    "step_ratio": 1.10,
    "step_ratio_1group": 1.05,
    "dispatch_us_per_task": 15.0,
    "compile_ratio": 1.5,
}
REPEATS = 5  # rounds of the step-time and dispatch measurements; the median round is reported


# ----------------------------------------------------------------------------- model and step


def build(width, rows, n_mb, layers_per_stage, schedule, seed=0):
    """A 4-stage tanh MLP (markers between stages), MSE loss and Adam.

    Returns (params, opt_state, batch, step); the batch is host numpy, split into microbatches.
    """
    key = jax.random.PRNGKey(seed)
    keys = jax.random.split(key, NUM_STAGES * layers_per_stage + 2)
    params = {
        f"stage_{s}": [
            jax.random.normal(keys[s * layers_per_stage + i], (width, width)) / np.sqrt(width)
            for i in range(layers_per_stage)
        ]
        for s in range(NUM_STAGES)
    }
    x = np.asarray(jax.random.normal(keys[-2], (n_mb, rows // n_mb, width)))
    y = np.asarray(jax.random.normal(keys[-1], (n_mb, rows // n_mb, width)))

    def loss_fn(p, batch):
        h, target = batch
        for s in range(NUM_STAGES):
            for w in p[f"stage_{s}"]:
                h = jnp.tanh(h @ w)
            if s < NUM_STAGES - 1:
                h = jaxpp.pipeline_enter_stage(h)
        return jnp.mean((h - target) ** 2)

    opt = optax.adam(1e-3)

    def step(params, opt_state, batch):
        loss, grads = jaxpp.treduce(
            lambda mb: jax.value_and_grad(loss_fn)(params, mb),
            batch,
            schedule=schedule,
            operation=jaxpp.Add,
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return params, opt.init(params), (x, y), step


def mpmd_mesh(groups):
    devices = np.array(jax.devices()[:groups]).reshape(groups, 1)
    return jaxpp.MpmdMesh(Mesh(devices, ("stage", "data")), "stage")


SCHEDULES = {
    "mpmd_1group": (1, lambda: jaxpp.Interleaved1F1B(num_stages=NUM_STAGES, mpmd_dim=1)),
    "mpmd_4groups": (4, lambda: jaxpp.Std1F1B(4)),
}
REFERENCE_STEP = "mpmd_4groups"  # jax.jit compiles and runs this variant's step function


def block(tree):
    for leaf in jax.tree.leaves(tree):
        leaf.block_until_ready()
    return tree


def instr_counts(compiled):
    report = compiled.report()
    return {**report.counts, "total": report.num_instructions}


class Timed:
    """Wraps a module-level function from outside and records the wall time of each call."""

    def __init__(self, module, name):
        self.module, self.name = module, name
        self.original = getattr(module, name)
        self.times: list[float] = []

    def __enter__(self):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - t0)

        setattr(self.module, self.name, wrapper)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


# ----------------------------------------------------------------------------- 1. step time


def bench_steps(cfg, rounds, warmup, repeats=REPEATS, serialized_reps=3):
    variants, states, first_loss, compiled_by_name = {}, {}, {}, {}
    for name, (groups, make_schedule) in SCHEDULES.items():
        params, opt_state, batch, step = build(
            cfg["width"], cfg["rows"], cfg["n_mb"], cfg["layers"], make_schedule()
        )
        if name == REFERENCE_STEP:  # jax.jit runs this very step function (schedule ignored)
            variants["jit_1dev"] = jax.jit(step).lower(params, opt_state, batch).compile()
        compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(groups)).compile(
            params, opt_state, batch
        )
        variants[name] = compiled_by_name[name] = compiled
    variants = {"jit_1dev": variants.pop("jit_1dev"), **variants}
    for name, fn in variants.items():
        out = block(fn(params, opt_state, batch))
        first_loss[name] = float(np.asarray(out[2]))
        states[name] = out[:2]
        for _ in range(warmup - 1):
            out = block(fn(*states[name], batch))
            states[name] = out[:2]

    names = list(variants)
    times = {name: [] for name in variants}
    round_ratios = {n: [] for n in compiled_by_name}  # per repeat: median ratio of its steps
    for _ in range(repeats):
        this = {name: [] for name in variants}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
                t0 = time.perf_counter()
                out = block(variants[name](*states[name], batch))
                this[name].append(time.perf_counter() - t0)
                states[name] = out[:2]
        for name in names:
            times[name].extend(this[name])
        for n in compiled_by_name:
            round_ratios[n].append(statistics.median(this[n]) / statistics.median(this["jit_1dev"]))

    result = {
        "config": cfg,
        "repeats": repeats,
        "median_s": {},
        "min_s": {},
        "all_s": times,
        "first_step_loss": first_loss,
    }
    for name, ts in times.items():
        result["median_s"][name] = statistics.median(ts)
        result["min_s"][name] = min(ts)
    # the goal's figure: each repeat's ratio of medians, then the median of the repeats
    result["repeat_ratios_vs_jit"] = round_ratios
    result["ratio_vs_jit"] = {n: statistics.median(r) for n, r in round_ratios.items()}
    # per-round ratios (same round, adjacent in time): robust to slow drifts of background load
    result["median_round_ratio_vs_jit"] = {
        n: statistics.median(a / b for a, b in zip(times[n], times["jit_1dev"], strict=True))
        for n in compiled_by_name
    }
    result["serialized_task_sum_s"] = {}
    result["serialized_by_kind_s"] = {}
    result["instructions"] = {}
    for name, compiled in compiled_by_name.items():
        totals, kinds = [], {}
        for _ in range(serialized_reps):
            block(compiled(*states[name], batch, record_times=True))
            events = compiled.last_events
            totals.append(sum(t1 - t0 for *_, t0, t1 in events))
            per_kind: dict = {}
            for _, _, code, t0, t1 in events:
                kind = code.kind if code.kind != "loop" else code.name.split("_")[0]
                per_kind[kind] = per_kind.get(kind, 0.0) + (t1 - t0)
            for k, v in per_kind.items():
                kinds.setdefault(k, []).append(v)
        result["serialized_task_sum_s"][name] = statistics.median(totals)
        result["serialized_by_kind_s"][name] = {k: statistics.median(v) for k, v in kinds.items()}
        result["instructions"][name] = instr_counts(compiled)
    ref_loss = first_loss["jit_1dev"]
    result["first_step_loss_rel_diff"] = {
        n: abs(v - ref_loss) / abs(ref_loss) for n, v in first_loss.items() if n != "jit_1dev"
    }
    return result


# ----------------------------------------------------------------------------- 2. dispatch


def bench_dispatch(cfg, steps, warmup, repeats=REPEATS):
    groups, make_schedule = SCHEDULES["mpmd_4groups"]
    params, opt_state, batch, step = build(
        cfg["width"], cfg["rows"], cfg["n_mb"], cfg["layers"], make_schedule()
    )
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(groups)).compile(
        params, opt_state, batch
    )
    state = (params, opt_state)
    for _ in range(warmup):
        state = block(compiled(*state, batch))[:2]
    counts = instr_counts(compiled)
    step_times, step_cpu, walk_times, per_repeat = [], [], [], []
    for _ in range(repeats):
        this = []
        with Timed(jaxpp_api, "execute") as walk:
            for _ in range(steps):
                c0, t0 = time.thread_time(), time.perf_counter()
                out = block(compiled(*state, batch))
                this.append(time.perf_counter() - t0)
                step_cpu.append(time.thread_time() - c0)
                state = out[:2]
        step_times.extend(this)
        walk_times.extend(walk.times)
        per_repeat.append(statistics.median(this) / counts["run"] * 1e6)
    step_s = statistics.median(step_times)
    walk_s = statistics.median(walk_times)

    # breakdown of the walk: time inside task executables (wrapped in `compiled.executables`)
    # and inside transfers (the walk prepared again with timed copies: the runtime builds its
    # copy calls with `shard_copier`, or `jax.device_put` where layouts differ), for a separate
    # set of steps; the rest is releases + bookkeeping
    breakdown = {"run": [], "transfer": [], "walk": []}
    acc = {"run": 0.0, "transfer": 0.0}

    def timed(fn, kind):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[kind] += time.perf_counter() - t0

        return call

    real_walk, real_copier = compiled.walk, runtime_mod.shard_copier
    real_exes = dict(compiled.executables)
    runtime_mod.shard_copier = lambda shardings: timed(real_copier(shardings), "transfer")
    try:
        compiled.executables.update({i: timed(e, "run") for i, e in real_exes.items()})
        compiled.walk = runtime_mod.prepare(
            compiled.program, compiled.executables, compiled.slot_sharding, compiled.local_ranks
        )
        with Timed(jaxpp_api, "execute") as walk2:
            for _ in range(max(10, steps // 2)):
                acc["run"] = acc["transfer"] = 0.0
                state = block(compiled(*state, batch))[:2]
                breakdown["run"].append(acc["run"])
                breakdown["transfer"].append(acc["transfer"])
        breakdown["walk"] = walk2.times
    finally:
        compiled.walk = real_walk
        compiled.executables.update(real_exes)
        runtime_mod.shard_copier = real_copier
    # the step whose walk time is the median, so that its parts add up
    mid = sorted(range(len(breakdown["walk"])), key=breakdown["walk"].__getitem__)[
        len(breakdown["walk"]) // 2
    ]
    mid_walk_s = breakdown["walk"][mid]
    run_s, transfer_s = breakdown["run"][mid], breakdown["transfer"][mid]
    rest_s = mid_walk_s - run_s - transfer_s

    # floor: one bare call of a compiled task executable (no engine code around it)
    report = compiled.report()
    task = next(t for t in report.tasks if t.kind == "loop" and not t.donates)
    exe = compiled.executables[task.index]

    def zeros(value):
        v = report.values[value]
        return jax.device_put(np.zeros(v.aval.shape, v.aval.dtype), v.sharding)

    args = [zeros(s) for s in task.reads]
    for _ in range(20):
        block(exe(*args))
    bare = []
    for _ in range(200):
        t0 = time.perf_counter()
        block(exe(*args))
        bare.append(time.perf_counter() - t0)

    # floor: one bare cross-group copy of the same shape, as the first transfer does it
    tr = report.transfers[0]
    src, dst = zeros(tr.source), report.values[tr.value].sharding
    bare_put, bare_copy = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        jax.device_put(src, dst).block_until_ready()
        bare_put.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copy_shards([src], [dst])[0].block_until_ready()
        bare_copy.append(time.perf_counter() - t0)

    return {
        "config": cfg,
        "instructions": counts,
        "step_median_s": step_s,
        "execute_walk_median_s": walk_s,
        "us_per_task_instance": statistics.median(per_repeat),
        "us_per_task_instance_per_repeat": per_repeat,
        "step_calling_thread_cpu_median_s": statistics.median(step_cpu),
        "cpu_us_per_task_instance": statistics.median(step_cpu) / counts["run"] * 1e6,
        "us_per_instruction": step_s / counts["total"] * 1e6,
        "walk_us_per_task_instance": walk_s / counts["run"] * 1e6,
        "walk_us_per_instruction": walk_s / counts["total"] * 1e6,
        "bare_executable_call_us": statistics.median(bare) * 1e6,
        "bare_executable_task": task.name,
        "bare_transfer_us": statistics.median(bare_put) * 1e6,
        "bare_copy_shards_us": statistics.median(bare_copy) * 1e6,
        "walk_breakdown_median_ms": {
            "in_task_executables": run_s * 1e3,
            "in_transfers": transfer_s * 1e3,
            "deletes_and_bookkeeping": rest_s * 1e3,
        },
        "breakdown_walk_median_ms": mid_walk_s * 1e3,
        "engine_own_us_per_task_instance": rest_s / counts["run"] * 1e6,
    }


# ----------------------------------------------------------------------------- 3. compile time


COMPILE_VARIANTS = {  # name -> (groups, schedule, compile_threads)
    "mpmd_1group": (*SCHEDULES["mpmd_1group"], 0),
    "mpmd_4groups": (*SCHEDULES["mpmd_4groups"], 0),
    "mpmd_4groups_threads2": (*SCHEDULES["mpmd_4groups"], 2),
}


def bench_compile(cfg, reps):
    params, opt_state, batch, _ = build(
        cfg["width"], cfg["rows"], cfg["n_mb"], cfg["layers"], SCHEDULES[REFERENCE_STEP][1]()
    )
    names = ["jit_1dev", *COMPILE_VARIANTS]
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}
    xla_part = {n: [] for n in COMPILE_VARIANTS}
    n_exec, stats = {}, {}
    for _ in range(reps):
        _, _, _, step = build(
            cfg["width"], cfg["rows"], cfg["n_mb"], cfg["layers"], SCHEDULES[REFERENCE_STEP][1]()
        )
        jax.clear_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        jax.jit(step).lower(params, opt_state, batch).compile()
        times["jit_1dev"].append(time.perf_counter() - t0)
        cpu["jit_1dev"].append(time.process_time() - c0)
        for name, (groups, make_schedule, threads) in COMPILE_VARIANTS.items():
            _, _, _, step = build(
                cfg["width"], cfg["rows"], cfg["n_mb"], cfg["layers"], make_schedule()
            )
            mesh = mpmd_mesh(groups)
            jax.clear_caches()
            with Timed(jaxpp_api, "compile_program") as xla:
                t0, c0 = time.perf_counter(), time.process_time()
                compiled = jaxpp.mpmd_jit_with_loop(
                    step, mpmd_mesh=mesh, compile_threads=threads
                ).compile(params, opt_state, batch)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            xla_part[name].append(sum(xla.times))
            n_exec[name] = compiled.num_executables
            st = compiled.compile_stats
            stats[name] = {"xla_compiles": st.compiles, "loaded": st.loads, "seconds": st.seconds}
    med = {n: statistics.median(ts) for n, ts in times.items()}
    med_cpu = {n: statistics.median(ts) for n, ts in cpu.items()}
    return {
        "config": cfg,
        "median_s": med,
        "all_s": times,
        "ratio_vs_jit": {n: med[n] / med["jit_1dev"] for n in COMPILE_VARIANTS},
        "median_cpu_s": med_cpu,
        "all_cpu_s": cpu,
        "cpu_ratio_vs_jit": {n: med_cpu[n] / med_cpu["jit_1dev"] for n in COMPILE_VARIANTS},
        "mpmd_task_xla_compile_median_s": {n: statistics.median(v) for n, v in xla_part.items()},
        "mpmd_num_executables": n_exec,
        "mpmd_compile_stats": stats,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30, help="timed steps per variant (step time)")
    ap.add_argument("--dispatch-steps", type=int, default=100)
    ap.add_argument("--compile-reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/engine_overhead.json")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="run only part 3 (compile time); writes engine_overhead_compile.json instead",
    )
    args = ap.parse_args()
    if args.compile_only:
        info = machine_info()
        info["loadavg_start"] = os.getloadavg()
        step_cfg = {"width": 512, "rows": 512, "n_mb": 8, "layers": 2}
        compile_ = bench_compile(step_cfg, args.compile_reps)
        info["loadavg_end"] = os.getloadavg()
        out = args.out.with_name("engine_overhead_compile.json")
        out.write_text(
            json.dumps(
                {"machine": info, "goals": GOALS, "compile": compile_}, indent=2, default=str
            )
            + "\n"
        )
        print_compile(compile_, COMPILE_VARIANTS, GOALS)
        print(
            f"load avg {info['loadavg_start'][0]:.1f} -> {info['loadavg_end'][0]:.1f}; wrote {out}"
        )
        return

    assert jax.device_count() >= 4, "needs 4 emulated CPU devices"
    info = machine_info()
    info["loadavg_start"] = os.getloadavg()
    t_start = time.perf_counter()

    step_cfg = {"width": 512, "rows": 512, "n_mb": 8, "layers": 2}
    tiny_cfg = {"width": 8, "rows": 8, "n_mb": 8, "layers": 1}
    print(
        f"[1/3] step time (MLP width {step_cfg['width']}, batch {step_cfg['rows']}, "
        f"{step_cfg['n_mb']} microbatches, {NUM_STAGES} stages x {step_cfg['layers']} layers)",
        flush=True,
    )
    steps = bench_steps(step_cfg, args.rounds, warmup=3)
    print(f"[2/3] host dispatch (tiny model width {tiny_cfg['width']})", flush=True)
    dispatch = bench_dispatch(tiny_cfg, args.dispatch_steps, warmup=5)
    print("[3/3] compile time (same model as step time)", flush=True)
    compile_ = bench_compile(step_cfg, args.compile_reps)
    info["loadavg_end"] = os.getloadavg()
    info["wall_time_s"] = time.perf_counter() - t_start

    result = {
        "machine": info,
        "goals": GOALS,
        "step_time": steps,
        "dispatch": dispatch,
        "compile": compile_,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    print_steps(info, steps, SCHEDULES, GOALS)
    print()
    print_dispatch(dispatch, GOALS)
    print()
    print_compile(compile_, COMPILE_VARIANTS, GOALS)
    print()
    print(
        f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} "
        f"in {info['wall_time_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
