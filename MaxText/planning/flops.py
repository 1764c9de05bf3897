"""Model FLOPs per training step (MaxText's analytic formula), device peaks, and MFU.

With T = tokens per step (global batch x max_target_length), S = max_target_length,
E = emb_dim, M = mlp_dim, H / K = query / kv heads, D = head_dim, N = decoder layers, V = vocab:

    ffn       = 2·T·E·M·n_in + 2·T·M·E      (n_in = 2 matrices for SwiGLU (llama), 1 for gpt)
    qkv       = 2·T·E·(H + 2K)·D
    out_proj  = 2·T·H·D·E
    unembed   = 2·T·E·V
    attention = (4·T·S·H·D) / 2             (QK^T and PV; halved because attention is causal)

    training FLOPs per step = 3 · [(ffn + qkv + out_proj)·N + unembed] + 3 · attention·N

The 3 is forward + backward (twice the forward). Rematerialisation is not counted (these are
*model* FLOPs, so MFU does not reward recomputation), nor the pipeline bubble, the embedding
lookup, norms, softmax or the optimizer. Per device = total / number of devices.

MFU = achieved TFLOP/s per device / peak TFLOP/s per device. Peaks are dense (no sparsity)
tensor-core figures for the compute dtype: bf16/fp16 for `dtype=bfloat16|float16`, TF32 for
`dtype=float32` (what XLA uses for f32 matmuls on these GPUs by default). `peak_tflops_per_device=`
overrides the table. On CPU the peak is an estimate: cores x FLOPs/cycle x clock, shared evenly by
the emulated devices; the log line says so.
"""

from __future__ import annotations

import dataclasses
import os

from MaxText.config import Config

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


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Training FLOPs of one step for the whole global batch (not per device)."""

    weights: float  # 3 x [(ffn + qkv + out_proj) x layers + unembed]
    attention: float  # 3 x causal attention x layers

    @property
    def total(self) -> float:
        return self.weights + self.attention


def training_flops_per_step(config: Config) -> StepFlops:
    t = float(config.global_batch_size) * config.max_target_length
    s = config.max_target_length
    e, m, v = config.emb_dim, config.mlp_dim, config.vocab_size
    h, k, d = config.num_query_heads, config.num_kv_heads, config.head_dim
    n_in = 2 if config.decoder_block == "llama" else 1
    ffn = 2 * t * e * m * n_in + 2 * t * m * e
    qkv = 2 * t * e * (h + 2 * k) * d
    out_proj = 2 * t * h * d * e
    unembed = 2 * t * e * v
    attention = 4 * t * s * h * d / 2
    n = config.num_decoder_layers
    return StepFlops(
        weights=3 * ((ffn + qkv + out_proj) * n + unembed), attention=3 * attention * n
    )


def tflops_per_device_per_step(config: Config) -> float:
    return training_flops_per_step(config).total / config.num_devices / 1e12


@dataclasses.dataclass(frozen=True)
class Peak:
    tflops: float  # per device
    source: str  # what the figure is, for the log
    estimate: bool  # True on CPU (and for unknown devices): MFU is then labelled an estimate


def _cpu_flops_per_cycle() -> int:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return 32
    return 64 if "avx512f" in flags else 32


def peak_tflops(config: Config, platform: str, device_kind: str) -> Peak:
    """Peak dense TFLOP/s of one device for `config.dtype` (see the module docstring)."""
    if config.peak_tflops_per_device > 0:
        return Peak(config.peak_tflops_per_device, "peak_tflops_per_device", estimate=False)
    if platform == "cpu":
        cores = os.cpu_count() or 1
        host = cores * _cpu_flops_per_cycle() * CPU_ASSUMED_GHZ * 1e9 / 1e12
        per_device = host / max(config.num_devices, 1)
        shared = f" / {config.num_devices} emulated devices" if config.num_devices > 1 else ""
        return Peak(
            per_device,
            f"CPU estimate: {cores} cores x {_cpu_flops_per_cycle()} f32 FLOP/cycle x "
            f"{CPU_ASSUMED_GHZ} GHz{shared}",
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


def mfu(achieved_tflops_per_device: float, peak: Peak) -> float:
    return achieved_tflops_per_device / peak.tflops if peak.tflops > 0 else 0.0


def matmul_flops(jaxpr_or_eqns) -> float:
    """2·M·N·K summed over every `dot_general` of a jaxpr (or a list of its equations) and of the
    jaxprs inside them, a scan's body once per iteration. Counted on the program itself, so it
    includes rematerialised work; XLA's `cost_analysis()` counts a loop's body only once, which
    undercounts a `scan_layers=true` stage by its layer count."""
    from jax.extend.core import jaxprs_in_params

    eqns = getattr(jaxpr_or_eqns, "eqns", jaxpr_or_eqns)
    total = 0.0
    for eqn in eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            k = 1
            for d in contract:
                k *= lhs.shape[d]
            out = 1
            for d in eqn.outvars[0].aval.shape:
                out *= d
            total += 2.0 * out * k
        trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in jaxprs_in_params(eqn.params):
            total += trips * matmul_flops(sub)
    return total
