"""The XLA flags a GPU run starts with, and applying them before the backend starts.

XLA reads `XLA_FLAGS` once, when the first backend starts; an unknown flag aborts the process
(also on CPU: every backend parses the whole list). `apply_gpu_defaults(hardware)` adds
`GPU_FLAGS` to `XLA_FLAGS` when a GPU run is coming (`hardware=gpu`/`gpu_multiprocess`, or
`hardware=auto` on a host where `nvidia-smi` lists GPUs and jax[cuda12] is installed) and logs
the flags in effect. A flag already in `XLA_FLAGS` keeps the user's value: set it there to
override a default (e.g. `XLA_FLAGS=--xla_gpu_enable_triton_gemm=true`). Call it before anything
touches a device (`train.main` does, right after loading the config). `hardware=gpu` on a host
where no GPU can be seen (no CUDA jaxlib, or `nvidia-smi` lists none) sets the flags without the
log line: the device check then refuses the run, and its one line is all the user reads.

The set follows MaxText's GPU recipes and NVIDIA's JAX performance notes; each flag says why it is
here. `tests/test_gpu_defaults.py` checks that this jaxlib parses every one of them.

The same call sets the share of each GPU's memory JAX preallocates for its pool to
`GPU_MEM_FRACTION` (0.90) through `XLA_CLIENT_MEM_FRACTION`, jaxlib 0.10.2's name, when the user
set neither it nor the deprecated `XLA_PYTHON_CLIENT_MEM_FRACTION` (jaxlib refuses to start with
both). JAX's default, 0.75, leaves about 20 GB of an 80 GB H100 outside the pool, which the
planner's memory budget counts on; 0.90 leaves 8 GB for what lives outside it (the CUDA context,
NCCL's buffers, cuBLAS and cuDNN workspaces).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

# flag -> (value, why). Thresholds are MaxText's GPU recipe values.
GPU_FLAGS: dict[str, tuple[str, str]] = {
    "xla_gpu_enable_latency_hiding_scheduler": (
        "true",
        "schedule asynchronous collectives (fsdp all-gathers, reduce-scatters, the once-per-step "
        "gradient all-reduces) to overlap with compute inside each task program",
    ),
    "xla_gpu_enable_highest_priority_async_stream": (
        "true",
        "run collectives on the highest-priority stream so compute kernels do not starve them",
    ),
    "xla_gpu_all_reduce_combine_threshold_bytes": (
        "134217728",
        "combine the many per-parameter gradient all-reduces into 128 MiB ones",
    ),
    "xla_gpu_all_gather_combine_threshold_bytes": (
        "1073741824",
        "combine fsdp parameter all-gathers (one per weight) into few large ones",
    ),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": (
        "33554432",
        "combine fsdp gradient reduce-scatters into 32 MiB ones",
    ),
    "xla_gpu_enable_all_gather_combine_by_dim": (
        "false",
        "let all-gathers along different dimensions combine too",
    ),
    "xla_gpu_enable_reduce_scatter_combine_by_dim": (
        "false",
        "let reduce-scatters along different dimensions combine too",
    ),
    "xla_gpu_enable_pipelined_all_gather": (
        "true",
        "in a scanned stage, gather the next layer's fsdp weights during this layer's compute",
    ),
    "xla_gpu_enable_pipelined_reduce_scatter": (
        "true",
        "in a scanned stage, reduce-scatter a layer's gradients during the next layer's compute",
    ),
    "xla_gpu_enable_pipelined_all_reduce": (
        "true",
        "the same for all-reduces issued inside a scanned stage",
    ),
    "xla_gpu_enable_while_loop_double_buffering": (
        "true",
        "unroll the layer scan by two so collectives can overlap across iterations",
    ),
    "xla_gpu_enable_triton_gemm": (
        "false",
        "matmuls through cuBLAS, not Triton GEMM: no per-shape autotuning in each of the many "
        "task programs a pipeline compiles",
    ),
    "xla_disable_hlo_passes": (
        "rematerialization",
        "recompute only what remat_policy says: XLA's own remat pass would silently trade "
        "speed for memory and make the planner's memory prediction wrong",
    ),
}

_FLAG = re.compile(r"--([A-Za-z0-9_]+)(?:=(\S*))?")


def set_flags(xla_flags: str) -> dict[str, str]:
    """{name: value} of the `--name=value` flags in an XLA_FLAGS string (last one wins)."""
    return {m.group(1): m.group(2) or "" for m in _FLAG.finditer(xla_flags)}


def with_gpu_defaults(xla_flags: str) -> tuple[str, list[str], list[str]]:
    """(new XLA_FLAGS, defaults added, defaults the user's XLA_FLAGS already sets). The user's
    flags come last and are kept as written."""
    user = set_flags(xla_flags)
    added = [f"--{name}={value}" for name, (value, _) in GPU_FLAGS.items() if name not in user]
    kept = [f"--{name}={user[name]}" for name in GPU_FLAGS if name in user]
    return " ".join([*added, xla_flags.strip()]).strip(), added, kept


def gpu_expected(hardware: str) -> bool:
    """Whether the backend about to start is a GPU (decided without starting it)."""
    if hardware in ("gpu", "gpu_multiprocess"):
        return True
    if hardware != "auto":
        return False
    from MaxText.cluster import gpu_host

    return gpu_host.cuda_jaxlib_installed() and gpu_host.visible_gpu_count() > 0


GPU_MEM_FRACTION = "0.90"
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def apply_gpu_defaults(hardware: str, environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Adds `GPU_FLAGS` to `environ["XLA_FLAGS"]` and the memory fraction (see the module
    docstring) when `gpu_expected(hardware)`, logs what is in effect and returns the flags added
    ([] when not a GPU run)."""
    if not gpu_expected(hardware):
        return []
    flags, added, kept = with_gpu_defaults(environ.get("XLA_FLAGS", ""))
    environ["XLA_FLAGS"] = flags
    given = [name for name in MEM_FRACTION_VARS if environ.get(name)]
    if not given:
        environ["XLA_CLIENT_MEM_FRACTION"] = GPU_MEM_FRACTION
    if hardware != "auto" and not gpu_expected("auto"):
        return added  # no GPU to be seen here: the device check refuses the run next (one line)
    log.info(
        "XLA GPU flags: %s%s (defaults in MaxText/cluster/xla_flags.py; XLA_FLAGS overrides any)",
        " ".join(added) or "(none added)",
        f"; from XLA_FLAGS: {' '.join(kept)}" if kept else "",
    )
    name = given[0] if given else "XLA_CLIENT_MEM_FRACTION"
    log.info(
        "GPU memory JAX preallocates: %s=%s%s",
        name,
        environ[name],
        "" if given else " (default; set XLA_CLIENT_MEM_FRACTION to change it)",
    )
    return added
