"""Whether this host has GPUs, and the refusal to train on CPU beside them.

A `.venv` built where `nvidia-smi` finds no GPU (a login node) holds jaxlib without CUDA. Used on
a GPU node, JAX then starts on CPU, and with `hardware=auto` the trainer would emulate CPU devices
and train there without a word. `check_backend` runs once the devices exist: when they are CPU
devices and `nvidia-smi -L` lists GPUs, the run stops with one line that says why and how to fix
it, unless CPU was asked for (`hardware=cpu`, or JAX's own `JAX_PLATFORMS=cpu`) or
`allow_cpu_fallback=true` says a CPU run on a GPU host is intended.

`nvidia-smi` is the driver's view, independent of whichever jaxlib is installed; a missing or
failing `nvidia-smi` counts as no GPU. Standard library only, so it can run before jax starts
(`MaxText.cluster.xla_flags` asks it whether a GPU run is coming).

`compile_threads(platform)`: how many threads the engine compiles a pipelined step's programs on
(the trainer passes it to `mpmd_jit_with_loop`): the free cores of a GPU host.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

from MaxText.errors import ConfigError

# Modules of the CUDA PJRT plugin that `jax[cuda12]` installs (either one means CUDA jaxlib).
CUDA_PLUGIN_MODULES = ("jax_cuda12_plugin", "jax_plugins.xla_cuda12")


def visible_gpu_count(timeout_s: float = 10.0) -> int:
    """GPUs `nvidia-smi -L` lists (`GPU 0: NVIDIA H100 ...` lines); 0 without a working driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if proc.returncode != 0:
        return 0
    return sum(1 for line in proc.stdout.splitlines() if line.startswith("GPU "))


def cuda_jaxlib_installed() -> bool:
    """Whether `jax[cuda12]`'s plugin is installed (whether it can start is another matter)."""
    for name in CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # the parent package (jax_plugins) is absent
            continue
    return False


def cpu_fallback_error(
    platform: str,
    *,
    hardware: str,
    jax_platforms: str,
    allow_cpu_fallback: bool,
    gpus: int,
    cuda_installed: bool,
) -> str | None:
    """The one-line refusal for a run whose devices are `platform` on a host with `gpus` GPUs,
    or None when the run may go on. Pure: `check_backend` gathers the facts."""
    if platform != "cpu" or gpus == 0 or allow_cpu_fallback:
        return None
    if hardware == "cpu" or jax_platforms.split(",")[0].strip().lower() == "cpu":
        return None  # CPU asked for explicitly
    if cuda_installed:
        why = (
            "jax[cuda12] is installed but its CUDA backend did not start (JAX's warning above "
            "says why; JAX_PLATFORMS=cuda shows the error); fix the driver or CUDA setup"
        )
    else:
        why = (
            "this .venv has jaxlib without CUDA (built on a host without GPUs); run ./setup.sh "
            "on this host, which installs jax[cuda12]"
        )
    return (
        f"this host has {gpus} GPU{'s' if gpus != 1 else ''} (nvidia-smi) but JAX runs on CPU: "
        f"{why}, or set allow_cpu_fallback=true to train on CPU anyway"
    )


def check_backend(platform: str, *, hardware: str, allow_cpu_fallback: bool) -> None:
    """Raises ConfigError (one line) when a run would silently train on CPU beside GPUs.

    `platform` is the run's devices' (`jax.devices()[0].platform`). Calls `nvidia-smi` only when
    that is "cpu"."""
    if platform != "cpu" or allow_cpu_fallback:
        return
    import jax

    error = cpu_fallback_error(
        platform,
        hardware=hardware,
        jax_platforms=jax.config.jax_platforms or "",
        allow_cpu_fallback=allow_cpu_fallback,
        gpus=visible_gpu_count(),
        cuda_installed=cuda_jaxlib_installed(),
    )
    if error is not None:
        raise ConfigError(error)


MAX_COMPILE_THREADS = 32  # XLA's own compile of one program is already multi-threaded


def compile_threads(platform: str, cores: int | None = None, load: float | None = None) -> int:
    """Threads for compiling a pipelined step's programs concurrently: on a GPU host, the cores
    this process may run on (`os.sched_getaffinity`) that the 1-minute load average leaves free,
    at most `MAX_COMPILE_THREADS`; 0 (one program after the other) when fewer than 2 are free,
    and on CPU hosts, whose cores run the devices themselves. `cores`, `load`: the host's
    figures (read here when None)."""
    if platform != "gpu":
        return 0
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    if load is None:
        load = os.getloadavg()[0]
    free = int(cores - load)
    return min(free, MAX_COMPILE_THREADS) if free >= 2 else 0
