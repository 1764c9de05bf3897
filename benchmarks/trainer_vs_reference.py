"""Tokens/s of the trainer's SPMD step vs a minimal hand-written flax + optax `jax.jit` loop.

    . .venv/bin/activate && python benchmarks/trainer_vs_reference.py [--rounds 20] [key=value ...]

Both sides run the same model class (`MaxText.model.Decoder`) built from the same config (default:
`configs/base.yml`, the tiny preset, synthetic data, one device), on the same device and the same
batch, reused every step.

- `trainer`: `MaxText.train_step.build_trainer(config, mesh)`, i.e. the compiled SPMD step the
  training loop runs (microbatch split, `jaxpp.treduce` under `jax.jit`, clipping + AdamW on the
  warmup-cosine schedule, metrics, state donation).
- `reference`: `Decoder(config).apply` + a hand-written cross-entropy, `jax.value_and_grad`,
  `optax.chain(clip_by_global_norm, adamw)` with the trainer's hyperparameters (same schedule,
  betas, eps, weight decay, no decay on norm scales and biases), `jax.jit` with the
  parameters and optimizer state donated, on `jax.devices()[0]`. Returns only the loss.

Timing: compile + 3 warm-up steps each, then `--rounds` rounds; a round runs one step of each side
(order alternating) and blocks on each step's outputs (`block_until_ready`). Reported: median
step time per side, tokens/s (= batch x length / median step time), ratio
tokens/s(trainer) / tokens/s(reference) (goal >= 0.97) and the median of the per-round ratios.
Writes `benchmarks/results/trainer_vs_reference.json`.
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
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from MaxText import sharding
from MaxText.cluster import devices
from MaxText.config import load_config
from MaxText.data import make_data
from MaxText.model import Decoder
from MaxText.train_step import build_trainer

ROOT = Path(__file__).resolve().parents[1]

GOAL = 0.97


def build_reference(config, device):
    """(step, params, opt_state) of the hand-written loop on `device`."""
    model = Decoder(config)
    total = max(config.learning_rate_schedule_steps, 1)
    lr = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=int(config.warmup_steps_fraction * total),
        decay_steps=total,
        end_value=config.learning_rate * config.learning_rate_final_fraction,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config.gradient_clipping_threshold),
        optax.adamw(
            lr,
            b1=config.adam_b1,
            b2=config.adam_b2,
            eps=config.adam_eps,
            weight_decay=config.adam_weight_decay,
            mask=lambda ps: jax.tree_util.tree_map_with_path(
                lambda path, _: (
                    path[-1].key not in ("scale", "bias") and not path[-1].key.endswith("_bias")
                ),
                ps,
            ),
        ),
    )

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["inputs"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        mask = batch["targets_mask"]
        return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
    with jax.default_device(device):
        params = nn.unbox(model.init(jax.random.key(config.seed), tokens)["params"])
        opt_state = tx.init(params)
    params, opt_state = jax.device_put((params, opt_state), device)
    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/trainer_vs_reference.json"))
    ap.add_argument("overrides", nargs="*", help="extra config key=value")
    args = ap.parse_args()

    steps = args.rounds + args.warmup + 1
    config = load_config(
        [
            str(ROOT / "configs/base.yml"),
            "dataset_type=synthetic",
            f"steps={steps}",
            "enable_checkpointing=false",
            *args.overrides,
        ]
    )
    devs = devices.setup(**config.device_args())
    mesh = sharding.make_mesh(config, devs)
    if config.is_pipelined or mesh.devices.size != 1:
        sys.exit("this benchmark compares single-device SPMD steps: use a 1-device config")
    device = mesh.devices.flat[0]

    t0 = time.perf_counter()
    trainer = build_trainer(config, mesh)
    trainer_compile = time.perf_counter() - t0
    state = trainer.init_state()
    np_batch = next(iter(make_data(config).train))
    batch = trainer.put_batch(np_batch)
    ref_batch = jax.device_put(
        {
            "inputs": np.asarray(np_batch["inputs"], np.int32),
            "targets": np.asarray(np_batch["targets"], np.int32),
            "targets_mask": np.asarray(np_batch["targets_mask"], np.float32),
        },
        device,
    )
    b, seq = ref_batch["inputs"].shape
    tokens_per_step = b * seq

    ref_step, params, opt_state = build_reference(config, device)
    t0 = time.perf_counter()
    ref_step = ref_step.lower(params, opt_state, ref_batch).compile()
    ref_compile = time.perf_counter() - t0

    def run_trainer():
        nonlocal state
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        return float(metrics["loss"])

    def run_reference():
        nonlocal params, opt_state
        params, opt_state, loss = ref_step(params, opt_state, ref_batch)
        jax.block_until_ready((params, opt_state, loss))
        return float(loss)

    first = {"trainer": run_trainer(), "reference": run_reference()}
    for _ in range(args.warmup - 1):
        run_trainer()
        run_reference()

    times = {"trainer": [], "reference": []}
    runners = {"trainer": run_trainer, "reference": run_reference}
    for r in range(args.rounds):
        order = ("trainer", "reference") if r % 2 == 0 else ("reference", "trainer")
        for name in order:
            t = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - t)

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens_per_step / v for k, v in med.items()}
    ratio = tps["trainer"] / tps["reference"]
    per_round = statistics.median(
        r / t for t, r in zip(times["trainer"], times["reference"], strict=True)
    )

    print(f"model {config.model_name}, batch {b} x {seq} = {tokens_per_step} tokens, {device}")
    print(f"first-step loss: trainer {first['trainer']:.6f}, reference {first['reference']:.6f}")
    head = ("median ms", "min ms", "max ms", "tokens/s", "compile s")
    print(f"{'side':<10} " + " ".join(f"{h:>10}" for h in head))
    for k, c in (("trainer", trainer_compile), ("reference", ref_compile)):
        v = times[k]
        print(
            f"{k:<10} {1e3 * med[k]:>10.2f} {1e3 * min(v):>10.2f} {1e3 * max(v):>10.2f} "
            f"{tps[k]:>10.0f} {c:>10.2f}"
        )
    verdict = "met" if ratio >= GOAL else "missed"
    print(
        f"ratio tokens/s trainer/reference: {ratio:.3f} (per-round median {per_round:.3f}); "
        f"goal >= {GOAL}: {verdict}"
    )

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    result = {
        "ratio_tokens_per_s": ratio,
        "per_round_median_ratio": per_round,
        "goal": GOAL,
        "goal_met": ratio >= GOAL,
        "tokens_per_step": tokens_per_step,
        "batch": [b, seq],
        "model_name": config.model_name,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "overrides": args.overrides,
        "median_step_s": med,
        "tokens_per_s": tps,
        "step_times_s": times,
        "compile_s": {"trainer": trainer_compile, "reference": ref_compile},
        "first_step_loss": first,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "device": str(device),
        },
        "versions": {
            "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
            "flax": flax.__version__,
            "optax": optax.__version__,
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
        "git_commit": commit,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
