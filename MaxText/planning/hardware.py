"""Accelerators the planner plans for: memory per device, peak FLOP/s, bandwidths.

`HARDWARE` holds the presets (`--hardware h100|h200|a100`), `cpu_hardware` this host shared by
emulated devices, `local_hardware` the devices this process trains on (read from JAX). A task's
predicted time is a roofline: max(FLOPs / (peak x efficiency), bytes / HBM bandwidth).
"""

from __future__ import annotations

import dataclasses
import os

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: memory per device, dense peak for the compute dtype, bandwidths."""

    name: str
    memory_bytes: float
    peak_tflops: float  # dense bf16 (tensor cores)
    hbm_gbps: float  # device memory bandwidth, GB/s
    link_gbps: float  # stage-to-stage bandwidth per device, GB/s (pipelines usually cross nodes)
    efficiency: float = 0.6  # fraction of the peak a large matmul-bound task reaches
    # task bytes from XLA's own cost analysis: true when the backend compiling the plan is the
    # one that will run it (this host, or the trainer's own devices); a preset planned on a CPU
    # host counts each task's arguments and outputs instead (see
    # `MaxText.planning.cost_model._cost`)
    compiler_bytes: bool = False

    def task_seconds(self, flops: float, bytes_accessed: float) -> float:
        compute = flops / (self.peak_tflops * 1e12 * self.efficiency)
        memory = bytes_accessed / (self.hbm_gbps * GB)
        return max(compute, memory, 1e-9)


# SXM parts; link = one 400 Gb/s InfiniBand NIC per GPU (50 GB/s), the usual inter-node fabric
# a pipeline crosses. Override any figure with --memory-gb, --peak-tflops, --hbm-gbps, --link-gbps.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 80 * GB, 989.0, 3350.0, 50.0),
    "h200": Hardware("h200", 141 * GB, 989.0, 4800.0, 50.0),
    "a100": Hardware("a100", 80 * GB, 312.0, 2039.0, 25.0),
}


def cpu_hardware(num_devices: int) -> Hardware:
    """This host, shared by the emulated devices (the trainer's CPU estimate of the peak)."""
    from MaxText.planning.flops import CPU_ASSUMED_GHZ, _cpu_flops_per_cycle

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cores = os.cpu_count() or 1
    peak = cores * _cpu_flops_per_cycle() * CPU_ASSUMED_GHZ * 1e9 / 1e12
    return Hardware(
        "cpu",
        pages / num_devices,
        peak / num_devices,
        10.0,
        2.0,
        efficiency=0.5,
        compiler_bytes=True,
    )


def local_hardware(config) -> Hardware:
    """The devices this process trains on, for the trainer's own planning (`auto` keys)."""
    import jax

    from MaxText.planning.flops import peak_tflops

    device = jax.devices()[0]
    if device.platform == "cpu":
        return cpu_hardware(config.num_devices)
    stats = device.memory_stats() or {}
    kind = device.device_kind.lower()
    base = next((h for name, h in HARDWARE.items() if name in kind), HARDWARE["h100"])
    return dataclasses.replace(
        base,
        name=device.device_kind,
        compiler_bytes=True,
        memory_bytes=float(stats.get("bytes_limit", base.memory_bytes)),
        peak_tflops=peak_tflops(config, device.platform, device.device_kind).tflops,
    )
