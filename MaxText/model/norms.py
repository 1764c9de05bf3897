"""Normalisation layers: RMSNorm (Llama and most families; Gemma's `(1 + w)` variant) and
LayerNorm (gpt). Statistics are computed in float32; the output is cast to `dtype`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText.model.params import param


class RMSNorm(nn.Module):
    """x / rms(x) * (scale_offset + w) with a learned scale w over the last axis.

    `scale_offset=0` (Llama, Mistral, Qwen): w starts at 1. `scale_offset=1` (Gemma): the stored
    weight is w with the output multiplied by (1 + w), computed in float32 as Hugging Face's
    `Gemma2RMSNorm` does; w starts at 0 so a fresh layer is the plain normalisation."""

    epsilon: float
    dtype: jnp.dtype
    weight_dtype: jnp.dtype
    scale_offset: float = 0.0

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.scale_offset else nn.initializers.ones
        scale = param(self, "scale", init, (x.shape[-1],), ("norm",), self.weight_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        scale32 = scale.astype(jnp.float32)
        if self.scale_offset:
            scale32 = self.scale_offset + scale32
        return (y * scale32).astype(self.dtype)


class LayerNorm(nn.Module):
    """Mean/variance norm with a learned scale and bias (gpt)."""

    epsilon: float
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        e = x.shape[-1]
        scale = param(self, "scale", nn.initializers.ones, (e,), ("norm",), self.weight_dtype)
        bias = param(self, "bias", nn.initializers.zeros, (e,), ("norm",), self.weight_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)
