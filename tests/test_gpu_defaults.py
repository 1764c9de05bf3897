"""GPU defaults (#25 item 4): the XLA GPU flags (parsed by this jaxlib, applied before the backend
starts for GPU runs only, overridable, logged) and the cuDNN attention refusals."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from MaxText.cluster import gpu_host, xla_flags
from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.model import attention

BASE = str(CONFIGS_DIR / "base.yml")
ALL_DEFAULTS = " ".join(f"--{name}={value}" for name, (value, _) in xla_flags.GPU_FLAGS.items())


def _start_backend(flags: str) -> subprocess.CompletedProcess:
    """A fresh python starting JAX's CPU backend with XLA_FLAGS=flags (XLA aborts the process on
    a flag it does not know, whatever the backend: it parses the whole list)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_this_jaxlib_parses_every_default_flag():
    flags, added, kept = xla_flags.with_gpu_defaults("")
    assert flags == ALL_DEFAULTS and kept == []
    assert len(added) == len(xla_flags.GPU_FLAGS) == 13
    proc = _start_backend(flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "cpu"
    # the check can fail: a flag this XLA no longer has aborts the process
    bad = _start_backend(flags + " --xla_gpu_enable_async_all_gather=true")
    assert bad.returncode != 0
    assert "Unknown flag in XLA_FLAGS: --xla_gpu_enable_async_all_gather=true" in bad.stderr


def test_the_users_xla_flags_win():
    user = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true"
    flags, added, kept = xla_flags.with_gpu_defaults(user)
    assert kept == ["--xla_gpu_enable_triton_gemm=true"]
    assert "--xla_gpu_enable_triton_gemm=false" not in flags
    assert flags.endswith(user)  # kept as written, after the defaults
    assert len(added) == len(xla_flags.GPU_FLAGS) - 1
    assert xla_flags.set_flags(flags)["xla_gpu_enable_triton_gemm"] == "true"


def test_applied_only_when_a_gpu_run_is_coming(monkeypatch, caplog):
    for hardware in ("cpu", "auto"):  # this host: no nvidia-smi, no CUDA jaxlib
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        assert xla_flags.apply_gpu_defaults(hardware, env) == []
        assert env == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    for hardware in ("gpu", "gpu_multiprocess"):
        env = {}
        with caplog.at_level(logging.INFO, logger="MaxText"):
            assert len(xla_flags.apply_gpu_defaults(hardware, env)) == 13
        assert env == {"XLA_FLAGS": ALL_DEFAULTS}
        # no GPU to be seen here: the device check's refusal is the only line (issue 36)
        assert "XLA GPU flags" not in caplog.text
    # hardware=auto (and gpu) on a host with GPUs and jax[cuda12]: set and logged
    monkeypatch.setattr(gpu_host, "visible_gpu_count", lambda: 8)
    monkeypatch.setattr(gpu_host, "cuda_jaxlib_installed", lambda: True)
    for hardware in ("auto", "gpu"):
        env = {}
        with caplog.at_level(logging.INFO, logger="MaxText"):
            assert len(xla_flags.apply_gpu_defaults(hardware, env)) == 13
        assert env == {"XLA_FLAGS": ALL_DEFAULTS}
        assert f"XLA GPU flags: {ALL_DEFAULTS} (defaults in" in caplog.text
        caplog.clear()
    monkeypatch.setattr(gpu_host, "cuda_jaxlib_installed", lambda: False)  # CPU jaxlib: no
    assert xla_flags.apply_gpu_defaults("auto", {}) == []


def test_the_trainer_sets_them_before_the_backend_starts(monkeypatch, capsys):
    """`hardware=gpu` on this CPU host: the flags are set (not logged: no GPU is visible), then
    the device check stops the run (exit 2) with its one line. This process's backend is started
    first, so the flags set here reach no backend (XLA reads them once per process) and cannot
    change later tests."""
    import jax

    from MaxText.train import main

    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
    assert main([BASE, "hardware=gpu", "enable_checkpointing=false"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("config error: hardware=gpu but JAX finds no GPU")
    assert os.environ["XLA_FLAGS"].startswith(ALL_DEFAULTS)


# ------------------------------------------------------------------------- cuDNN attention


def test_cudnn_flash_refuses_float32():
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "attention=cudnn_flash"])  # base.yml: dtype=float32
    assert str(e.value) == (
        "attention=cudnn_flash needs dtype=bfloat16 or float16 (cuDNN flash attention has no "
        "float32 kernel); set dtype=bfloat16, or keep float32 with attention=chunked"
    )
    assert load_config([BASE, "attention=cudnn_flash", "dtype=bfloat16"]).dtype == "bfloat16"
    assert load_config([BASE, "attention=cudnn_flash", "dtype=float16"]).dtype == "float16"


def test_cudnn_flash_refuses_packed_rows():
    keys = [BASE, "attention=cudnn_flash", "dtype=bfloat16", "dataset_type=grain"]
    keys += ["grain_train_files=x-*.array_record", "eval_interval=0"]
    with pytest.raises(ConfigError, match=r"^attention=cudnn_flash cannot keep packed documents"):
        load_config(keys)
    assert not load_config([*keys, "packing=false"]).packing
    # and the kernel itself never turns segment ids into a dense bias for cuDNN
    q = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
    segments = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="cudnn_flash does not take packed rows"):
        attention.kernel_for("cudnn_flash")(q, q, q, segments)
