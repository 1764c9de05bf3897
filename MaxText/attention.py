"""Attention kernels: the masked softmax(q k^T / sqrt(d)) v of one layer, several implementations.

Every kernel takes the projected (and rotated) heads and returns the context:

    q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL or None  ->  ctx_BxLxHxD

with grouped-query heads (H query heads share K kv heads, G = H / K per kv head) and a causal mask.
With `segment_ids_BxL` (packed rows) a query also sees only keys of its own segment, as MaxText
does: segment 0 is padding, which attends only to padding (its loss is masked), so no softmax row is
ever empty. `segment_ids_BxL=None` is exactly the plain causal mask.

Shape suffixes as in `MaxText/layers.py`: B batch, L query length, M key length, H query heads,
K kv heads, G query heads per kv head, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(length: int, segment_ids_BxL=None):
    """True where a query (row) may attend to a key (column): causal, and same segment if given.

    Shape [L, L] without segment ids, [B, L, L] with them."""
    causal_LxL = jnp.tril(jnp.ones((length, length), dtype=bool))
    if segment_ids_BxL is None:
        return causal_LxL
    same_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return causal_LxL & same_BxLxL


def dot_product(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL=None):
    """The reference kernel: full [L, L] scores in float32, masked softmax, then the values."""
    b, length, h, d = q_BxLxHxD.shape
    k = k_BxLxKxD.shape[2]
    dtype = q_BxLxHxD.dtype
    q_BxLxKxGxD = q_BxLxHxD.reshape(b, length, k, h // k, d) * jnp.asarray(d**-0.5, dtype)
    scores_BxKxGxLxM = jnp.einsum(
        "blkgd,bmkd->bkglm", q_BxLxKxGxD, k_BxLxKxD, preferred_element_type=jnp.float32
    )
    mask = attention_mask(length, segment_ids_BxL)
    if segment_ids_BxL is not None:
        mask = mask[:, None, None]  # [B, 1, 1, L, M] against [B, K, G, L, M]
    scores_BxKxGxLxM = jnp.where(mask, scores_BxKxGxLxM, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxLxM, axis=-1).astype(dtype)
    ctx_BxLxKxGxD = jnp.einsum("bkglm,bmkd->blkgd", probs, v_BxLxKxD)
    return ctx_BxLxKxGxD.reshape(b, length, h, d)
