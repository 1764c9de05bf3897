"""Which devices a run uses: multi-process bootstrap and CPU device emulation.

JAX fixes its device list when its backends initialise (the first array operation). `start`
(or `setup`, for a config with nothing pending) must therefore run before anything touches a
device: it starts `jax.distributed` when the run has several processes, and on a host without an
accelerator it asks XLA for as many CPU devices as the parallelism needs (`jax_num_cpu_devices`)
and logs one line saying so. On a GPU host that has too few devices it fails with a clear message.

`start(config)` is the second step of loading a config (`load_config` starts nothing): it takes
the processes from the launcher when the config asks for that (`MaxText.cluster.processes`),
counts the devices when an ici axis is -1, returns the config with those decided
(`Config.resolve_devices`) and the devices. `jax.distributed` is started with JAX's cluster
detection off: the processes are already known, and under SLURM or Open MPI the detection would
give each process a single GPU, while a pipeline group needs all GPUs of its node in one process.
`setup` takes plain values (`**config.device_args()`).
"""

from __future__ import annotations

import logging
import os
import re

import jax

from MaxText.cluster import processes
from MaxText.config import Config
from MaxText.errors import ConfigError

log = logging.getLogger(__name__)


def _distributed_initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Starts `jax.distributed` for several processes; every process keeps all of its devices."""
    if num_processes <= 1 or jax.distributed.is_initialized():
        return
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        cluster_detection_method="deactivate",
    )


def start(config: Config, environ=None) -> tuple[Config, list[jax.Device]]:
    """`config` with its pending device keys decided, and the devices of the run (`setup`).

    The processes come from the launcher when the config asks for it (`processes.for_config`;
    `environ` defaults to `os.environ`); a -1 ici axis takes the devices JAX sees once
    `jax.distributed` runs (every process's, without emulating more)."""
    procs = processes.for_config(config, environ)
    if config.processes_pending:
        log.info(
            "%s: process %d of %d, coordinator %s",
            procs.launcher,
            procs.process_id,
            procs.num_processes,
            procs.coordinator_address,
        )
        config = config.resolve_devices(
            coordinator_address=procs.coordinator_address,
            num_processes=procs.num_processes,
            process_id=procs.process_id,
        )
    if config.axes_pending:
        _distributed_initialize(config.coordinator_address, config.num_processes, config.process_id)
        config = config.resolve_devices(jax.device_count())
    devices = setup(**config.device_args())
    if procs.per_node > 1 and devices[0].platform == "gpu":
        raise ConfigError(
            f"{procs.launcher} started {procs.per_node} processes on this node; "
            f"{processes.ONE_PER_NODE}"
        )
    return config, devices


def _requested_cpu_devices() -> int:
    """CPU devices JAX will create: jax_num_cpu_devices, else XLA_FLAGS, else 1."""
    configured = jax.config.jax_num_cpu_devices
    if configured and configured > 0:
        return configured
    match = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    return int(match.group(1)) if match else 1


def _accelerator_expected() -> bool:
    platforms = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")).lower()
    return bool(platforms) and "cpu" not in platforms.split(",")[:1]


def setup(
    num_devices: int,
    *,
    num_processes: int = 1,
    coordinator_address: str = "",
    process_id: int = 0,
    parallelism: str = "this run",
    hardware: str = "auto",
    attention: str = "dot_product",
) -> list[jax.Device]:
    """Makes `num_devices` devices available and returns them (first ones, in order; under several
    processes the same number from every process, so a pipeline group stays on one process).

    `parallelism` names what needs the devices in error messages (e.g. "ici_fsdp_parallelism=4").
    `hardware` (MaxText's key): `cpu` runs on CPU devices even on a GPU host; `gpu` and
    `gpu_multiprocess` require GPU devices (one line, exit 2, if JAX finds none); `auto` takes
    what JAX finds (the default). `attention=cudnn_flash` requires a GPU too.
    """
    needed = num_devices
    per_process = -(-needed // num_processes)
    emulating = False
    if hardware == "cpu":
        try:
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError:  # backends already initialised: checked below
            pass
    accelerator = _accelerator_expected() or hardware in ("gpu", "gpu_multiprocess")
    if per_process > _requested_cpu_devices() and not accelerator:
        # Only the CPU backend reads these; on a GPU host they change nothing.
        try:
            jax.config.update("jax_num_cpu_devices", per_process)
            emulating = True
        except RuntimeError:  # backends already initialised: check below what we have
            pass
    if num_processes > 1 and not accelerator:
        try:  # cross-process collectives on CPU go through gloo (NCCL on GPU needs nothing)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except RuntimeError:
            pass
    _distributed_initialize(coordinator_address, num_processes, process_id)
    devices = jax.devices()
    platform = devices[0].platform
    if hardware in ("gpu", "gpu_multiprocess") and platform != "gpu":
        raise ConfigError(
            f"hardware={hardware} but JAX finds no GPU (its devices are {platform.upper()}); "
            f"run ./setup.sh on the GPU host (it installs jax[cuda12]), or use hardware=cpu"
        )
    if hardware == "cpu" and platform != "cpu":
        raise ConfigError(
            f"hardware=cpu but JAX already started on {platform.upper()}; start a fresh process"
        )
    if attention == "cudnn_flash" and platform != "gpu":
        raise ConfigError(
            f"attention=cudnn_flash needs a GPU (cuDNN) but this host runs on {platform.upper()}; "
            f"use attention=autoselected, dot_product or chunked"
        )
    if platform == "cpu":
        if len(devices) < needed:
            raise ConfigError(
                f"{parallelism} needs {needed} devices but JAX already started with "
                f"{len(devices)} CPU devices; start a fresh process (or set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={needed})"
            )
        if needed > 1:
            how = "emulating" if emulating else "using"
            log.info(
                "%s %d CPU devices for %s (this host has no accelerator)", how, needed, parallelism
            )
    elif num_processes > 1 and min(local := _per_process(devices, num_processes)) < per_process:
        short = local.index(min(local))
        raise ConfigError(
            f"{parallelism} needs {needed} devices, {per_process} in each of {num_processes} "
            f"processes, but process {short} has {local[short]} {platform.upper()} devices; "
            f"{processes.ONE_PER_NODE}, and do not give each process one GPU "
            f"(CUDA_VISIBLE_DEVICES, JAX_LOCAL_DEVICE_IDS)"
        )
    elif len(devices) < needed:
        raise ConfigError(
            f"{parallelism} needs {needed} devices but this host has {len(devices)} "
            f"{platform.upper()} devices; reduce the parallelism or set one axis to -1"
        )
    elif len(devices) > needed:
        log.info("using %d of %d %s devices", needed, len(devices), platform.upper())
    if num_processes > 1:
        by_process = [[d for d in devices if d.process_index == p] for p in range(num_processes)]
        return [d for local in by_process for d in local[:per_process]][:needed]
    return devices[:needed]


def _per_process(devices: list[jax.Device], num_processes: int) -> list[int]:
    return [sum(d.process_index == p for d in devices) for p in range(num_processes)]
