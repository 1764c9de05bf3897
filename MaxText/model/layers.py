"""Transformer building blocks (flax linen): norms, RoPE, attention, MLPs and one decoder layer.

Every parameter is created through `_param`, which attaches logical axis names
(`nn.with_logical_partitioning`); `MaxText/sharding.py` maps those names onto mesh axes. Parameters
are stored in `weight_dtype` and cast to `dtype` for compute; normalisation statistics, softmax and
RoPE angles are computed in float32. Shape suffixes: B batch, L length, E embed, H query heads,
K kv heads, G query heads per kv head, D head dim, M mlp, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from MaxText.config import Config
from MaxText.model import attention
from MaxText.model.moe import MoeBlock

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return DTYPES[name]


def fan_in_init(in_axis=-2, out_axis=-1):
    """Truncated normal with variance 1 / fan_in (fan_in over `in_axis`, possibly a tuple)."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )


def _param(module: nn.Module, name: str, init: Callable, shape, axes, weight_dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, weight_dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (llama)."""

    epsilon: float
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",), self.weight_dtype
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nn.Module):
    """Mean/variance norm with a learned scale and bias (gpt)."""

    epsilon: float
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        e = x.shape[-1]
        scale = _param(self, "scale", nn.initializers.ones, (e,), ("norm",), self.weight_dtype)
        bias = _param(self, "bias", nn.initializers.zeros, (e,), ("norm",), self.weight_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def norm_for(config: Config, name: str) -> nn.Module:
    cls = LayerNorm if config.decoder_block == "gpt" else RMSNorm
    return cls(
        epsilon=config.normalization_layer_epsilon,
        dtype=dtype_of(config.dtype),
        weight_dtype=dtype_of(config.weight_dtype),
        name=name,
    )


def rope_frequencies(config: Config, head_dim: int):
    """The RoPE inverse frequencies [head_dim / 2] (float32) of `config`.

    default: `1 / rope_max_timescale ** (2i / head_dim)`. llama3.1 (Llama 3.1's `rope_scaling`,
    `rope_type: llama3` in Hugging Face's config): wavelengths 2 pi / f longer than
    original / low_freq_factor are divided by `rope_scaling_factor`, those shorter than
    original / high_freq_factor kept, and the band between interpolated linearly in
    original / wavelength (computed in float64, then rounded to float32)."""
    fraction = 2.0 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    if config.rope_type == "default":
        return 1.0 / (config.rope_max_timescale**fraction)
    base = 1.0 / (config.rope_max_timescale ** (2.0 * np.arange(head_dim // 2) / head_dim))
    original = float(config.rope_original_max_position_embeddings)
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2.0 * np.pi / base
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1.0 - smooth) * base / config.rope_scaling_factor + smooth * base
    scaled = np.where(wavelength > original / low, base / config.rope_scaling_factor, base)
    scaled = np.where((wavelength <= original / low) & (wavelength >= original / high),
                      interpolated, scaled)  # fmt: skip
    return jnp.asarray(scaled, jnp.float32)


def apply_rope(x_BxLxNxD, positions_BxL, inv_freq_F):
    """Rotary position embedding, rotating the two halves of the head dimension (Hugging Face's
    `rotate_half` convention) by angles position x `inv_freq_F` (see `rope_frequencies`)."""
    angles_BxLx1xF = (positions_BxL.astype(jnp.float32)[..., None] * inv_freq_F)[:, :, None, :]
    sin, cos = jnp.sin(angles_BxLx1xF), jnp.cos(angles_BxLx1xF)
    x32 = x_BxLxNxD.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxD.dtype)


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query heads (num_kv_heads <= num_query_heads).

    Projections and RoPE here; the masked softmax itself is a kernel of
    `MaxText/model/attention.py`.
    `segment_ids_BxL` (packed rows) restricts each token to its own segment; None: causal only.

    Decoding: with `cache={"key": k_BxTxKxD, "value": v_BxTxKxD}` the new keys and values are
    written at slots `positions_BxL` (slot = position; the rows of a step are consecutive), every
    query attends to the cached slots up to its own position, and the call returns
    (output, updated cache). Without a cache (training) nothing of this runs."""

    config: Config

    @nn.compact
    def __call__(self, x_BxLxE, positions_BxL, segment_ids_BxL=None, cache=None):
        c = self.config
        dtype, wdtype = dtype_of(c.dtype), dtype_of(c.weight_dtype)
        e, h, k, d = c.emb_dim, c.num_query_heads, c.num_kv_heads, c.head_dim
        use_bias = c.decoder_block == "gpt"
        x = x_BxLxE.astype(dtype)

        def project(name, heads, heads_axis, bias=use_bias):
            kernel = _param(
                self, f"{name}_kernel", fan_in_init(0, (1, 2)), (e, heads, d),
                ("embed", heads_axis, "kv"), wdtype,
            )  # fmt: skip
            y = jnp.einsum("ble,ehd->blhd", x, kernel.astype(dtype))
            if bias:
                b = _param(
                    self, f"{name}_bias", nn.initializers.zeros, (heads, d),
                    (heads_axis, "kv"), wdtype,
                )  # fmt: skip
                y = y + b.astype(dtype)
            return checkpoint_name(y, f"{name}_proj")

        q_BxLxHxD = project("query", h, "heads")
        # No key bias: it adds q·b to every score of a query, which softmax ignores (zero gradient).
        k_BxLxKxD = project("key", k, "kv_heads", bias=False)
        v_BxLxKxD = project("value", k, "kv_heads")
        if c.decoder_block != "gpt":
            inv_freq_F = rope_frequencies(c, d)
            q_BxLxHxD = apply_rope(q_BxLxHxD, positions_BxL, inv_freq_F)
            k_BxLxKxD = apply_rope(k_BxLxKxD, positions_BxL, inv_freq_F)

        if cache is None:
            kernel = attention.kernel_for(c.attention, c.attention_block_size)
            ctx_BxLxHxD = kernel(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL)
        else:
            start = (0, positions_BxL[0, 0], 0, 0)
            cache = {
                "key": jax.lax.dynamic_update_slice(cache["key"], k_BxLxKxD, start),
                "value": jax.lax.dynamic_update_slice(cache["value"], v_BxLxKxD, start),
            }
            ctx_BxLxHxD = attention.cached_dot_product(
                q_BxLxHxD, cache["key"], cache["value"], positions_BxL
            )
        ctx_BxLxHxD = checkpoint_name(ctx_BxLxHxD, "context")

        out_kernel = _param(
            self, "out_kernel", fan_in_init((0, 1), 2), (h, d, e), ("heads", "kv", "embed"), wdtype
        )
        out_BxLxE = jnp.einsum("blhd,hde->ble", ctx_BxLxHxD, out_kernel.astype(dtype))
        if use_bias:
            out_bias = _param(self, "out_bias", nn.initializers.zeros, (e,), ("embed",), wdtype)
            out_BxLxE = out_BxLxE + out_bias.astype(dtype)
        out_BxLxE = checkpoint_name(out_BxLxE, "out_proj")
        return out_BxLxE if cache is None else (out_BxLxE, cache)


class MLP(nn.Module):
    """llama: SwiGLU (silu(x W0) * (x W1)) W2; gpt: gelu(x W_in + b) W_out + b."""

    config: Config

    @nn.compact
    def __call__(self, x_BxLxE):
        c = self.config
        dtype, wdtype = dtype_of(c.dtype), dtype_of(c.weight_dtype)
        e, m = c.emb_dim, c.mlp_dim
        x = x_BxLxE.astype(dtype)

        def dense_in(name):
            kernel = _param(self, name, fan_in_init(), (e, m), ("embed", "mlp"), wdtype)
            return jnp.einsum("ble,em->blm", x, kernel.astype(dtype))

        if c.decoder_block == "llama":
            gate_BxLxM = checkpoint_name(dense_in("wi_0"), "mlpwi")
            up_BxLxM = checkpoint_name(dense_in("wi_1"), "mlpwi")
            hidden_BxLxM = jax.nn.silu(gate_BxLxM) * up_BxLxM
        else:
            bias_in = _param(self, "wi_bias", nn.initializers.zeros, (m,), ("mlp",), wdtype)
            pre_BxLxM = checkpoint_name(dense_in("wi") + bias_in.astype(dtype), "mlpwi")
            hidden_BxLxM = jax.nn.gelu(pre_BxLxM, approximate=True)
        wo = _param(self, "wo", fan_in_init(), (m, e), ("mlp", "embed"), wdtype)
        out_BxLxE = jnp.einsum("blm,me->ble", hidden_BxLxM, wo.astype(dtype))
        if c.decoder_block == "gpt":
            bias_out = _param(self, "wo_bias", nn.initializers.zeros, (e,), ("embed",), wdtype)
            out_BxLxE = out_BxLxE + bias_out.astype(dtype)
        return checkpoint_name(out_BxLxE, "mlpwo")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)).
    With a KV `cache` (decoding, see `Attention`) it returns (output, updated cache).
    A mixture-of-experts block (`config.is_moe`) has a `MoeBlock` as its feed-forward (`moe`)
    and its output is (x, routing statistics [2, E])."""

    config: Config

    @nn.compact
    def __call__(self, x_BxLxE, positions_BxL, segment_ids_BxL=None, cache=None):
        c = self.config
        h = Attention(c, name="self_attention")(
            norm_for(c, "pre_attention_norm")(x_BxLxE), positions_BxL, segment_ids_BxL, cache
        )
        if cache is not None:
            h, cache = h
        x_BxLxE = x_BxLxE + h
        if c.is_moe:
            h, stats_2xX = MoeBlock(c, name="moe")(norm_for(c, "pre_mlp_norm")(x_BxLxE))
            out = (x_BxLxE + h, stats_2xX)
        else:
            out = x_BxLxE + MLP(c, name="mlp")(norm_for(c, "pre_mlp_norm")(x_BxLxE))
        return out if cache is None else (out, cache)


class ScannedDecoderLayer(DecoderLayer):
    """`DecoderLayer` with the (carry, output) signature `nn.scan` expects: the hidden state is
    the carry; a MoE layer's routing statistics are its per-layer output (stacked by the scan,
    so every stage's scan body is the same program)."""

    @nn.compact
    def __call__(self, x_BxLxE, positions_BxL, segment_ids_BxL=None):
        out = super().__call__(x_BxLxE, positions_BxL, segment_ids_BxL)
        return out if self.config.is_moe else (out, None)


REMAT_SAVED_NAMES = {
    "minimal": ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi", "mlpwo"),
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "context", "out_proj"),
}


def remat_policy(name: str):
    """The jax.checkpoint policy for `remat_policy=name` ("full": save nothing, recompute all)."""
    if name == "full":
        return None
    return jax.checkpoint_policies.save_only_these_names(*REMAT_SAVED_NAMES[name])


def layer_class(config: Config, scanned: bool = False, stage: int = 0):
    """DecoderLayer of pipeline stage `stage`, wrapped in `nn.remat` unless its policy
    (`config.stage_remat[stage]`: remat_policy, or pipeline_stage_remat's entry) is none."""
    policy = config.stage_remat[stage] if config.stage_remat else config.remat_policy
    cls = ScannedDecoderLayer if scanned else DecoderLayer
    if policy == "none":
        return cls
    return nn.remat(cls, policy=remat_policy(policy), prevent_cse=not scanned)
