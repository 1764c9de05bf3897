"""Rotary position embedding (RoPE): the inverse frequencies of `rope_type` and their rotation.

Both follow Hugging Face's convention (`rotate_half`: the first and second half of each head's
dimensions form the rotated pairs), so converted q/k projections need no permutation.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def rope_frequencies(config, head_dim: int):
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
