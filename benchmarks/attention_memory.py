"""XLA temporary memory of the compiled training step per attention kernel, at long sequences.

Run from the repository root (a few minutes on 2 CPU cores; nothing is allocated):

    . .venv/bin/activate && python benchmarks/attention_memory.py

For each sequence length and `attention=` kernel it builds the trainer's real SPMD step
(`MaxText.train_step.build_trainer`: forward, backward, AdamW) on one CPU device and compiles it
on `jax.ShapeDtypeStruct` arguments, then reads the compiled step's `memory_analysis()`:
`temp_size_in_bytes` is the scratch XLA needs beyond the arguments and outputs (activations kept
for the backward pass, the attention scores, ...). The model (a small llama: 4 layers, width 512,
8 query heads on 4 kv heads of 64, vocab 32000, one sequence per step, float32) is the same for
every kernel; only the attention kernel changes. Writes `benchmarks/results/attention_memory.json`
and prints a markdown table.

These are XLA:CPU's buffer assignments; a GPU compile assigns differently, but the [L, L] scores
that dot_product materialises per head are the same size on any backend.

    python benchmarks/attention_memory.py --families [--lengths 8192]

measures the same model once per family instead (`decoder_block` and the keys that make it that
family, `FAMILY_KEYS`: Mistral's and Gemma 2's windows of 4096 keys, Gemma 2's soft caps, ...),
with dot_product and chunked, and writes `benchmarks/results/attention_memory_families.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import jax

from MaxText import sharding
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.train_step import build_trainer

REPO = Path(__file__).resolve().parent.parent
MODEL = [
    "num_decoder_layers=4",
    "emb_dim=512",
    "num_query_heads=8",
    "num_kv_heads=4",
    "head_dim=64",
    "mlp_dim=1536",
    "vocab_size=32000",
    "per_device_batch_size=1",
    "attention_block_size=512",
    "enable_checkpointing=false",
]


# family -> the keys that make the benchmark's model that family (its published settings where
# they are not shapes: windows of 4096 keys, Gemma 2's caps and norms).
FAMILY_KEYS = {
    "llama": ["decoder_block=llama"],
    "mistral": ["decoder_block=mistral", "sliding_window_size=4096"],
    "qwen2": ["decoder_block=qwen2", "attention_bias=true"],
    "qwen3": ["decoder_block=qwen3", "use_qk_norm=true"],
    "gemma2": [
        "decoder_block=gemma2", "sliding_window_size=4096", "attn_logits_soft_cap=50",
        "final_logits_soft_cap=30", "mlp_activations=[gelu, linear]", "use_post_attn_norm=true",
        "use_post_ffw_norm=true", "query_pre_attn_scalar=64", "logits_via_embedding=true",
    ],
}  # fmt: skip


def measure(kernel: str, length: int, remat: str, family: str = "llama") -> dict:
    config = load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            *MODEL,
            *FAMILY_KEYS[family],
            f"attention={kernel}",
            f"max_target_length={length}",
            f"remat_policy={remat}",
        ]
    )
    mesh = sharding.make_mesh(config, jax.devices()[:1])
    t0 = time.perf_counter()
    trainer = build_trainer(config, mesh)  # compiles on abstract shapes only
    analysis = trainer.train_step.memory_analysis()
    return {
        "family": family,
        "attention": kernel,
        "length": length,
        "remat_policy": remat,
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
        "compile_seconds": round(time.perf_counter() - t0, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--kernels", nargs="+", default=["dot_product", "autoselected", "chunked"])
    parser.add_argument("--remat", nargs="+", default=["none", "full"])
    parser.add_argument("--out", default="")
    parser.add_argument("--families", action="store_true", help="one row per model family")
    args = parser.parse_args()
    name = "attention_memory_families.json" if args.families else "attention_memory.json"
    args.out = args.out or str(REPO / "benchmarks/results" / name)
    if args.families:
        return families(args)

    rows = []
    for remat in args.remat:
        for length in args.lengths:
            for kernel in args.kernels:
                row = measure(kernel, length, remat)
                print(json.dumps(row), flush=True)
                rows.append(row)

    print("\n| remat_policy | L | " + " | ".join(args.kernels) + " | dot_product / chunked |")
    print("|---|---|" + "---|" * (len(args.kernels) + 1))
    for remat in args.remat:
        for length in args.lengths:
            by = {
                r["attention"]: r["temp_bytes"]
                for r in rows
                if (r["length"], r["remat_policy"]) == (length, remat)
            }
            cells = " | ".join(f"{by[k] / 2**20:,.0f} MiB" for k in args.kernels)
            ratio = (
                by["dot_product"] / by["chunked"]
                if "chunked" in by and "dot_product" in by
                else float("nan")
            )
            print(f"| {remat} | {length} | {cells} | {ratio:.1f}x |")

    write(args.out, rows)
    return 0


def families(args) -> int:
    """One row per (family, kernel) at each length (remat none), and the table."""
    rows = []
    for length in args.lengths:
        for family in FAMILY_KEYS:
            for kernel in ("dot_product", "chunked"):
                row = measure(kernel, length, "none", family)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| family | L | dot_product | chunked | dot_product / chunked |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        for family in FAMILY_KEYS:
            by = {r["attention"]: r["temp_bytes"] for r in rows
                  if (r["family"], r["length"]) == (family, length)}  # fmt: skip
            ratio = by["dot_product"] / by["chunked"]
            print(f"| {family} | {length} | {by['dot_product'] / 2**20:,.0f} MiB | "
                  f"{by['chunked'] / 2**20:,.0f} MiB | {ratio:.1f}x |")  # fmt: skip
    write(args.out, rows, {"family_keys": FAMILY_KEYS})
    return 0


def write(out: str, rows: list, extra: dict | None = None) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(
        json.dumps(
            {
                "rows": rows,
                "model": MODEL,
                **(extra or {}),
                "machine": {
                    "platform": jax.devices()[0].platform,
                    "jax": jax.__version__,
                    "cpus": os.cpu_count(),
                    "load_average": os.getloadavg(),
                },
                "commit": commit,
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
