"""The self-attention block of a decoder layer: q/k/v projections (with optional biases), RoPE,
one attention kernel (`MaxText/model/attention.py`), the output projection; and its KV cache.

What varies between families is data given to the block (`Family`, `MaxText/model/family.py`):
which projections carry a bias, whether RoPE applies, the norm's `(1 + w)` offset, the layer's
attention window (an int, or a traced int when scanned layers differ); and keys: `attention_bias`
(q, k, v biases: Qwen 2), `use_qk_norm` (an RMSNorm over each head's D dimensions of q and of k,
before RoPE: Qwen 3), `attn_logits_soft_cap` and `query_pre_attn_scalar` (Gemma 2), given to the
kernel as `AttentionOptions`.
Shape suffixes: B batch, L length, E embed, H query heads, K kv heads, D head dim, T cache slots.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.config import Config
from MaxText.model import attention
from MaxText.model.norms import RMSNorm
from MaxText.model.params import dtype_of, fan_in_init, param
from MaxText.model.rope import apply_rope, rope_frequencies


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query heads (num_kv_heads <= num_query_heads).

    `biases`: the projections that carry a bias ("query", "key", "value", "out"); `rope`: rotate
    q and k (else positions come from elsewhere, e.g. gpt's learned table).
    `segment_ids_BxL` (packed rows) restricts each token to its own segment; None: causal only.

    Decoding: with `cache={"key": k_BxTxKxD, "value": v_BxTxKxD}` the new keys and values are
    written at slots `positions_BxL` (slot = position; the rows of a step are consecutive), every
    query attends to the cached slots up to its own position, and the call returns
    (output, updated cache). Without a cache (training) nothing of this runs."""

    config: Config
    biases: frozenset[str] = frozenset()
    rope: bool = True
    norm_scale_offset: float = 0.0  # of the q/k norms (Gemma's (1 + w))
    windows: tuple[int, ...] = (0,)  # every window size of the model (see AttentionOptions)

    @nn.compact
    def __call__(self, x_BxLxE, positions_BxL, segment_ids_BxL=None, cache=None, window=0):
        c = self.config
        options = attention.AttentionOptions(
            window=window,
            soft_cap=c.attn_logits_soft_cap,
            scale=c.query_pre_attn_scalar**-0.5 if c.query_pre_attn_scalar else None,
            windows=self.windows,
        )
        dtype = dtype_of(c.dtype)
        h, k = c.num_query_heads, c.num_kv_heads
        x = x_BxLxE.astype(dtype)

        q_BxLxHxD = self._project(x, "query", h, "heads")
        k_BxLxKxD = self._project(x, "key", k, "kv_heads")
        v_BxLxKxD = self._project(x, "value", k, "kv_heads")
        if c.use_qk_norm:  # per head, over D (Qwen 3's q_norm / k_norm)
            q_BxLxHxD = self._head_norm("query_norm")(q_BxLxHxD)
            k_BxLxKxD = self._head_norm("key_norm")(k_BxLxKxD)
        if self.rope:
            inv_freq_F = rope_frequencies(c, c.head_dim)
            q_BxLxHxD = apply_rope(q_BxLxHxD, positions_BxL, inv_freq_F)
            k_BxLxKxD = apply_rope(k_BxLxKxD, positions_BxL, inv_freq_F)

        if cache is None:
            kernel = attention.kernel_for(c.attention, c.attention_block_size)
            ctx_BxLxHxD = kernel(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL, options=options)
        else:
            start = (0, positions_BxL[0, 0], 0, 0)
            cache = {
                "key": jax.lax.dynamic_update_slice(cache["key"], k_BxLxKxD, start),
                "value": jax.lax.dynamic_update_slice(cache["value"], v_BxLxKxD, start),
            }
            ctx_BxLxHxD = attention.cached_dot_product(
                q_BxLxHxD, cache["key"], cache["value"], positions_BxL, options
            )
        ctx_BxLxHxD = checkpoint_name(ctx_BxLxHxD, "context")
        out_BxLxE = self._out(ctx_BxLxHxD)
        return out_BxLxE if cache is None else (out_BxLxE, cache)

    def _head_norm(self, name: str) -> RMSNorm:
        c = self.config
        return RMSNorm(
            epsilon=c.normalization_layer_epsilon,
            dtype=dtype_of(c.dtype),
            weight_dtype=dtype_of(c.weight_dtype),
            scale_offset=self.norm_scale_offset,
            name=name,
        )

    def _project(self, x_BxLxE, name: str, heads: int, heads_axis: str):
        """`x @ {name}_kernel [E, heads, D]` (+ `{name}_bias [heads, D]` if it has one)."""
        c = self.config
        dtype, wdtype = dtype_of(c.dtype), dtype_of(c.weight_dtype)
        kernel = param(
            self, f"{name}_kernel", fan_in_init(0, (1, 2)), (c.emb_dim, heads, c.head_dim),
            ("embed", heads_axis, "kv"), wdtype,
        )  # fmt: skip
        y = jnp.einsum("ble,ehd->blhd", x_BxLxE, kernel.astype(dtype))
        if name in self.biases:
            b = param(
                self, f"{name}_bias", nn.initializers.zeros, (heads, c.head_dim),
                (heads_axis, "kv"), wdtype,
            )  # fmt: skip
            y = y + b.astype(dtype)
        return checkpoint_name(y, f"{name}_proj")

    def _out(self, ctx_BxLxHxD):
        c = self.config
        dtype, wdtype = dtype_of(c.dtype), dtype_of(c.weight_dtype)
        h, d, e = c.num_query_heads, c.head_dim, c.emb_dim
        kernel = param(
            self, "out_kernel", fan_in_init((0, 1), 2), (h, d, e), ("heads", "kv", "embed"), wdtype
        )
        out_BxLxE = jnp.einsum("blhd,hde->ble", ctx_BxLxHxD, kernel.astype(dtype))
        if "out" in self.biases:
            bias = param(self, "out_bias", nn.initializers.zeros, (e,), ("embed",), wdtype)
            out_BxLxE = out_BxLxE + bias.astype(dtype)
        return checkpoint_name(out_BxLxE, "out_proj")
