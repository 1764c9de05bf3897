"""Accelerators: dense peak FLOP/s per device, and what the planner plans for (memory per device,
peak, bandwidths).

`GPU_PEAK_TFLOPS` is the one table of GPU peaks (the trainer's MFU and the planner's presets read
it); `cpu_peak_tflops` the one CPU estimate; `peak_tflops` the peak of the device a run trains on.
`HARDWARE` holds the planner's presets (`--hardware h100|h200|a100`), `cpu_hardware` this host
shared by emulated devices, `local_hardware` the devices this process trains on (read from JAX).
Bytes print in decimal units (`GB`; `format_bytes`, `byte_unit`).
A task's predicted time is a roofline: max(FLOPs / (peak x efficiency), bytes / HBM bandwidth).

Peaks are dense (no sparsity) tensor-core figures for the compute dtype: bf16/fp16 for
`dtype=bfloat16|float16`, TF32 for `dtype=float32` (what XLA uses for f32 matmuls on these GPUs
by default). On CPU the peak is an estimate: cores x FLOPs/cycle x clock, shared evenly by the
emulated devices; the trainer's log line says so.
"""

from __future__ import annotations

import dataclasses
import os

GB = 1e9


def byte_unit(nbytes: float) -> tuple[float, str]:
    """(scale, name) of the decimal unit `nbytes` prints in: GB, MB or KB."""
    for scale, name in ((GB, "GB"), (1e6, "MB")):
        if nbytes >= scale:
            return scale, name
    return 1e3, "KB"


def format_bytes(nbytes: float) -> str:
    scale, name = byte_unit(nbytes)
    return f"{nbytes / scale:.3g} {name}"


# device_kind substring -> (bf16/fp16 dense TFLOP/s, tf32 dense TFLOP/s). Longest match wins.
GPU_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "B200": (2250.0, 1100.0),
    "GB200": (2500.0, 1250.0),
    "H200": (989.0, 494.0),
    "GH200": (989.0, 494.0),
    "H100": (989.0, 494.0),  # SXM
    "H100 PCIe": (756.0, 378.0),
    "H100 NVL": (835.0, 418.0),
    "H800": (989.0, 494.0),
    "A100": (312.0, 156.0),
    "A800": (312.0, 156.0),
    "A10G": (70.0, 35.0),
    "A10": (125.0, 62.5),
    "L40S": (362.0, 183.0),
    "L40": (181.0, 90.5),
    "L4": (121.0, 60.0),
    "A6000": (154.8, 77.4),
    "RTX 4090": (165.2, 82.6),
    "RTX 3090": (71.0, 35.6),
    "V100": (125.0, 15.7),  # no TF32: f32 runs at the CUDA-core rate
    "T4": (65.0, 8.1),
}

# CPU estimate: f32 FLOPs per cycle per core (2 FMA units x 8 lanes x 2 for AVX2, x16 lanes for
# AVX-512) and an assumed 2.5 GHz clock.
CPU_ASSUMED_GHZ = 2.5


def cpu_flops_per_cycle() -> int:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return 32
    return 64 if "avx512f" in flags else 32


def cpu_peak_tflops() -> float:
    """This host's estimated f32 peak, all cores."""
    return (os.cpu_count() or 1) * cpu_flops_per_cycle() * CPU_ASSUMED_GHZ * 1e9 / 1e12


@dataclasses.dataclass(frozen=True)
class Peak:
    tflops: float  # per device
    source: str  # what the figure is, for the log
    estimate: bool  # True on CPU (and for unknown devices): MFU is then labelled an estimate


def peak_tflops(config, platform: str, device_kind: str) -> Peak:
    """Peak dense TFLOP/s of one device for `config.dtype` (see the module docstring)."""
    if config.peak_tflops_per_device > 0:
        return Peak(config.peak_tflops_per_device, "peak_tflops_per_device", estimate=False)
    if platform == "cpu":
        per_device = cpu_peak_tflops() / max(config.num_devices, 1)
        shared = f" / {config.num_devices} emulated devices" if config.num_devices > 1 else ""
        return Peak(
            per_device,
            f"CPU estimate: {os.cpu_count() or 1} cores x {cpu_flops_per_cycle()} f32 FLOP/cycle "
            f"x {CPU_ASSUMED_GHZ} GHz{shared}",
            estimate=True,
        )
    matches = [name for name in GPU_PEAK_TFLOPS if name.lower() in device_kind.lower()]
    if matches:
        name = max(matches, key=len)
        low_precision, tf32 = GPU_PEAK_TFLOPS[name]
        value = tf32 if config.dtype == "float32" else low_precision
        kind = "tf32" if config.dtype == "float32" else config.dtype
        return Peak(value, f"{name} dense {kind} peak", estimate=False)
    return Peak(
        0.0,
        f"unknown device '{device_kind}': set peak_tflops_per_device= for MFU",
        estimate=True,
    )


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: memory per device, dense peak for the compute dtype, bandwidths."""

    name: str
    memory_bytes: float
    peak_tflops: float  # dense bf16 (tensor cores)
    hbm_gbps: float  # device memory bandwidth, GB/s
    link_gbps: float  # stage-to-stage bandwidth per device, GB/s (pipelines usually cross nodes)
    efficiency: float = 0.6  # fraction of the peak a large matmul-bound task reaches
    # bandwidth per device, one direction, between the devices of one group (NVLink on one
    # node), GB/s: what the MoE all-to-all over the expert axis runs at
    ici_gbps: float = 450.0
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
# a pipeline crosses; ici = NVLink inside a node (H100/H200 NVLink 4: 900 GB/s both ways, so 450
# one way; A100 NVLink 3: 300). Override any figure with --memory-gb, --peak-tflops, --hbm-gbps,
# --link-gbps, --ici-gbps.
# The presets plan in bf16: their peak is the table's bf16 column.
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 80 * GB, GPU_PEAK_TFLOPS["H100"][0], 3350.0, 50.0),
    "h200": Hardware("h200", 141 * GB, GPU_PEAK_TFLOPS["H200"][0], 4800.0, 50.0),
    "a100": Hardware("a100", 80 * GB, GPU_PEAK_TFLOPS["A100"][0], 2039.0, 25.0, ici_gbps=300.0),
}


def cpu_hardware(num_devices: int) -> Hardware:
    """This host, shared by the emulated devices (the trainer's CPU estimate of the peak)."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return Hardware(
        "cpu",
        pages / num_devices,
        cpu_peak_tflops() / num_devices,
        10.0,
        2.0,
        efficiency=0.5,
        ici_gbps=10.0,  # emulated devices copy through this host's memory
        compiler_bytes=True,
    )


def local_hardware(config) -> Hardware:
    """The devices this process trains on, for the trainer's own planning (`auto` keys)."""
    import jax

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
