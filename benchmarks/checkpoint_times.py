"""Checkpoint save / restore times for a preset (default `small`), SPMD and pipelined.

Run from the repository root:

    . .venv/bin/activate && python benchmarks/checkpoint_times.py [--repeats 3] [key=value ...]

For each layout (`pipeline_parallelism=1` on one device, `pipeline_parallelism=4` on four emulated
CPU devices) it builds the trainer exactly as `train.py` does (synthetic data: only the state
matters), runs one training step so the state is what a real loop saves (for the pipelined run:
`MpmdArray`s spread over the 4 groups), then times through `MaxText.checkpoint.manager.Checkpoints`,
the code the loop calls:

- `async blocking`: `maybe_save` with `async_checkpointing=true` until it returns (the arrays are
  copied to host memory; training would continue from here);
- `async total`: until the background write is complete (`wait()`);
- `sync save`: `maybe_save` with `async_checkpointing=false`;
- `restore`: `restore_or_init` of a fresh `Checkpoints` (latest checkpoint read and placed on the
  devices of the layout; for the pipelined run every leaf onto its groups), until ready. It
  includes the check of every file against its checksum, also timed alone as `checksum verify`
  (it replaced the pre-read of every stored chunk, timed alone as `verify`, which checkpoints
  without a checksum record still get);
- `checksum record`: the part of the background write spent reading the written files back for
  their CRC-32 (`checksums.json`), inside `async total` and `sync save`.

Median and range over `--repeats` rounds; the size of one checkpoint on disk. Prints a table and
writes `benchmarks/results/checkpoint_times.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _block(tree) -> None:
    import jax

    for x in jax.tree.leaves(tree):
        x.block_until_ready()


def measure(layout: list[str], extra: list[str], repeats: int, workdir: Path) -> dict:
    import jax
    import numpy as np

    from MaxText import sharding
    from MaxText.checkpoint import integrity
    from MaxText.checkpoint import manager as checkpointing
    from MaxText.cluster import devices
    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.data import make_data
    from MaxText.model import count_params
    from MaxText.train_step import build_trainer

    def config_for(run: str, async_save: bool):
        return load_config(
            [
                str(CONFIGS_DIR / "base.yml"),
                "model_name=small",
                "dataset_type=synthetic",
                "enable_checkpointing=true",
                f"async_checkpointing={'true' if async_save else 'false'}",
                "max_num_checkpoints_to_keep=1",
                "enable_tensorboard=false",
                "enable_progress_bar=false",
                f"base_output_directory={workdir}",
                f"run_name={run}",
                *layout,
                *extra,
            ]
        )

    config = config_for("bench", True)
    mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
    t0 = time.perf_counter()
    trainer = build_trainer(config, mesh)
    compile_s = time.perf_counter() - t0
    data = make_data(config)
    state = trainer.init_state()
    t0 = time.perf_counter()
    state, metrics = trainer.train_step(state, trainer.put_batch(next(data.train)))
    float(np.asarray(metrics["loss"]))
    step_s = time.perf_counter() - t0
    leaf_types = sorted({type(x).__name__ for x in jax.tree.leaves(state)})

    rows: dict[str, list[float]] = {
        "async_blocking_s": [],
        "async_total_s": [],
        "sync_save_s": [],
        "restore_s": [],
        "verify_s": [],
        "checksum_record_s": [],
        "checksum_verify_s": [],
    }
    size = 0
    for r in range(repeats):
        for async_save in (True, False):
            run = f"r{r}_{'async' if async_save else 'sync'}"
            ckpt = checkpointing.Checkpoints(config_for(run, async_save), trainer)
            t0 = time.perf_counter()
            ckpt.maybe_save(1, state, data, final=True)
            blocking = time.perf_counter() - t0
            ckpt.wait()
            total = time.perf_counter() - t0
            ckpt.close()
            if async_save:
                rows["async_blocking_s"].append(blocking)
                rows["async_total_s"].append(total)
                rows["checksum_record_s"].append(ckpt.pending.last_checksum_s)
            else:
                rows["sync_save_s"].append(total)
        step_dir = workdir / run / "checkpoints" / "1"
        size = _dir_bytes(step_dir)
        t0 = time.perf_counter()
        integrity.verify_arrays(step_dir / "state")
        rows["verify_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert integrity.verify_checksums(step_dir)
        rows["checksum_verify_s"].append(time.perf_counter() - t0)
        ckpt = checkpointing.Checkpoints(config_for(run, False), trainer)
        t0 = time.perf_counter()
        restored = ckpt.restore_or_init(data)
        _block(restored)
        rows["restore_s"].append(time.perf_counter() - t0)
        ckpt.close()
        assert int(np.asarray(restored["step"])) == 1
        del restored
        for sub in workdir.iterdir():
            if sub.name.startswith(f"r{r}_"):
                shutil.rmtree(sub)
    return {
        "layout": layout,
        "parameters": count_params(state["params"]),
        "state_leaf_types": leaf_types,
        "checkpoint_bytes": size,
        "compile_s": compile_s,
        "first_step_s": step_s,
        **{
            k: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
            for k, v in rows.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results" / "checkpoint_times.json")
    )
    parser.add_argument(
        "--dir", default="", help="where checkpoints are written (default: a temp dir)"
    )
    args, extra = parser.parse_known_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    results = []
    for layout in (["pipeline_parallelism=1"], ["pipeline_parallelism=4"]):
        results.append(measure(layout, extra, args.repeats, workdir / layout[0].split("=")[1]))
        r = results[-1]
        print(
            f"{' '.join(layout):26s} {r['checkpoint_bytes'] / 1e6:7.1f} MB | "
            f"async blocking {r['async_blocking_s']['median']:.2f} s | "
            f"async total {r['async_total_s']['median']:.2f} s | "
            f"sync save {r['sync_save_s']['median']:.2f} s | "
            f"restore {r['restore_s']['median']:.2f} s (checksum verify "
            f"{r['checksum_verify_s']['median']:.2f} s; chunk pre-read "
            f"{r['verify_s']['median']:.2f} s) | "
            f"checksum record {r['checksum_record_s']['median']:.2f} s",
            flush=True,
        )
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
            "jax": jax.__version__,
        },
        "checkpoint_dir": str(workdir),
        "repeats": args.repeats,
        "extra_args": extra,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
