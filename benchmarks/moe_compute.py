"""The MoE block's grouped expert compute against a dense einsum of every token through every
expert, and a MoE training step against a dense model of the same active FLOPs (CPU, ratios).

    python benchmarks/moe_compute.py [--repeats N] [--quick]

1. Grouped vs dense (`grouped`): forward + backward of one MoE feed-forward on one device, T
   tokens (1,024 token-slots: 512 tokens x k = 2), width 128, experts 256 wide, at 8 and 32
   experts: `MaxText.model.moe.experts_local` with `moe_matmul=blocks` (sorted slots in padded
   blocks, a scan; the CPU default) and `ragged_dot` (`jax.lax.ragged_dot`: a masked dense matmul
   on XLA:CPU), against the dense form (every token through every expert, weighted by its
   routing weights, zero for the experts it did not pick): the same outputs, E / k times the
   work. The grouped path must win at 8 experts and more.
2. MoE vs dense step (`step`): the `tiny-moe` preset (8 experts of 192, top 2) against the
   `tiny` llama with `mlp_dim` = 2 x 192 (the same active FLOPs per token, the router aside),
   one SPMD device, default keys otherwise: median step time over `--repeats` steps after 2
   warm-up steps.

Median of `--repeats` timed calls each (after compiling); JSON on stdout and in
benchmarks/results/moe_compute.json. Timings are the lead's to take on a quiet machine; the
script runs in about a minute (`--quick`: 3 repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.model import moe

OUT = Path(__file__).resolve().parent / "results" / "moe_compute.json"
TOKENS, K, D, F = 512, 2, 128, 256


def dense_all_experts(x, weights, ids, wg, wu, wd):
    """Every token through every expert; the k picked ones weighted, the others by zero."""
    num = wg.shape[0]
    combine = jnp.sum(jax.nn.one_hot(ids, num, dtype=x.dtype) * weights[..., None], axis=1)
    gate = jnp.einsum("td,edf->tef", x, wg)
    up = jnp.einsum("td,edf->tef", x, wu)
    y = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, wd)
    return jnp.einsum("te,ted->td", combine, y)


def _median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def grouped(repeats: int) -> list[dict]:
    rows = []
    for experts in (8, 32):
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(TOKENS, D)), jnp.float32)
        logits = jnp.asarray(rng.normal(size=(TOKENS, experts)), jnp.float32)
        weights, ids, _ = moe.route(logits, K, True)
        wg, wu = (jnp.asarray(rng.normal(size=(experts, D, F)) / D**0.5, jnp.float32)
                  for _ in range(2))  # fmt: skip
        wd = jnp.asarray(rng.normal(size=(experts, F, D)) / F**0.5, jnp.float32)
        forms = {
            "dense_einsum": dense_all_experts,
            "blocks": lambda *a: moe.experts_local(*a, matmul="blocks"),
            "ragged_dot": lambda *a: moe.experts_local(*a, matmul="ragged_dot"),
        }
        row = {"experts": experts, "token_slots": TOKENS * K, "width": D, "expert_width": F}
        outs = {}
        for name, form in forms.items():
            # the routing is an argument, not a constant: XLA would otherwise sort the ids at
            # compile time and the grouped forms' timings would leave out their sort
            def loss(x, weights, ids, wg, wu, wd, form=form):
                return jnp.sum(form(x, weights, ids, wg, wu, wd) ** 2)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3, 4, 5)))
            args = (x, weights, ids, wg, wu, wd)
            outs[name] = step(*args)[0]
            row[f"{name}_ms"] = round(_median_ms(step, args, repeats), 3)
        ref = float(outs["dense_einsum"])
        row["same_loss"] = all(abs(float(v) - ref) <= 1e-4 * abs(ref) for v in outs.values())
        row["dense_over_blocks"] = round(row["dense_einsum_ms"] / row["blocks_ms"], 2)
        rows.append(row)
    return rows


def step(repeats: int) -> list[dict]:
    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.train_step import batch_shapes, build_trainer

    models = {
        "tiny-moe": ["model_name=tiny-moe"],
        "tiny dense, mlp_dim=384 (same active FLOPs)": ["model_name=tiny", "mlp_dim=384"],
    }
    rows = []
    for name, keys in models.items():
        config = load_config([str(CONFIGS_DIR / "base.yml"), *keys, "dataset_type=synthetic",
                              "per_device_batch_size=8", "enable_checkpointing=false"])  # fmt: skip
        trainer = build_trainer(config, sharding.make_mesh(config, devices.setup(
            **config.device_args())))  # fmt: skip
        rng = np.random.default_rng(0)
        batch = {k: rng.integers(0, config.vocab_size, v.shape).astype(v.dtype)
                 for k, v in batch_shapes(config).items()}  # fmt: skip
        batch["targets_mask"] = np.ones_like(batch["targets_mask"])
        state = trainer.init_state()
        times = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            state, metrics = trainer.train_step(state, trainer.put_batch(batch))
            jax.block_until_ready(metrics["loss"])
            if i >= 2:
                times.append(time.perf_counter() - t0)
        from MaxText.planning.flops import training_flops_per_step

        rows.append({
            "model": name,
            "step_s": round(statistics.median(times), 4),
            "model_tflops_per_step": training_flops_per_step(config).total / 1e12,
        })  # fmt: skip
    rows.append({"moe_over_dense": round(rows[0]["step_s"] / rows[1]["step_s"], 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 repeats (checks the script)")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    result = {
        "device": jax.devices()[0].device_kind,
        "repeats": repeats,
        "grouped": grouped(repeats),
        "step": step(repeats),
    }
    print(json.dumps(result, indent=1))
    if not args.quick:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
