"""Collectives per step, counted from the compiled HLO of every task (exact, no timing).

Run from the repository root (a few minutes on 2 CPU cores; it only compiles):

    . .venv/bin/activate && python benchmarks/collectives.py

It prints a table and writes `benchmarks/results/collectives.json`.

The step: an MLP with one Megatron-style pair of matrices per stage (W1 [w, 4w], W2 [4w, w],
tanh between, residual), a mean-squared loss, `treduce` over microbatches with `jaxpp.Add`, SGD
after the loop; `Std1F1B` on 2 or 4 pipeline groups of 2 emulated CPU devices each, inside which
one of:
- `data=2`:   batch rows split P(None, "data"), weights replicated;
- `fsdp=2`:   batch rows split P(None, "fsdp"), weights split on their first dimension;
- `tensor=2`: batch replicated, W1 split by columns, W2 by rows (one all-reduce per layer pair
  in the forward and one in the backward: activation traffic, not gradient traffic).
For m in {4, 8, 16} microbatches, both `gradient_reduction` modes (and, with fsdp, "step" plus
`pipeline_fsdp_ag_once=True`), every `Run` instruction's
executable is read with `jaxpp_integration.tools.collectives.program_collectives`: launches and
bytes (per device, of each collective's result) per step by kind, plus the cross-group transfers.
The goal: gradient-reduction launches and bytes per step independent of m with "step" (they are
m x with "microbatch").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpp_integration as jaxpp  # noqa: E402
from jaxpp_integration.tools.collectives import program_collectives  # noqa: E402

WIDTH = 64
ROWS = 8  # rows per microbatch
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "transfer")


def build(num_stages: int, inner: str, m: int, mode: str, ag_once: bool = False):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * num_stages + 2)
    params = [
        {
            "w1": jax.random.normal(keys[2 * s], (WIDTH, 4 * WIDTH)) / np.sqrt(WIDTH),
            "w2": jax.random.normal(keys[2 * s + 1], (4 * WIDTH, WIDTH)) / np.sqrt(4 * WIDTH),
        }
        for s in range(num_stages)
    ]
    x = jax.random.normal(keys[-2], (m, ROWS, WIDTH))
    y = jax.random.normal(keys[-1], (m, ROWS, WIDTH))

    def loss_fn(p, batch):
        h, t = batch
        for s, layer in enumerate(p):
            h = h + jnp.tanh(h @ layer["w1"]) @ layer["w2"]
            if s < num_stages - 1:
                h = jaxpp.pipeline_enter_stage(h)
        return jnp.mean((h - t) ** 2)

    opt = optax.sgd(0.1)

    def step(params, opt_state, batch):
        loss, grads = jaxpp.treduce(
            lambda mb: jax.value_and_grad(loss_fn)(params, mb),
            batch,
            schedule=jaxpp.Std1F1B(num_stages),
            operation=jaxpp.Add,
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if inner == "data":
        pspec, bspec = {"w1": P(), "w2": P()}, P(None, "data")
    elif inner == "fsdp":
        pspec, bspec = {"w1": P("fsdp"), "w2": P("fsdp")}, P(None, "fsdp")
    else:
        pspec, bspec = {"w1": P(None, "tensor"), "w2": P("tensor")}, P()
    specs = [pspec] * num_stages
    devices = np.array(jax.devices()[: 2 * num_stages]).reshape(num_stages, 2)
    mesh = jaxpp.MpmdMesh(jax.sharding.Mesh(devices, ("stage", inner)), "stage")
    opt_state = opt.init(params)
    fn = jaxpp.mpmd_jit_with_loop(
        step,
        mpmd_mesh=mesh,
        in_specs=(specs, P(), bspec),
        gradient_reduction=mode,
        pipeline_fsdp_ag_once=ag_once,
    )
    return fn.compile(params, opt_state, (x, y))


def main():
    rows = []
    t0 = time.perf_counter()
    for num_stages in (2, 4):
        for inner in ("data", "fsdp", "tensor"):
            for m in (4, 8, 16):
                variants = [("microbatch", False), ("step", False)]
                if inner == "fsdp":
                    variants.append(("step", True))
                for mode, ag_once in variants:
                    counts = program_collectives(build(num_stages, inner, m, mode, ag_once))
                    row = {"stages": num_stages, "inner": inner, "m": m, "mode": mode}
                    row["pipeline_fsdp_ag_once"] = ag_once
                    for k in KINDS:
                        row[k] = counts[k]
                    rows.append(row)
                    print(
                        f"{num_stages} stages {inner:6s} m={m:2d} {mode:10s} "
                        + ("ag_once " if ag_once else "        ")
                        + " ".join(
                            f"{k} {counts[k]['launches']:3d} x / {counts[k]['bytes']:8d} B"
                            for k in KINDS
                        ),
                        flush=True,
                    )
    out = {
        "what": "collective launches and bytes per step, from the compiled HLO of every task",
        "model": f"MLP, per stage W1[{WIDTH},{4 * WIDTH}] W2[{4 * WIDTH},{WIDTH}], {ROWS} rows/mb",
        "schedule": "Std1F1B",
        "jax": jax.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    path = Path(__file__).parent / "results" / "collectives.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
