"""Decoding speed of `MaxText.generate` with and without the KV cache (tokens per second).

    . .venv/bin/activate && python benchmarks/generate_speed.py [--model small] [--repeats 3]

The preset's model (random weights: speed does not depend on them) on one CPU device, greedy,
a prompt of `--prompt-tokens` ids, `max_predict_length=--length` (every run generates length -
prompt tokens: no EOS is checked). For each mode, `MaxText.generate.sample_tokens` runs once to
compile, then `--repeats` timed runs; tokens/s = generated tokens / median wall time. Both modes
must produce the same ids (checked). Writes `benchmarks/results/generate_speed.json` and prints
the README table. A timing: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/generate_speed.json"))
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.generate import ONE_DEVICE, sample_tokens
    from MaxText.model import Decoder

    forced = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ONE_DEVICE.items()]
    config = load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            f"model_name={args.model}",
            *forced,
            f"max_prefill_predict_length={args.prompt_tokens}",
            f"max_predict_length={args.length}",
            "decode_sampling_strategy=greedy",
        ]
    )
    tokens = jnp.zeros((1, args.prompt_tokens), jnp.int32)
    params = jax.jit(Decoder(config).init)(jax.random.key(0), tokens)["params"]
    params = jax.tree.map(
        lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value")
    )
    prompt = list(np.random.default_rng(0).integers(3, config.vocab_size, args.prompt_tokens))
    rows, ids = {}, {}
    for kv_cache in (False, True):

        def run(kv_cache=kv_cache):
            return sample_tokens(
                config, params, prompt, vocab_limit=config.vocab_size, kv_cache=kv_cache
            )

        t0 = time.perf_counter()
        ids[kv_cache] = run()
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        generated = len(ids[kv_cache])
        rows["kv_cache" if kv_cache else "no_cache"] = {
            "generated_tokens": generated,
            "first_run_s (with compile)": first,
            "times_s": times,
            "tokens_per_s": generated / statistics.median(times),
        }
    if ids[True] != ids[False]:
        raise SystemExit("the cached and uncached loops generated different ids")
    import os

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "load_average": os.getloadavg(),
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "max_predict_length": args.length,
        "device": str(jax.devices()[0]),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    speedup = rows["kv_cache"]["tokens_per_s"] / rows["no_cache"]["tokens_per_s"]
    print(
        f"| `{args.model}`, prompt {args.prompt_tokens}, {args.length} tokens in all | tokens/s |"
    )
    print("|---|---|")
    print(f"| without KV cache (full buffer per token) | {rows['no_cache']['tokens_per_s']:.1f} |")
    cached = rows["kv_cache"]["tokens_per_s"]
    print(f"| with KV cache (prefill once) | {cached:.1f} ({speedup:.1f}x) |")


if __name__ == "__main__":
    main()
