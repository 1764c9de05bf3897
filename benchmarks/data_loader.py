"""Input throughput of dataset_type=grain against the trainer's step throughput on `small`.

    . .venv/bin/activate && python benchmarks/data_loader.py [--batches 200] [--workers 0 1 2]

1. Prepares the bundled Shakespeare plays once (`python -m MaxText.data.prepare`, vocab 8192 as
   the `small` preset; cached under /tmp) and reads them with the `small` preset's batch shape
   (global batch 8 x 512 tokens, packing on), for each `--workers` count: time to the first batch
   (worker start-up), then tokens/s over `--batches` batches (the loader alone, nothing else
   running in the process).
2. Builds the trainer's SPMD step for `model_name=small` on one CPU device and times `--steps`
   steps on one packed batch (after compile and 2 warm-up steps): tokens/s of training.

The ratio loader / trainer says how many times faster than the step the input arrives (> 1: the
input pipeline is not the bottleneck on this host). Writes benchmarks/results/data_loader.json.
The machine is shared with other jobs; the load average is recorded with the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from MaxText.config import CONFIGS_DIR, load_config
from MaxText.data import make_data
from MaxText.data import prepare as prepare_lib
from MaxText.data.text import shakespeare_dir

ROOT = Path(__file__).resolve().parents[1]

SHARDS = Path("/tmp/maxtext_jaxpp_bench/shakespeare_v8192")


def prepared() -> Path:
    if not (SHARDS / prepare_lib.MANIFEST).is_file():
        prepare_lib.prepare(
            str(shakespeare_dir()), str(SHARDS), vocab_size=8192, eval_fraction=0.05, quiet=True
        )
    return SHARDS


def small_config(*overrides: str):
    return load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            "model_name=small",
            "dataset_type=grain",
            f"grain_train_files={prepared()}/train-*.array_record",
            "ici_data_parallelism=1",
            "ici_fsdp_parallelism=1",
            "eval_interval=0",
            "base_output_directory=/tmp/maxtext_jaxpp_bench/out",
            *overrides,
        ]
    )


def loader_tokens_per_s(workers: int, batches: int) -> dict:
    config = small_config(f"grain_worker_count={workers}")
    data = make_data(config)
    t0 = time.perf_counter()
    first = next(data.train)
    startup = time.perf_counter() - t0
    counted = 0
    t0 = time.perf_counter()
    for _ in range(batches):
        batch = next(data.train)
        counted += int(batch["targets_mask"].sum())
    seconds = time.perf_counter() - t0
    data.train.close()
    rows, length = first["inputs"].shape
    return {
        "workers": workers,
        "first_batch_s": startup,
        "batches": batches,
        "seconds": seconds,
        "tokens_per_s": batches * rows * length / seconds,
        "fill": counted / (batches * rows * length),  # non-padding share of the packed rows
    }


def trainer_tokens_per_s(steps: int) -> dict:
    import jax

    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.train_step import build_trainer

    config = small_config()
    trainer = build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )
    batch = trainer.put_batch(next(make_data(config).train))
    state = trainer.init_state()
    for _ in range(2):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {
        "steps": steps,
        "median_step_s": step,
        "tokens_per_s": config.tokens_per_step / step,
        "global_batch_size": config.global_batch_size,
        "max_target_length": config.max_target_length,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/data_loader.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    loader = [loader_tokens_per_s(w, args.batches) for w in args.workers]
    trainer = trainer_tokens_per_s(args.steps)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average_before_after": [load_before, os.getloadavg()],
        "dataset": "Shakespeare (bundled), prepared: vocab 8192, packing on",
        "loader": loader,
        "trainer_small_spmd_1cpu": trainer,
        "ratio_loader_over_trainer": {
            str(r["workers"]): r["tokens_per_s"] / trainer["tokens_per_s"] for r in loader
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'workers':>8} {'first batch s':>14} {'tokens/s':>12} {'x trainer':>10}  fill")
    for r in loader:
        ratio = r["tokens_per_s"] / trainer["tokens_per_s"]
        print(
            f"{r['workers']:>8} {r['first_batch_s']:>14.2f} {r['tokens_per_s']:>12,.0f} "
            f"{ratio:>10.1f}  {r['fill']:.3f}"
        )
    print(
        f"trainer (small, SPMD, 1 CPU device): {trainer['tokens_per_s']:,.0f} tokens/s "
        f"({trainer['median_step_s']:.2f} s/step); load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
