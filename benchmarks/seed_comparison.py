"""The tutorial seed's experiment: SPMD with a microbatch scan vs Std1F1B vs Interleaved1F1B.

Run from the repository root (about 2 minutes on 2 CPU cores at the default, scaled-down sizes):

    . .venv/bin/activate && python benchmarks/seed_comparison.py
    python benchmarks/seed_comparison.py --seed-sizes          # the notebook's sizes (GPU-scale)
    python benchmarks/seed_comparison.py --seq-len 512 --d-model 512 --steps 8

The same 8-layer transformer as the notebook (its `Block`: multi-head attention with
`num_heads=8, qkv_features=d_model // 8`, LayerNorm, a 4x GELU MLP, `nn.remat` + `nn.jit`), MSE
loss against the input, AdamW(1e-3), `flax.training.train_state`:

* `spmd_scan`: `jax.jit` over all devices of the mesh with ZeRO-3 sharding on axis `fsdp`, the
  microbatches accumulated with `lax.scan` (the notebook's first experiment);
* `spmd_scan_1dev`: the same `jax.jit` step on one device (not in the notebook): the plain
  compute baseline, which on a CPU host shows what emulating several devices on few cores costs;
* `std_1f1b`: `mpmd_jit_with_loop` + `treduce`, `Std1F1B(4)`, 4 stages of 2 layers each;
* `interleaved_1f1b`: `Interleaved1F1B(num_stages=8, mpmd_dim=4)`, 8 virtual stages of one layer,
  two per group.

Pipelined variants use 4 groups (`--groups`); each group gets `devices // groups` devices on its
`fsdp` axis. With fewer than 4 devices on a CPU host, 4 are emulated
(`jax_num_cpu_devices`); an accelerator host needs at least `--groups` devices.

Timing follows the notebook: `--warmup` steps, then `--steps` timed steps (each blocked on), the
same batch every step, outputs fed back as inputs. The median step time is reported, with the
losses of every step (they must agree across the variants: same initial parameters, same data).
For the pipelined variants one extra step runs with `record_times=True` (each task blocked on and
timed alone): its per-task costs give the simulated makespan and bubble of the schedule
(`jaxpp_integration.tools.measure`), its timeline is drawn to a PNG, and the engine's live-byte
accounting gives the peak bytes per group.

Writes `benchmarks/results/seed_comparison.json` (all timings, losses, machine, load) and, per
pipelined variant, `seed_comparison_<variant>_timeline.png` (the measured step, tasks one at a
time) and `seed_comparison_<variant>_simulated.png` (the schedule replayed with those measured
task costs: what the step looks like when groups overlap) next to it.

What CPU figures can and cannot show: emulated devices share the host's cores (2 here), so groups
cannot compute in parallel and pipelining cannot beat the SPMD step; on such a host step times
compare the engine's overhead and schedules' bubbles against one SPMD program, nothing more. The
simulated bubble and the per-group memory carry over to GPUs; the step times do not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpp_integration as jaxpp
from jaxpp_integration.tools.measure import measure_step, to_events
from jaxpp_integration.tools.timeline import draw_timeline

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="global batch (notebook: 8)")
    p.add_argument("--seq-len", type=int, default=256, help="notebook: 2048")
    p.add_argument("--d-model", type=int, default=256, help="notebook: 1024 (mlp = 4 x d_model)")
    p.add_argument("--layers", type=int, default=8, help="notebook: 8")
    p.add_argument("--microbatches", type=int, default=4, help="notebook: 4")
    p.add_argument("--groups", type=int, default=4, help="pipeline groups (notebook: 4)")
    p.add_argument(
        "--seed-sizes",
        action="store_true",
        help="use the notebook's sizes (batch 8, seq 2048, d_model 1024): GPU-scale",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    p.add_argument(
        "--variants",
        default="spmd_scan,spmd_scan_1dev,std_1f1b,interleaved_1f1b",
        help="comma-separated; spmd_scan_1dev is the same jax.jit step on one device",
    )
    p.add_argument("--emulate-cpu-devices", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/seed_comparison.json"))
    p.add_argument("--no-timelines", action="store_true", help="skip the timeline PNGs")
    args = p.parse_args(argv)
    if args.seed_sizes:
        args.batch, args.seq_len, args.d_model = 8, 2048, 1024
    if args.batch % args.microbatches:
        p.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    if args.layers % (2 * args.groups):
        p.error(
            f"--layers {args.layers} must be a multiple of 2 x --groups ({2 * args.groups}) "
            "for 2 virtual stages per group"
        )
    if args.d_model % 64:
        p.error(f"--d-model {args.d_model} must be a multiple of 64 (8 heads of d_model // 8)")
    return args


# ------------------------------------------------------------------------------------- the model


def build_model(d_model: int, num_layers: int):
    """The notebook's Block and (annotated) Transformer, with its sizes as parameters."""

    class Block(nn.Module):
        d_model: int

        @nn.remat
        @nn.jit
        @nn.compact
        def __call__(self, x):
            attn = nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=self.d_model // 8)
            x = nn.LayerNorm()(x + attn(x))
            h = nn.gelu(nn.Dense(features=4 * self.d_model)(x))
            x = x + nn.Dense(features=x.shape[-1])(h)
            return nn.LayerNorm()(x)

    class AnnotatedTransformer(nn.Module):
        """A stage marker after every `num_layers // num_stages` blocks (no-ops under jax.jit)."""

        num_stages: int

        @nn.compact
        def __call__(self, x):
            for i in range(num_layers):
                x = Block(d_model, name=f"block_{i}")(x)
                if (i + 1) % (num_layers // self.num_stages) == 0:
                    x = jaxpp.pipeline_enter_stage(x)
            return x

    return AnnotatedTransformer


# -------------------------------------------------------------------------------- the steps


def loss_fn(state, params, x, targets):
    x, targets = jax.lax.with_sharding_constraint((x, targets), P("fsdp"))
    return jnp.mean((state.apply_fn({"params": params}, x) - targets) ** 2)


def spmd_step(state, xs, targets, n_mb):
    grad_fn = jax.value_and_grad(partial(loss_fn, state))

    def scan_fn(carry, inp):
        loss, grads = grad_fn(state.params, *inp)
        return jax.tree.map(jnp.add, carry, (loss, grads)), ()

    split = lambda a: a.reshape(n_mb, -1, *a.shape[1:])
    (loss, grads), _ = jax.lax.scan(
        scan_fn, jax.tree.map(jnp.zeros_like, (0.0, state.params)), (split(xs), split(targets))
    )
    return state.apply_gradients(grads=grads), loss


def pipelined_step(state, xs, targets, n_mb, schedule):
    grad_fn = jax.value_and_grad(partial(loss_fn, state))
    split = lambda a: a.reshape(n_mb, -1, *a.shape[1:])
    loss, grads = jaxpp.treduce(
        lambda inp: grad_fn(state.params, *inp),
        (split(xs), split(targets)),
        schedule=schedule,
        operation=jaxpp.Add,
    )
    return state.apply_gradients(grads=grads), loss


def fsdp_shardings(mesh, state, fsdp: int):
    """The notebook's ZeRO-3 layout: every array's first axis on `fsdp` (if it divides)."""

    def spec(leaf):
        shape = getattr(leaf, "shape", ())
        return P("fsdp") if len(shape) > 0 and shape[0] % fsdp == 0 else P()

    return (
        jax.tree.map(lambda leaf: NamedSharding(mesh, spec(leaf)), state),
        NamedSharding(mesh, P("fsdp")),
        NamedSharding(mesh, P("fsdp")),
    )


def block(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if hasattr(leaf, "block_until_ready"):
            leaf.block_until_ready()


def train(step, state, xs, ys, warmup: int, steps: int):
    """The notebook's `train_with_progress`: warm-up, then timed steps, each blocked on."""
    losses, times = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, loss = step(state, xs, ys)
        block((state, loss))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(np.asarray(loss)))
    return state, losses, times


# ------------------------------------------------------------------------------------- variants


def run_variant(name: str, args, devices, xs, out_dir: Path, draw: bool) -> dict:
    model_cls = build_model(args.d_model, args.layers)
    n_mb, groups = args.microbatches, args.groups
    stages = 2 * groups if name == "interleaved_1f1b" else groups
    model = model_cls(num_stages=stages)
    params = model.init(jax.random.PRNGKey(0), xs[: args.batch // n_mb])["params"]
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adamw(learning_rate=1e-3)
    )
    result: dict = {"variant": name, "stages": stages}
    t0 = time.perf_counter()
    if name.startswith("spmd_scan"):
        spmd_devices = devices[:1] if name == "spmd_scan_1dev" else devices
        mesh = jax.sharding.Mesh(np.array(spmd_devices), ("fsdp",))
        in_sh = fsdp_shardings(mesh, state, len(spmd_devices))
        with jax.set_mesh(mesh):
            compiled = (
                jax.jit(partial(spmd_step, n_mb=n_mb), in_shardings=in_sh)
                .lower(state, xs, xs)
                .compile()
            )
        result["compile_s"] = time.perf_counter() - t0
        result["devices"] = len(spmd_devices)
        state, x, y = jax.device_put((state, xs, xs), in_sh)
        _, losses, times = train(compiled, state, x, y, args.warmup, args.steps)
        mem = compiled.memory_analysis()
        if mem is not None:
            result["xla_temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0))
    else:
        per_group = len(devices) // groups
        grid = np.array(devices[: groups * per_group]).reshape(groups, per_group)
        mesh = jax.sharding.Mesh(grid, ("stage", "fsdp"))
        mpmd_mesh = jaxpp.MpmdMesh(mesh, "stage")
        schedule = (
            jaxpp.Std1F1B(groups)
            if name == "std_1f1b"
            else jaxpp.Interleaved1F1B(num_stages=stages, mpmd_dim=groups)
        )
        specs = jax.tree.map(lambda s: s.spec, fsdp_shardings(mesh, state, per_group))
        compiled = jaxpp.mpmd_jit_with_loop(
            partial(pipelined_step, n_mb=n_mb, schedule=schedule),
            in_specs=specs,
            out_specs=(specs[0], P()),
            mpmd_mesh=mpmd_mesh,
        ).compile(state, xs, xs)
        result["compile_s"] = time.perf_counter() - t0
        result["devices"] = groups * per_group
        result["schedule"] = repr(schedule)
        result["num_executables"] = compiled.num_executables
        state, losses, times = train(compiled, state, xs, xs, args.warmup, args.steps)
        compiled(state, xs, xs, record_times=True)
        measured = measure_step(compiled.last_events, schedule, n_microbatches=n_mb)
        result["measured"] = measured.as_dict()
        result["peak_bytes_per_group"] = list(compiled.last_memory.peak_bytes)
        result["peak_activation_bytes_per_group"] = list(compiled.last_memory.peak_activation_bytes)
        if draw:
            png = out_dir / f"seed_comparison_{name}_timeline.png"
            title = (
                f"measured {schedule!r}, {n_mb} microbatches, one task at a time (ms); "
                f"simulated bubble from these costs {measured.simulated_bubble:.1%}"
            )
            draw_timeline(to_events(compiled.last_events), groups, png, title=title)
            sim_png = out_dir / f"seed_comparison_{name}_simulated.png"
            title = (
                f"simulated {schedule!r}, {n_mb} microbatches, measured task costs (ms): "
                f"makespan {measured.simulated_makespan:.0f} ms, "
                f"bubble {measured.simulated_bubble:.1%}"
            )
            draw_timeline(measured.simulation.events, groups, sim_png, title=title)
            result["timeline_pngs"] = [_rel(png), _rel(sim_png)]
    result["losses"] = losses
    result["step_times_s"] = times
    result["step_time_median_s"] = statistics.median(times) if times else None
    return result


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO) if path.resolve().is_relative_to(REPO) else path)


def machine_info() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    devices = jax.devices()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "git_commit": commit,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    # emulated CPU devices must be requested before JAX initialises a backend; this setting
    # affects the CPU platform only, so accelerators are used as they are
    jax.config.update("jax_num_cpu_devices", max(args.emulate_cpu_devices, args.groups))
    devices = jax.devices()
    if len(devices) < args.groups:
        print(
            f"error: {len(devices)} {jax.default_backend()} device(s) but --groups {args.groups} "
            f"needs at least {args.groups}; use --groups {len(devices)} or fewer",
            file=sys.stderr,
        )
        return 2
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = ("spmd_scan", "spmd_scan_1dev", "std_1f1b", "interleaved_1f1b")
    for v in variants:
        if v not in known:
            print(f"error: unknown variant {v!r}; use {', '.join(known)}", file=sys.stderr)
            return 2
    devices = devices[: (len(devices) // args.groups) * args.groups]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    xs = jax.random.normal(jax.random.PRNGKey(1), (args.batch, args.seq_len, args.d_model))
    xs = np.asarray(xs)
    print(
        f"{len(devices)} x {devices[0].platform} device(s), {os.cpu_count()} CPU cores; "
        f"batch {args.batch}, seq {args.seq_len}, d_model {args.d_model}, {args.layers} layers, "
        f"{args.microbatches} microbatches, {args.groups} pipeline groups",
        flush=True,
    )
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    results = []
    for name in variants:
        print(f"  {name}: compiling and running ...", flush=True)
        results.append(run_variant(name, args, devices, xs, out.parent, not args.no_timelines))
    wall = time.perf_counter() - t_start

    base = next((r for r in results if r["variant"] == "spmd_scan"), None)
    header = f"{'variant':<18} {'step (median)':>13} {'vs spmd':>8} {'compile':>8}  "
    header += f"{'sim. bubble':>11}  losses (every step)"
    print("\n" + header)
    for r in results:
        rel = (
            f"{r['step_time_median_s'] / base['step_time_median_s']:.2f}x"
            if base and r is not base
            else "-"
        )
        bubble = f"{r['measured']['simulated_bubble']:.1%}" if "measured" in r else "-"
        losses = " ".join(f"{v:.6f}" for v in r["losses"])
        print(
            f"{r['variant']:<18} {r['step_time_median_s'] * 1e3:>10.1f} ms {rel:>8} "
            f"{r['compile_s']:>7.1f}s  {bubble:>11}  {losses}"
        )
    first = [r["losses"][0] for r in results]
    agree = max(first) - min(first) <= 1e-5 * max(1.0, abs(first[0]))
    print(f"first-step losses agree across variants: {agree}")
    load_after = os.getloadavg()
    print(f"wall time {wall:.0f} s; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")

    report = {
        "benchmark": "seed_comparison",
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "wall_time_s": wall,
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "first_step_losses_agree": agree,
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
