"""Attention kernels: the masked softmax(q k^T / sqrt(d)) v of one layer, several implementations.

`attention=` picks one (`kernel_for`):
- `dot_product`: the einsum reference; full [L, L] float32 scores per head.
- `autoselected`: `jax.nn.dot_product_attention` with `implementation=None`, which JAX resolves to
  its XLA implementation (dense scores, like `dot_product`); not cuDNN.
- `cudnn_flash`: the same with `implementation="cudnn"`: cuDNN's fused flash attention (GPU only,
  `devices.setup` checks; bfloat16/float16 only, the config checks). Packed rows are refused:
  `jax.nn.dot_product_attention` takes per-row sequence lengths but no segment ids, and a
  segment mask would reach cuDNN as a dense [B, 1, L, L] bias (O(L^2) memory, not flash).
- `chunked`: blockwise attention in pure JAX (online softmax over blocks of
  `attention_block_size` keys, custom VJP recomputing each block): O(L x block) memory forward
  and backward, on any backend.

Every kernel takes the projected (and rotated) heads and returns the context:

    q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL or None  ->  ctx_BxLxHxD

with grouped-query heads (H query heads share K kv heads, G = H / K per kv head) and a causal mask.
With `segment_ids_BxL` (packed rows) a query also sees only keys of its own segment, as MaxText
does: segment 0 is padding, which attends only to padding (its loss is masked), so no softmax row is
ever empty. `segment_ids_BxL=None` is exactly the plain causal mask.

Shape suffixes as in `MaxText/model/layers.py`: B batch, L query length, M key length, H query
heads, K kv heads, G query heads per kv head, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from MaxText.config import ATTENTION_KERNELS


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


def cached_dot_product(q_BxLxHxD, k_BxTxKxD, v_BxTxKxD, positions_BxL):
    """Decoding against a KV cache of T slots (slot = position): query l of row b sees the
    slots up to `positions_BxL[b, l]`; later slots (unwritten, or stale padding) are masked.
    Scores in float32 as in `dot_product`."""
    b, length, h, d = q_BxLxHxD.shape
    t, k = k_BxTxKxD.shape[1], k_BxTxKxD.shape[2]
    dtype = q_BxLxHxD.dtype
    q_BxLxKxGxD = q_BxLxHxD.reshape(b, length, k, h // k, d) * jnp.asarray(d**-0.5, dtype)
    scores_BxKxGxLxT = jnp.einsum(
        "blkgd,btkd->bkglt", q_BxLxKxGxD, k_BxTxKxD, preferred_element_type=jnp.float32
    )
    visible_BxLxT = jnp.arange(t)[None, None, :] <= positions_BxL[:, :, None]
    scores_BxKxGxLxT = jnp.where(
        visible_BxLxT[:, None, None], scores_BxKxGxLxT, jnp.finfo(jnp.float32).min
    )
    probs = jax.nn.softmax(scores_BxKxGxLxT, axis=-1).astype(dtype)
    ctx_BxLxKxGxD = jnp.einsum("bkglt,btkd->blkgd", probs, v_BxTxKxD)
    return ctx_BxLxKxGxD.reshape(b, length, h, d)


def _nn_dot_product_attention(implementation):
    """`jax.nn.dot_product_attention` with the causal flag and the segment mask (if any; never
    with cuDNN, see the module docstring)."""

    def kernel(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL=None):
        mask = None
        if segment_ids_BxL is not None and implementation == "cudnn":
            raise ValueError(
                "attention=cudnn_flash does not take packed rows (segment ids): JAX would pass "
                "their mask to cuDNN as a dense [L, L] bias; use attention=chunked"
            )
        if segment_ids_BxL is not None:
            same_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
            mask = same_BxLxL[:, None]  # [B, 1, L, M]: every head alike
        return jax.nn.dot_product_attention(
            q_BxLxHxD,
            k_BxLxKxD,
            v_BxLxKxD,
            mask=mask,
            is_causal=True,
            implementation=implementation,
        )

    return kernel


# ------------------------------------------------------------------ chunked (memory-efficient)
#
# Online softmax over key blocks (Rabe & Staats 2021, "Self-attention does not need O(n^2)
# memory"; the FlashAttention-2 recurrences): for each block of keys, scores [L, block], a running
# row maximum m, denominator l and unnormalised context acc. The backward pass is a custom VJP that
# keeps only q, k, v, the output and the row log-sum-exp (all O(L)) and recomputes each block's
# probabilities, so neither direction materialises an [L, L] array.
# Internal layout: q5 [B, L, K, G, D] (already scaled), keys/values in blocks [N, B, C, K, D]
# (N blocks of C keys), segment ids [B, L] for queries and [N, B, C] for keys (padding keys -1).


def _block_mask(q_seg_BxL, k_seg_BxC, block_index, block):
    """[B, 1, 1, L, C]: causal (query index >= key index) and same segment."""
    length = q_seg_BxL.shape[1]
    q_idx = jnp.arange(length)[:, None]
    k_idx = block_index * block + jnp.arange(block)[None, :]
    same = q_seg_BxL[:, :, None] == k_seg_BxC[:, None, :]
    return ((q_idx >= k_idx)[None] & same)[:, None, None]


def _block_scores(q5, k_BxCxKxD, mask):
    s = jnp.einsum("blkgd,bmkd->bkglm", q5, k_BxCxKxD, preferred_element_type=jnp.float32)
    return jnp.where(mask, s, jnp.finfo(jnp.float32).min)


def _chunked_forward(q5, k_blocks, v_blocks, q_seg, k_seg_blocks):
    """(context [B, L, K, G, D] float32, row log-sum-exp [B, K, G, L] float32)."""
    b, length, kh, g, d = q5.shape
    block = k_blocks.shape[2]
    neg = jnp.finfo(jnp.float32).min
    init = (
        jnp.full((b, kh, g, length), neg, jnp.float32),  # running max
        jnp.zeros((b, kh, g, length), jnp.float32),  # running denominator
        jnp.zeros((b, length, kh, g, d), jnp.float32),  # running unnormalised context
    )

    def step(carry, xs):
        row_max, denom, acc = carry
        i, k_blk, v_blk, k_seg = xs
        mask = _block_mask(q_seg, k_seg, i, block)
        s = _block_scores(q5, k_blk, mask)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - new_max[..., None]), 0.0)
        correction = jnp.exp(row_max - new_max)
        denom = denom * correction + jnp.sum(p, axis=-1)
        pv = jnp.einsum(
            "bkglm,bmkd->blkgd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32
        )
        acc = acc * jnp.moveaxis(correction, 3, 1)[..., None] + pv
        return (new_max, denom, acc), None

    n = k_blocks.shape[0]
    xs = (jnp.arange(n), k_blocks, v_blocks, k_seg_blocks)
    (row_max, denom, acc), _ = jax.lax.scan(step, init, xs)
    # every query sees at least itself, so denom > 0
    out = acc / jnp.moveaxis(denom, 3, 1)[..., None]
    return out, row_max + jnp.log(denom)


@jax.custom_vjp
def _chunked_core(q5, k_blocks, v_blocks, q_seg, k_seg_blocks):
    out, _ = _chunked_forward(q5, k_blocks, v_blocks, q_seg, k_seg_blocks)
    return out.astype(q5.dtype)


def _chunked_core_fwd(q5, k_blocks, v_blocks, q_seg, k_seg_blocks):
    out, lse = _chunked_forward(q5, k_blocks, v_blocks, q_seg, k_seg_blocks)
    out = out.astype(q5.dtype)
    return out, (q5, k_blocks, v_blocks, q_seg, k_seg_blocks, out, lse)


def _chunked_core_bwd(residuals, d_out):
    q5, k_blocks, v_blocks, q_seg, k_seg_blocks, out, lse = residuals
    block = k_blocks.shape[2]
    d_out = d_out.astype(jnp.float32)
    # rowsum(dO * O) = sum_j P_ij dP_ij: the softmax backward's per-row term
    delta = jnp.moveaxis(jnp.sum(d_out * out.astype(jnp.float32), axis=-1), 1, 3)
    q32 = q5.astype(jnp.float32)

    def step(dq, xs):
        i, k_blk, v_blk, k_seg = xs
        mask = _block_mask(q_seg, k_seg, i, block)
        s = _block_scores(q5, k_blk, mask)
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # [B, K, G, L, C]
        dv = jnp.einsum("bkglm,blkgd->bmkd", p, d_out)
        dp = jnp.einsum("blkgd,bmkd->bkglm", d_out, v_blk.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("bkglm,bmkd->blkgd", ds, k_blk.astype(jnp.float32))
        dk = jnp.einsum("bkglm,blkgd->bmkd", ds, q32)
        return dq, (dk.astype(k_blk.dtype), dv.astype(v_blk.dtype))

    n = k_blocks.shape[0]
    dq, (dk, dv) = jax.lax.scan(
        step, jnp.zeros(q5.shape, jnp.float32), (jnp.arange(n), k_blocks, v_blocks, k_seg_blocks)
    )
    return dq.astype(q5.dtype), dk, dv, None, None


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL=None, block_size: int = 512):
    """Blockwise attention: O(L x block_size) memory forward and backward, any backend.

    Keys are padded to a multiple of the block; padded keys come after every query, so the causal
    mask hides them."""
    b, length, h, d = q_BxLxHxD.shape
    kh = k_BxLxKxD.shape[2]
    dtype = q_BxLxHxD.dtype
    block = min(block_size, length)
    n = -(-length // block)
    pad = n * block - length
    q5 = q_BxLxHxD.reshape(b, length, kh, h // kh, d) * jnp.asarray(d**-0.5, dtype)
    if segment_ids_BxL is None:
        q_seg = jnp.zeros((b, length), jnp.int32)
    else:
        q_seg = segment_ids_BxL.astype(jnp.int32)

    def blocks(x_BxLx___, fill=0):
        widths = ((0, 0), (0, pad)) + ((0, 0),) * (x_BxLx___.ndim - 2)
        x = jnp.pad(x_BxLx___, widths, constant_values=fill)
        x = x.reshape(b, n, block, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    k_seg = blocks(q_seg, fill=-1)
    out = _chunked_core(q5, blocks(k_BxLxKxD), blocks(v_BxLxKxD), q_seg, k_seg)
    return out.reshape(b, length, h, d)


def kernel_for(name: str, block_size: int = 512):
    """The kernel of `attention=name`: (q, k, v, segment_ids_BxL) -> context."""
    if name == "dot_product":
        return dot_product
    if name == "autoselected":
        return _nn_dot_product_attention(None)
    if name == "cudnn_flash":
        return _nn_dot_product_attention("cudnn")
    if name == "chunked":
        return lambda q, k, v, segment_ids_BxL=None: chunked(q, k, v, segment_ids_BxL, block_size)
    raise ValueError(f"attention={name} is not one of {' | '.join(ATTENTION_KERNELS)}")
