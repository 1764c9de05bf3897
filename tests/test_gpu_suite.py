"""The GPU suite: the first thing to run on a GPU node (`python -m pytest -m gpu -rs`).

Marked `gpu` (registered in pyproject.toml) and skipped, with the reason, on a host where
`nvidia-smi` lists fewer GPUs than a test needs or jax[cuda12] is not installed: this CPU box
collects and skips them (`test_the_gpu_suite_collects_and_skips_here` checks it). Every GPU test
runs its work in fresh processes without this session's CPU settings (JAX_PLATFORMS=cpu and the
8 emulated devices of tests/conftest.py), in float32 with `jax_default_matmul_precision=highest`
and `GPU_SUITE_FLAGS` (deterministic ops, autotuning off: the same cuBLAS algorithm for the same
shapes in every program and process). What each result means: docs/cluster.md, "First run on a
GPU node".

Tolerances. A pipelined step runs the step's math as many task programs, where `jax.jit` runs
one; on GPUs the kernels XLA emits for a reduction depend on what it is fused with, so sums may
be added in another order. For float32 sums of at most K = 64 terms (the models' widths) a
reordering moves a result by at most K x 2^-24 (about 4e-6) of the magnitude of its terms; a step
chains a few of them (forward, backward, update): 1e-5 of each leaf's largest magnitude. Where
the programs are the same ones (a resume in the same layout, two processes against one) the
bits must be equal. The suite also reports whether the pipelined step is bitwise jax.jit's,
which it is on CPU: a False there is a finding to report, not a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from small_model import SMALL_MODEL_SHAPE, merged

from MaxText.cluster import gpu_host

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).parent
GPU_SUITE_FLAGS = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
RTOL = 1e-5  # see the module docstring


def _gpus() -> int:
    return gpu_host.visible_gpu_count() if gpu_host.cuda_jaxlib_installed() else 0


def needs_gpus(n: int):
    gpus, cuda = gpu_host.visible_gpu_count(), gpu_host.cuda_jaxlib_installed()
    reason = (
        f"needs a GPU node with {n}+ GPUs and jax[cuda12]: nvidia-smi lists {gpus}, jax[cuda12] "
        f"{'installed' if cuda else 'not installed (run ./setup.sh on the GPU node)'}"
    )
    return pytest.mark.skipif(not cuda or gpus < n, reason=reason)


def _env(**extra) -> dict:
    """This environment without the CPU session's settings, for GPU processes."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile afresh: nothing read from CPU runs
    env.update(
        XLA_FLAGS=GPU_SUITE_FLAGS,
        JAX_DEFAULT_MATMUL_PRECISION="highest",
        PYTHONPATH=f"{REPO}{os.pathsep}{HERE}",
        **extra,
    )
    return env


def _run(cmd: list[str], timeout: int = 1800, **env) -> str:
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------- engine


@pytest.mark.gpu
@needs_gpus(2)
def test_every_schedule_equals_jit_on_gpus():
    """Every built-in schedule on min(4, GPUs) groups of one GPU: the tied MLP step (tied
    embedding, global-norm clipping) against `jax.jit` on one GPU, each leaf within RTOL of its
    scale, each group's arrays on its own GPU."""
    groups = min(4, _gpus())
    out = _run([sys.executable, str(HERE / "gpu_engine_worker.py"), str(groups)])
    results = [json.loads(x[len("RESULT ") :]) for x in out.splitlines() if x.startswith("RESULT ")]
    assert [r["schedule"] for r in results] == [
        "gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zero_bubble", "dualpipev"
    ]  # fmt: skip
    for r in results:
        print(f"{r['schedule']}: largest relative difference {r['max_rel']:.2e}, "
              f"bitwise {r['bitwise']}")  # fmt: skip
        assert r["placed"], r
        assert r["max_rel"] <= RTOL, r


# ------------------------------------------------------------------------------------ trainer

TRAIN = [
    "configs/base.yml",
    *SMALL_MODEL_SHAPE,  # the default layout: scanned layers
    "hardware=gpu",
    "dataset_type=synthetic",
    "num_pipeline_microbatches=4",
    "steps=4",
    "log_period=1",
    "eval_interval=0",
    "checkpoint_period=2",
    "enable_tensorboard=false",
    "enable_progress_bar=false",
]


def _train(out: Path, run: str, *keys: str) -> dict[int, float]:
    _run([sys.executable, "train.py", *merged(*TRAIN, f"base_output_directory={out}",
                                              f"run_name={run}", *keys)])  # fmt: skip
    return _losses(out, run)


def _losses(out: Path, run: str) -> dict[int, float]:
    lines = (out / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _resume(out: Path, source: str, run: str, step: int, *keys: str) -> dict[int, float]:
    (out / run / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / source / "checkpoints" / str(step), out / run / "checkpoints" / str(step))
    return _train(out, run, *keys)


@pytest.mark.gpu
@needs_gpus(2)
def test_trainer_pipelined_equals_spmd_and_checkpoints_move_between_layouts(tmp_path):
    """The trainer's default pipelined step (pp=2, scanned layers, default gradient reduction,
    checkpointing on) against the SPMD step on the same 2 GPUs (data=2): losses within RTOL.
    Its step-2 checkpoint resumes in the same layout bitwise (the same programs, deterministic
    kernels) and in the SPMD layout within RTOL."""
    pipelined = _train(tmp_path, "pp2", "pipeline_parallelism=2")
    spmd = _train(tmp_path, "spmd", "ici_data_parallelism=2")
    assert sorted(pipelined) == sorted(spmd) == [1, 2, 3, 4]
    for s in pipelined:
        assert abs(pipelined[s] - spmd[s]) <= RTOL * abs(spmd[s]), (s, pipelined, spmd)
    again = _resume(tmp_path, "pp2", "again", 2, "pipeline_parallelism=2")
    assert [again[s] for s in (3, 4)] == [pipelined[s] for s in (3, 4)]
    moved = _resume(tmp_path, "pp2", "moved", 2, "ici_data_parallelism=2")
    for s in (3, 4):
        assert abs(moved[s] - pipelined[s]) <= RTOL * abs(pipelined[s]), (s, moved, pipelined)


@pytest.mark.gpu
@needs_gpus(2)
def test_two_processes_on_one_node_train_like_one(tmp_path):
    """Two trainer processes on one node, as srun / mpirun would start one per node: explicit
    coordinator_address, num_processes, process_id, and each process half of the node's GPUs
    (CUDA_VISIBLE_DEVICES 0-3 and 4-7 on 8 GPUs), one pipeline group each. Bitwise the losses
    of one process holding both groups (the same programs on the same kind of GPU)."""
    from MaxText.launch import free_port

    half = _gpus() // 2
    batch = f"global_batch_size={8 * half}"  # each microbatch's rows split over fsdp=half
    one = _train(tmp_path, "one", "pipeline_parallelism=2", f"ici_fsdp_parallelism={half}", batch)
    port = free_port()
    args = merged(*TRAIN, f"base_output_directory={tmp_path}", "run_name=two",
                  "hardware=gpu_multiprocess", f"coordinator_address=127.0.0.1:{port}",
                  "num_processes=2", "dcn_pipeline_parallelism=2", "ici_pipeline_parallelism=1",
                  f"ici_fsdp_parallelism={half}", batch)  # fmt: skip
    procs = []
    for pid in range(2):
        visible = ",".join(str(g) for g in range(pid * half, (pid + 1) * half))
        procs.append(
            subprocess.Popen(
                [sys.executable, "train.py", *args, f"process_id={pid}"],
                cwd=REPO,
                env=_env(CUDA_VISIBLE_DEVICES=visible),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    assert _losses(tmp_path, "two") == one


# ---------------------------------------------------------------------------------- gpu_smoke


@pytest.mark.gpu
@needs_gpus(2)
def test_gpu_smoke_runs_and_sets_the_plan_beside_it(tmp_path):
    """`benchmarks/gpu_smoke.py` at pp=2 on a shortened Llama 2 7B (4 layers): a row with
    measured and predicted step time, MFU and peak HBM per group; the measured peak is the GPUs'
    own `peak_bytes_in_use`. The figures themselves are for reading (docs/cluster.md)."""
    out_json = tmp_path / "smoke.json"
    printed = _run(
        [sys.executable, "benchmarks/gpu_smoke.py", "--pp", "2", "--steps", "5",
         "--out", str(out_json), "num_decoder_layers=4"],
        timeout=3600,
    )  # fmt: skip
    print(printed[-3000:])
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["pp"] == 2 and row["peak_bytes_source"] == "peak_bytes_in_use"
    for key in ("step_time_s", "tflops_per_device", "mfu", "peak_bytes_per_group"):
        assert row[key] and row[f"predicted_{key}"], (key, row)
    assert len(row["peak_bytes_per_group"]) == len(row["predicted_peak_bytes_per_group"]) == 2


# ------------------------------------------------------------------------------ here, on CPU


def test_the_gpu_suite_collects_and_skips_here():
    """`pytest -m gpu` on this CPU host: the GPU tests are collected once each and skipped with
    the reason; nothing else is selected (the normal suite runs no test twice)."""
    if _gpus() >= 2:
        pytest.skip("this host has GPUs: run `pytest -m gpu` itself")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-m", "gpu", "-rs",
         str(Path(__file__))],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    skipped = [x for x in proc.stdout.splitlines() if x.startswith("SKIPPED")]
    assert len(skipped) == 4, proc.stdout[-3000:]
    assert all("needs a GPU node with 2+ GPUs and jax[cuda12]" in x for x in skipped), skipped
    assert "4 skipped, 1 deselected" in proc.stdout
