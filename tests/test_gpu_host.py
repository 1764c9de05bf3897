"""No silent CPU fallback (#25 item 2): on a host whose `nvidia-smi` lists GPUs, a run whose JAX
starts on CPU stops with one line (exit 2) unless CPU was asked for or `allow_cpu_fallback=true`.

A fake `nvidia-smi` on PATH makes this CPU host a GPU host. The end-to-end runs are subprocesses
without `JAX_PLATFORMS=cpu` (the test session sets it, and it counts as asking for CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from small_model import ONE_STEP

from MaxText.cluster import gpu_host

REPO = Path(__file__).resolve().parent.parent
EIGHT_GPUS = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(8))


@pytest.fixture
def gpu_path(tmp_path, monkeypatch) -> str:
    """PATH with an `nvidia-smi` listing 8 H100s first (also set for this process)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    exe = tools / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + EIGHT_GPUS)
    exe.chmod(0o755)
    path = f"{tools}{os.pathsep}{os.environ['PATH']}"
    monkeypatch.setenv("PATH", path)
    return path


def test_nvidia_smi_is_counted(gpu_path, tmp_path, monkeypatch):
    assert gpu_host.visible_gpu_count() == 8
    broken = tmp_path / "tools" / "nvidia-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'\nexit 9\n")
    assert gpu_host.visible_gpu_count() == 0
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu_host.visible_gpu_count() == 0


def _error(**overrides):
    facts = dict(
        hardware="auto",
        jax_platforms="",
        allow_cpu_fallback=False,
        gpus=8,
        cuda_installed=False,
    )
    facts.update(overrides)
    return gpu_host.cpu_fallback_error("cpu", **facts)


def test_when_a_cpu_run_beside_gpus_is_refused():
    assert _error() == (
        "this host has 8 GPUs (nvidia-smi) but JAX runs on CPU: this .venv has jaxlib without "
        "CUDA (built on a host without GPUs); run ./setup.sh on this host, which installs "
        "jax[cuda12], or set allow_cpu_fallback=true to train on CPU anyway"
    )
    assert "its CUDA backend did not start" in _error(cuda_installed=True)
    assert _error(gpus=1).startswith("this host has 1 GPU (nvidia-smi)")
    # not refused: no GPU, a GPU run, CPU asked for, or the override
    assert _error(gpus=0) is None
    assert gpu_host.cpu_fallback_error(
        "gpu", hardware="auto", jax_platforms="", allow_cpu_fallback=False, gpus=8,
        cuda_installed=True,
    ) is None  # fmt: skip
    assert _error(hardware="cpu") is None
    assert _error(jax_platforms="cpu") is None
    assert _error(jax_platforms="cuda,cpu") is not None  # CPU only as JAX's fallback
    assert _error(allow_cpu_fallback=True) is None


def _train(path: str, tmp_path: Path, *keys: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PATH"] = path
    return subprocess.run(
        [
            sys.executable,
            "train.py",
            "configs/base.yml",
            *ONE_STEP,
            f"base_output_directory={tmp_path}",
            "run_name=fallback",
            *keys,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_trainer_refuses_cpu_on_a_gpu_host(gpu_path, tmp_path):
    proc = _train(gpu_path, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "config error: this host has 8 GPUs (nvidia-smi) but JAX runs on CPU: this .venv has "
        "jaxlib without CUDA (built on a host without GPUs); run ./setup.sh on this host, which "
        "installs jax[cuda12], or set allow_cpu_fallback=true to train on CPU anyway"
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "fallback").exists()  # stopped before anything was written


def test_allow_cpu_fallback_trains_on_cpu(gpu_path, tmp_path):
    proc = _train(gpu_path, tmp_path, "allow_cpu_fallback=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "fallback" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1
