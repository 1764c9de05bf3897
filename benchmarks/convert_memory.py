"""Peak memory (RSS) of Hugging Face checkpoint conversion, both ways, on a synthetic checkpoint.

    . .venv/bin/activate && python benchmarks/convert_memory.py [--layers 8] [--workdir DIR]

Writes a random Llama folder (bfloat16 safetensors, 2 shards; default ~1 GB: width 2048, 8 layers,
mlp 5632, 16 heads / 4 kv heads, vocabulary 32000, untied), then runs in fresh processes:

1. `python -m MaxText.to_maxtext ... weight_dtype=float32` (writes ~2 GB of float32),
2. `python -m MaxText.to_huggingface ... hf_output_dtype=bfloat16` (writes ~1 GB),
3. a process that only imports what the converters import (the baseline),

and reads each child's peak resident set size (`getrusage(RUSAGE_CHILDREN).ru_maxrss`, one child
at a time). The issue's bound: peak RSS <= 1.2 x the bytes written + 1 GB. RSS is a count, not a
timing: it does not depend on the machine's load. Prints a table and writes
`benchmarks/results/convert_memory.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

GB = 1e9


def write_synthetic_llama(folder: Path, args: argparse.Namespace) -> int:
    """A random Llama folder written one tensor at a time; returns the bytes of its weights."""
    import ml_dtypes
    import numpy as np

    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.convert.layout import tensors_for
    from MaxText.convert.safetensors_io import SafetensorsWriter

    e, h, k, m, v = args.width, args.heads, args.kv_heads, args.mlp, args.vocab
    shape = load_config([
        str(CONFIGS_DIR / "base.yml"), f"num_decoder_layers={args.layers}", f"emb_dim={e}",
        f"num_query_heads={h}", f"num_kv_heads={k}", f"head_dim={e // h}", f"mlp_dim={m}",
        f"vocab_size={v}", "logits_via_embedding=false",
    ])  # fmt: skip
    tensors = tensors_for(shape)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    total = sum(int(np.prod(t.hf_shape)) * 2 for t in tensors)
    writer = SafetensorsWriter(
        folder, [(t.hf_name, t.hf_shape, bf16) for t in tensors], max_shard_bytes=total // 2 + 1
    )
    rng = np.random.default_rng(0)
    for t in tensors:
        scale = 1.0 if len(t.hf_shape) == 1 else t.hf_shape[-1] ** -0.5
        writer.write(t.hf_name, (scale * rng.standard_normal(t.hf_shape, np.float32)).astype(bf16))
    writer.close()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": e,
        "intermediate_size": m, "num_hidden_layers": args.layers, "num_attention_heads": h,
        "num_key_value_heads": k, "vocab_size": v, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return total


def peak_rss_of(cmd: list[str]) -> int:
    """Peak RSS (bytes) of one child process (the largest child so far: run them in order of
    growing size, or one per call as here, where each is measured in its own interpreter)."""
    wrapper = (
        "import resource, subprocess, sys; "
        "rc = subprocess.call(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", wrapper, *cmd],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1]) * 1024  # ru_maxrss is in KiB on Linux


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workdir", default="")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/convert_memory.json"))
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert_memory_"))
    hf, ckpt, export = work / "hf", work / "ckpt", work / "export"
    for p in (hf, ckpt, export):
        shutil.rmtree(p, ignore_errors=True)
    try:
        hf_bytes = write_synthetic_llama(hf, args)
        python = sys.executable
        base = ["configs/base.yml"]
        baseline = peak_rss_of(
            [python, "-c", "import MaxText.convert.importer, MaxText.convert.exporter"]
        )
        import_rss = peak_rss_of(
            [python, "-m", "MaxText.to_maxtext", *base, f"hf_model_path={hf}",
             f"base_output_directory={ckpt}", "weight_dtype=float32"]
        )  # fmt: skip
        export_rss = peak_rss_of(
            [python, "-m", "MaxText.to_huggingface", *base, f"load_parameters_path={ckpt}",
             f"hf_output_path={export}", "hf_output_dtype=bfloat16"]
        )  # fmt: skip
        written_import = 4 * hf_bytes // 2  # float32 parameters (on disk: compressed zarr)
        written_export = dir_bytes(export) - sum(
            (export / n).stat().st_size for n in ("config.json", "generation_config.json")
        )
        rows = [
            ("to_maxtext (bf16 -> float32)", written_import, import_rss, dir_bytes(ckpt)),
            ("to_huggingface (float32 -> bf16)", written_export, export_rss, written_export),
        ]
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "model": vars(args),
        "hf_bytes_bf16": hf_bytes,
        "baseline_rss_bytes": baseline,
        "rows": [
            {
                "direction": name,
                "written_bytes": written,
                "on_disk_bytes": disk,
                "peak_rss_bytes": rss,
                "bound_bytes": int(1.2 * written + GB),
                "within_bound": rss <= 1.2 * written + GB,
            }
            for name, written, rss, disk in rows
        ],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"synthetic Llama: {hf_bytes / GB:.2f} GB of bfloat16 weights; imports alone "
          f"{baseline / GB:.2f} GB RSS")  # fmt: skip
    print("| conversion | weights written | peak RSS | bound 1.2 x written + 1 GB |")
    print("|---|---|---|---|")
    for r in result["rows"]:
        print(
            f"| {r['direction']} | {r['written_bytes'] / GB:.2f} GB | "
            f"{r['peak_rss_bytes'] / GB:.2f} GB | {r['bound_bytes'] / GB:.2f} GB |"
        )


if __name__ == "__main__":
    main()
