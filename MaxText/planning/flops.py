"""Model FLOPs per training step (MaxText's analytic formula) and MFU.

With T = tokens per step (global batch x max_target_length), S = max_target_length,
E = emb_dim, M = mlp_dim, H / K = query / kv heads, D = head_dim, N = decoder layers, V = vocab:

    ffn       = 2·T·E·M·n_in + 2·T·M·E      (n_in: the family's input kernels, 2 gated, 1 gpt)
    qkv       = 2·T·E·(H + 2K)·D
    out_proj  = 2·T·H·D·E
    unembed   = 2·T·E·V
    attention = (4·T·S·H·D) / 2             (QK^T and PV; halved because attention is causal)

    training FLOPs per step = 3 · [(ffn + qkv + out_proj)·N + unembed] + 3 · attention·N

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

__all__ = ["Peak", "StepFlops", "matmul_flops", "mfu", "peak_tflops", "training_flops_per_step"]


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
    attention = 4 * t * s * h * d / 2
    n = config.num_decoder_layers
    return StepFlops(
        weights=3 * ((ffn + qkv + out_proj) * n + unembed), attention=3 * attention * n
    )


def mfu(achieved_tflops_per_device: float, peak: Peak) -> float:
    return achieved_tflops_per_device / peak.tflops if peak.tflops > 0 else 0.0
