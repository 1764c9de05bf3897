"""Model FLOPs per training step (MaxText's analytic formula) and MFU.

With T = tokens per step (global batch x max_target_length), S = max_target_length,
E = emb_dim, M = mlp_dim, H / K = query / kv heads, D = head_dim, N = decoder layers, V = vocab:

    ffn       = 2·T·E·M·n_in + 2·T·M·E      (n_in: the family's input kernels, 2 gated, 1 gpt)
    qkv       = 2·T·E·(H + 2K)·D
    out_proj  = 2·T·H·D·E
    unembed   = 2·T·E·V
    attention = 4·T·H·D·P / S               (QK^T and PV over the P (query, key) pairs of a row)
    P = S²/2 for a global layer (causal: half the square), S·W − W²/2 for a layer with a sliding
        window of W < S keys (the first W queries see a growing triangle, the rest W keys each)

    training FLOPs per step = 3 · [(ffn + qkv + out_proj)·N + unembed] + 3 · Σ_layers attention

The 3 is forward + backward (twice the forward). Rematerialisation is not counted (these are
*model* FLOPs, so MFU does not reward recomputation), nor the pipeline bubble, the embedding
lookup, norms, softmax or the optimizer. Per device = total / number of devices.

MFU = achieved TFLOP/s per device / peak TFLOP/s per device; the device peaks (GPU table, CPU
estimate, `peak_tflops_per_device=`) are `MaxText.planning.hardware`'s, re-exported here for the
trainer's log line. `matmul_flops` (FLOPs counted on a program's own equations) is the engine's
(`jaxpp_integration.tools.report`), which counts every task's with it.
"""

from __future__ import annotations

import dataclasses

from jaxpp_integration.tools.report import matmul_flops
from MaxText.config import Config
from MaxText.model import family_of
from MaxText.planning.hardware import Peak, peak_tflops

__all__ = [
    "Peak",
    "StepFlops",
    "attended_pairs",
    "matmul_flops",
    "mfu",
    "peak_tflops",
    "training_flops_per_step",
]


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
    n_in = family_of(config).feed_forward.input_kernels
    ffn = 2 * t * e * m * n_in + 2 * t * m * e
    qkv = 2 * t * e * (h + 2 * k) * d
    out_proj = 2 * t * h * d * e
    unembed = 2 * t * e * v
    pairs = sum(attended_pairs(s, w) for w in family_of(config).layer_windows(config))
    n = config.num_decoder_layers
    return StepFlops(
        weights=3 * ((ffn + qkv + out_proj) * n + unembed), attention=3 * 4 * t * h * d * pairs / s
    )


def attended_pairs(length: int, window: int) -> float:
    """(query, key) pairs of one causal row of `length` tokens (MaxText's S²/2 approximation);
    with a window of W < length keys, S·W − W²/2."""
    if window <= 0 or window >= length:
        return length * length / 2
    return length * window - window * window / 2


def mfu(achieved_tflops_per_device: float, peak: Peak) -> float:
    return achieved_tflops_per_device / peak.tflops if peak.tflops > 0 else 0.0
