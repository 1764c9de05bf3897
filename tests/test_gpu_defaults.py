"""GPU defaults (#25 item 4): the XLA GPU flags (parsed by this jaxlib, applied before the backend
starts for GPU runs only, overridable, logged) and the cuDNN attention refusals."""

from __future__ import annotations

import json
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
        assert env == {"XLA_FLAGS": ALL_DEFAULTS, "XLA_CLIENT_MEM_FRACTION": "0.90"}
        # no GPU to be seen here: the device check's refusal is the only line (issue 36)
        assert "XLA GPU flags" not in caplog.text and "GPU memory" not in caplog.text
    # hardware=auto (and gpu) on a host with GPUs and jax[cuda12]: set and logged
    monkeypatch.setattr(gpu_host, "visible_gpu_count", lambda: 8)
    monkeypatch.setattr(gpu_host, "cuda_jaxlib_installed", lambda: True)
    for hardware in ("auto", "gpu"):
        env = {}
        with caplog.at_level(logging.INFO, logger="MaxText"):
            assert len(xla_flags.apply_gpu_defaults(hardware, env)) == 13
        assert env == {"XLA_FLAGS": ALL_DEFAULTS, "XLA_CLIENT_MEM_FRACTION": "0.90"}
        assert f"XLA GPU flags: {ALL_DEFAULTS} (defaults in" in caplog.text
        caplog.clear()
    monkeypatch.setattr(gpu_host, "cuda_jaxlib_installed", lambda: False)  # CPU jaxlib: no
    assert xla_flags.apply_gpu_defaults("auto", {}) == []


@pytest.mark.parametrize(
    "given",
    [{}, {"XLA_CLIENT_MEM_FRACTION": "0.5"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}],
    ids=["neither", "new name", "deprecated name"],
)
def test_the_memory_fraction_defaults_only_when_the_user_set_neither(given, caplog, monkeypatch):
    """jaxlib 0.10.2 refuses to start with both XLA_CLIENT_MEM_FRACTION and the deprecated
    XLA_PYTHON_CLIENT_MEM_FRACTION set: the default goes in only when neither is (on a host
    with GPUs: there it is logged)."""
    monkeypatch.setattr(gpu_host, "visible_gpu_count", lambda: 8)
    monkeypatch.setattr(gpu_host, "cuda_jaxlib_installed", lambda: True)
    env = dict(given)
    with caplog.at_level(logging.INFO, logger="MaxText"):
        xla_flags.apply_gpu_defaults("gpu", env)
    fractions = {k: v for k, v in env.items() if "MEM_FRACTION" in k}
    assert fractions == (given or {"XLA_CLIENT_MEM_FRACTION": "0.90"})
    ((name, value),) = fractions.items()
    assert f"GPU memory JAX preallocates: {name}={value}" in caplog.text
    assert ("(default;" in caplog.text) == (not given)


def test_compile_threads_are_a_gpu_hosts_free_cores():
    assert gpu_host.compile_threads("cpu", cores=64, load=0.0) == 0  # CPU devices use the cores
    assert gpu_host.compile_threads("gpu", cores=64, load=3.2) == 32  # capped
    assert gpu_host.compile_threads("gpu", cores=16, load=3.2) == 12
    assert gpu_host.compile_threads("gpu", cores=4, load=2.5) == 0  # fewer than 2 free
    assert gpu_host.compile_threads("gpu") >= 0  # this host's own figures


def test_the_pipelined_trainer_compiles_on_that_many_threads(monkeypatch):
    """The trainer hands `compile_threads(platform of its devices)` to the engine (checked
    without compiling: the step function is built, not traced)."""
    from MaxText import sharding, train_step
    from MaxText.cluster import devices
    from MaxText.model import Decoder
    from MaxText.optimizer import make_optimizer

    seen = []
    monkeypatch.setattr(gpu_host, "compile_threads", lambda platform: seen.append(platform) or 6)
    config = load_config([BASE, "pipeline_parallelism=2", "num_decoder_layers=2"])
    mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
    model = Decoder(config)
    optimizer, lr = make_optimizer(config)
    _, specs = train_step.state_specs(config, model, optimizer)
    fn = train_step.pipelined_train_step(
        config, model, optimizer, lr, specs, sharding.make_mpmd_mesh(mesh)
    )
    assert seen == ["cpu"] and fn.options.compile_threads == 6


# The trainer, in a fresh process on this CPU host with hardware=gpu: records whether a JAX
# backend had started when the GPU defaults were applied, then runs to its device check.
FRESH_TRAINER = """
import json, os, sys
from MaxText.cluster import xla_flags
from jaxpp_integration.jax_compat import backends_started
started = []
real = xla_flags.apply_gpu_defaults
def spy(hardware, environ=os.environ):
    started.append(backends_started())
    return real(hardware, environ)
xla_flags.apply_gpu_defaults = spy
from MaxText.train import main
code = main(sys.argv[1:])
print(json.dumps({"started": started, "after": backends_started(), "code": code,
                  "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                  "fraction": os.environ.get("XLA_CLIENT_MEM_FRACTION")}))
"""


def test_the_trainer_sets_them_before_the_backend_starts(tmp_path):
    """`hardware=gpu` on this CPU host, in a fresh process: when the trainer applies the GPU
    defaults no JAX backend exists yet (XLA reads XLA_FLAGS and the memory variables once, when
    the first backend starts); the flags and the memory fraction are set (not logged: no GPU is
    visible), then the device check (a backend now exists) stops the run with exit code 2 and
    its one line."""
    env = {k: v for k, v in os.environ.items() if "XLA_" not in k}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_TRAINER, BASE, "hardware=gpu", "enable_checkpointing=false",
         f"base_output_directory={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["started"] == [False] and got["after"] is True
    assert got["code"] == 2
    assert got["XLA_FLAGS"] == ALL_DEFAULTS and got["fraction"] == "0.90"
    err = proc.stderr.splitlines()
    assert err[-1].startswith("config error: hardware=gpu but JAX finds no GPU"), err
    assert not any("XLA GPU flags" in line for line in err)


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
