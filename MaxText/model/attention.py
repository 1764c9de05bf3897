"""Attention kernels: the masked softmax(cap(q k^T x scale)) v of one layer, several ways.

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

    q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL or None, *, options  ->  ctx_BxLxHxD

with grouped-query heads (H query heads share K kv heads, G = H / K per kv head) and a causal mask.
The options (`AttentionOptions`, what families vary): `window` W > 0 keeps, for query q, the keys
q - W < k <= q (W keys including itself: Hugging Face's eager/SDPA mask for Mistral and Gemma 2;
0 = all earlier keys); it may be a traced integer (a scanned layer's per-layer input), so one
layer program serves local and global layers. `soft_cap` c > 0 replaces every score s by
c tanh(s / c) before the mask (Gemma 2). `scale` multiplies q k^T (default D^-0.5; Gemma 2:
query_pre_attn_scalar^-0.5). `cudnn_flash`/`autoselected` express a window as
`local_window_size=(W - 1, 0)` (a traced W picks among the model's window sizes with
`lax.switch`) and cannot soft-cap (the config refuses that combination).
With `segment_ids_BxL` (packed rows) a query also sees only keys of its own segment, as MaxText
does: segment 0 is padding, which attends only to padding (its loss is masked), so no softmax row is
ever empty. `segment_ids_BxL=None` is exactly the plain causal mask.

Shape suffixes as in `MaxText/model/layers.py`: B batch, L query length, M key length, H query
heads, K kv heads, G query heads per kv head, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from MaxText.config import ATTENTION_KERNELS


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """What a layer's attention varies (see the module docstring). `window` is an int or a
    traced int32 scalar; the others are static. `windows`: every window size of the model (for
    the kernels that need a static one: `lax.switch` over these)."""

    window: Any = 0
    soft_cap: float = 0.0
    scale: float | None = None
    windows: tuple[int, ...] = (0,)

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale


DEFAULT = AttentionOptions()


def _is_static_zero(window) -> bool:
    return isinstance(window, int) and window == 0


def in_window(q_idx, k_idx, window):
    """True where key k_idx is among the `window` latest keys of query q_idx (broadcasting);
    None when `window` is a static 0 (no window: nothing to mask)."""
    if _is_static_zero(window):
        return None
    inside = q_idx - k_idx < window
    return inside if isinstance(window, int) else inside | (window <= 0)


def attention_mask(length: int, segment_ids_BxL=None, window=0):
    """True where a query (row) may attend to a key (column): causal, within `window` if one is
    given, and same segment if given. Shape [L, L] without segment ids, [B, L, L] with them."""
    causal_LxL = jnp.tril(jnp.ones((length, length), dtype=bool))
    local = in_window(jnp.arange(length)[:, None], jnp.arange(length)[None, :], window)
    if local is not None:
        causal_LxL = causal_LxL & local
    if segment_ids_BxL is None:
        return causal_LxL
    same_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return causal_LxL & same_BxLxL


def soft_capped(scores, soft_cap: float):
    """c tanh(s / c) (Gemma 2's logit soft-capping); the scores as they are when c is 0."""
    return soft_cap * jnp.tanh(scores / soft_cap) if soft_cap else scores


def _grouped_scores(q_BxLxHxD, k_BxMxKxD, options: AttentionOptions):
    """Scaled (and soft-capped) scores [B, K, G, L, M] in float32, q grouped by kv head."""
    b, length, h, d = q_BxLxHxD.shape
    k = k_BxMxKxD.shape[2]
    scale = jnp.asarray(options.scale_for(d), q_BxLxHxD.dtype)
    q_BxLxKxGxD = q_BxLxHxD.reshape(b, length, k, h // k, d) * scale
    scores = jnp.einsum(
        "blkgd,bmkd->bkglm", q_BxLxKxGxD, k_BxMxKxD, preferred_element_type=jnp.float32
    )
    return soft_capped(scores, options.soft_cap)


def dot_product(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL=None, options=DEFAULT):
    """The reference kernel: full [L, L] scores in float32, masked softmax, then the values."""
    b, length, h, d = q_BxLxHxD.shape
    dtype = q_BxLxHxD.dtype
    scores_BxKxGxLxM = _grouped_scores(q_BxLxHxD, k_BxLxKxD, options)
    mask = attention_mask(length, segment_ids_BxL, options.window)
    if segment_ids_BxL is not None:
        mask = mask[:, None, None]  # [B, 1, 1, L, M] against [B, K, G, L, M]
    scores_BxKxGxLxM = jnp.where(mask, scores_BxKxGxLxM, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxLxM, axis=-1).astype(dtype)
    ctx_BxLxKxGxD = jnp.einsum("bkglm,bmkd->blkgd", probs, v_BxLxKxD)
    return ctx_BxLxKxGxD.reshape(b, length, h, d)


def cached_dot_product(q_BxLxHxD, k_BxTxKxD, v_BxTxKxD, positions_BxL, options=DEFAULT):
    """Decoding against a KV cache of T slots (slot = position): query l of row b sees the
    slots up to `positions_BxL[b, l]` (and, with a window W, not those W or more positions
    older); later slots (unwritten, or stale padding) are masked. Scores in float32 as in
    `dot_product`."""
    b, length, h, d = q_BxLxHxD.shape
    t = k_BxTxKxD.shape[1]
    dtype = q_BxLxHxD.dtype
    scores_BxKxGxLxT = _grouped_scores(q_BxLxHxD, k_BxTxKxD, options)
    slots_1x1xT = jnp.arange(t)[None, None, :]
    visible_BxLxT = slots_1x1xT <= positions_BxL[:, :, None]
    local = in_window(positions_BxL[:, :, None], slots_1x1xT, options.window)
    if local is not None:
        visible_BxLxT = visible_BxLxT & local
    scores_BxKxGxLxT = jnp.where(
        visible_BxLxT[:, None, None], scores_BxKxGxLxT, jnp.finfo(jnp.float32).min
    )
    probs = jax.nn.softmax(scores_BxKxGxLxT, axis=-1).astype(dtype)
    ctx_BxLxKxGxD = jnp.einsum("bkglt,btkd->blkgd", probs, v_BxTxKxD)
    return ctx_BxLxKxGxD.reshape(b, length, h, d)


def _nn_dot_product_attention(implementation):
    """`jax.nn.dot_product_attention` with the causal flag, the window as `local_window_size`
    and the segment mask (if any; never with cuDNN, see the module docstring)."""

    def kernel(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL=None, options=DEFAULT):
        name = "cudnn_flash" if implementation == "cudnn" else "autoselected"
        if options.soft_cap:
            raise ValueError(
                f"attention={name} cannot soft-cap attention logits (attn_logits_soft_cap="
                f"{options.soft_cap}); use attention=chunked or dot_product"
            )
        mask = None
        if segment_ids_BxL is not None and implementation == "cudnn":
            raise ValueError(
                "attention=cudnn_flash does not take packed rows (segment ids): JAX would pass "
                "their mask to cuDNN as a dense [L, L] bias; use attention=chunked"
            )
        if segment_ids_BxL is not None:
            same_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
            mask = same_BxLxL[:, None]  # [B, 1, L, M]: every head alike

        def run(window: int):
            return jax.nn.dot_product_attention(
                q_BxLxHxD,
                k_BxLxKxD,
                v_BxLxKxD,
                mask=mask,
                scale=options.scale,
                is_causal=True,
                local_window_size=(window - 1, 0) if window else None,
                implementation=implementation,
            )

        if isinstance(options.window, int):
            return run(options.window)
        choices = tuple(sorted(set(options.windows)))  # a traced window: one branch per size
        index = jnp.searchsorted(jnp.asarray(choices), options.window)
        return jax.lax.switch(index, [functools.partial(run, w) for w in choices])

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
# `static` = (soft cap, window if it is static else None): hashable, a non-differentiable argument
# of the custom VJP; a traced window travels as the int32 array `window`.
# Soft-capping: s = c tanh(r / c) of the raw scores r, so the backward multiplies dL/ds by
# ds/dr = 1 - tanh(r / c)^2 before the usual softmax backward.


def _block_mask(q_seg_BxL, k_seg_BxC, block_index, block, window):
    """[B, 1, 1, L, C]: causal (query index >= key index), within the window, same segment."""
    length = q_seg_BxL.shape[1]
    q_idx = jnp.arange(length)[:, None]
    k_idx = block_index * block + jnp.arange(block)[None, :]
    same = q_seg_BxL[:, :, None] == k_seg_BxC[:, None, :]
    allowed = q_idx >= k_idx
    local = in_window(q_idx, k_idx, window)
    if local is not None:
        allowed = allowed & local
    return (allowed[None] & same)[:, None, None]


def _block_tanh_and_scores(q5, k_BxCxKxD, mask, soft_cap):
    """(tanh(r / c) or None, the masked scores [B, K, G, L, C] in float32)."""
    r = jnp.einsum("blkgd,bmkd->bkglm", q5, k_BxCxKxD, preferred_element_type=jnp.float32)
    t = jnp.tanh(r / soft_cap) if soft_cap else None
    s = soft_cap * t if soft_cap else r
    return t, jnp.where(mask, s, jnp.finfo(jnp.float32).min)


def _window_of(static, window):
    return window if static[1] is None else static[1]


def _chunked_forward(static, q5, k_blocks, v_blocks, q_seg, k_seg_blocks, window):
    """(context [B, L, K, G, D] float32, row log-sum-exp [B, K, G, L] float32)."""
    soft_cap, window = static[0], _window_of(static, window)
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
        mask = _block_mask(q_seg, k_seg, i, block, window)
        _, s = _block_tanh_and_scores(q5, k_blk, mask, soft_cap)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_core(static, q5, k_blocks, v_blocks, q_seg, k_seg_blocks, window):
    out, _ = _chunked_forward(static, q5, k_blocks, v_blocks, q_seg, k_seg_blocks, window)
    return out.astype(q5.dtype)


def _chunked_core_fwd(static, q5, k_blocks, v_blocks, q_seg, k_seg_blocks, window):
    out, lse = _chunked_forward(static, q5, k_blocks, v_blocks, q_seg, k_seg_blocks, window)
    out = out.astype(q5.dtype)
    return out, (q5, k_blocks, v_blocks, q_seg, k_seg_blocks, window, out, lse)


def _chunked_core_bwd(static, residuals, d_out):
    q5, k_blocks, v_blocks, q_seg, k_seg_blocks, window, out, lse = residuals
    soft_cap, window = static[0], _window_of(static, window)
    block = k_blocks.shape[2]
    d_out = d_out.astype(jnp.float32)
    # rowsum(dO * O) = sum_j P_ij dP_ij: the softmax backward's per-row term
    delta = jnp.moveaxis(jnp.sum(d_out * out.astype(jnp.float32), axis=-1), 1, 3)
    q32 = q5.astype(jnp.float32)

    def step(dq, xs):
        i, k_blk, v_blk, k_seg = xs
        mask = _block_mask(q_seg, k_seg, i, block, window)
        t, s = _block_tanh_and_scores(q5, k_blk, mask, soft_cap)
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)  # [B, K, G, L, C]
        dv = jnp.einsum("bkglm,blkgd->bmkd", p, d_out)
        dp = jnp.einsum("blkgd,bmkd->bkglm", d_out, v_blk.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        if soft_cap:
            ds = ds * (1.0 - t * t)
        dq = dq + jnp.einsum("bkglm,bmkd->blkgd", ds, k_blk.astype(jnp.float32))
        dk = jnp.einsum("bkglm,blkgd->bmkd", ds, q32)
        return dq, (dk.astype(k_blk.dtype), dv.astype(v_blk.dtype))

    n = k_blocks.shape[0]
    dq, (dk, dv) = jax.lax.scan(
        step, jnp.zeros(q5.shape, jnp.float32), (jnp.arange(n), k_blocks, v_blocks, k_seg_blocks)
    )
    return dq.astype(q5.dtype), dk, dv, None, None, None


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked(
    q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL=None, block_size: int = 512, options=DEFAULT
):
    """Blockwise attention: O(L x block_size) memory forward and backward, any backend; the
    window and the soft cap are applied inside each block (no [L, L] mask).

    Keys are padded to a multiple of the block; padded keys come after every query, so the causal
    mask hides them."""
    b, length, h, d = q_BxLxHxD.shape
    kh = k_BxLxKxD.shape[2]
    dtype = q_BxLxHxD.dtype
    block = min(block_size, length)
    n = -(-length // block)
    pad = n * block - length
    scale = jnp.asarray(options.scale_for(d), dtype)
    q5 = q_BxLxHxD.reshape(b, length, kh, h // kh, d) * scale
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
    static_window = options.window if isinstance(options.window, int) else None
    static = (float(options.soft_cap), static_window)
    window = jnp.asarray(0 if static_window is not None else options.window, jnp.int32)
    out = _chunked_core(static, q5, blocks(k_BxLxKxD), blocks(v_BxLxKxD), q_seg, k_seg, window)
    return out.reshape(b, length, h, d)


def kernel_for(name: str, block_size: int = 512):
    """The kernel of `attention=name`: (q, k, v, segment_ids_BxL, options) -> context."""
    if name == "dot_product":
        return dot_product
    if name == "autoselected":
        return _nn_dot_product_attention(None)
    if name == "cudnn_flash":
        return _nn_dot_product_attention("cudnn")
    if name == "chunked":
        return functools.partial(chunked, block_size=block_size)
    raise ValueError(f"attention={name} is not one of {' | '.join(ATTENTION_KERNELS)}")
