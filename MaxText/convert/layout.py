"""Tensor names and layouts: Hugging Face Llama (PyTorch `[out, in]`) <-> our canonical tree.

Our canonical parameter tree is the one checkpoints store (`MaxText/checkpoint/layout.py`): every
decoder layer its own `layers_<i>` sub-tree, kernels `[in, ...out]` with heads split out
(`query_kernel [E, H, D]`, `out_kernel [H, D, E]`). A `Tensor` says, for one leaf, its path in
that tree, its Hugging Face name, its shape on both sides, and the two layout maps:

    model.embed_tokens.weight                   [V, E]     token_embedding          [V, E]
    model.layers.{i}.input_layernorm.weight     [E]        layers_i/pre_attention_norm/scale
    model.layers.{i}.self_attn.q_proj.weight    [H*D, E]   .../self_attention/query_kernel [E, H, D]
    model.layers.{i}.self_attn.k_proj.weight    [K*D, E]   .../self_attention/key_kernel   [E, K, D]
    model.layers.{i}.self_attn.v_proj.weight    [K*D, E]   .../self_attention/value_kernel [E, K, D]
    model.layers.{i}.self_attn.o_proj.weight    [E, H*D]   .../self_attention/out_kernel   [H, D, E]
    model.layers.{i}.post_attention_layernorm.weight [E]   layers_i/pre_mlp_norm/scale
    model.layers.{i}.mlp.gate_proj.weight       [M, E]     layers_i/mlp/wi_0        [E, M]
    model.layers.{i}.mlp.up_proj.weight         [M, E]     layers_i/mlp/wi_1        [E, M]
    model.layers.{i}.mlp.down_proj.weight       [E, M]     layers_i/mlp/wo          [M, E]
    model.norm.weight                           [E]        decoder_norm/scale
    lm_head.weight                              [V, E]     logits_kernel            [E, V]
                                                           (absent when tied: logits_via_embedding)

Both sides rotate the two halves of each head's dimensions in RoPE (Hugging Face's
`rotate_half`), so q and k need no permutation: a head's rows keep their order. Every map is a
transpose and reshape, exact in any dtype; dtype conversion is the caller's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tensor:
    path: tuple[str, ...]  # in our canonical params tree
    hf_name: str
    shape: tuple[int, ...]  # ours
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


def llama_tensors(
    *,
    num_layers: int,
    emb_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    mlp_dim: int,
    vocab_size: int,
    tied: bool,
) -> list[Tensor]:
    """Every tensor of a Llama model, in Hugging Face's order (embedding, layers, norm, head)."""
    e, h, k, d, m, v = emb_dim, num_heads, num_kv_heads, head_dim, mlp_dim, vocab_size

    def projection(heads: int) -> tuple[Callable, Callable]:
        # [heads*D, E] <-> [E, heads, D]: row (head, j) of the PyTorch weight is column (head, j)
        return (lambda w: w.T.reshape(e, heads, d)), (lambda x: x.reshape(e, heads * d).T)

    q_in, q_out = projection(h)
    kv_in, kv_out = projection(k)
    embed = Tensor(("token_embedding",), "model.embed_tokens.weight", (v, e), (v, e), _same, _same)
    tensors = [embed]
    for i in range(num_layers):
        hf, ours = f"model.layers.{i}.", (f"layers_{i}",)
        attn = (*ours, "self_attention")
        tensors += [
            Tensor((*ours, "pre_attention_norm", "scale"), hf + "input_layernorm.weight",
                   (e,), (e,), _same, _same),
            Tensor((*attn, "query_kernel"), hf + "self_attn.q_proj.weight",
                   (e, h, d), (h * d, e), q_in, q_out),
            Tensor((*attn, "key_kernel"), hf + "self_attn.k_proj.weight",
                   (e, k, d), (k * d, e), kv_in, kv_out),
            Tensor((*attn, "value_kernel"), hf + "self_attn.v_proj.weight",
                   (e, k, d), (k * d, e), kv_in, kv_out),
            Tensor((*attn, "out_kernel"), hf + "self_attn.o_proj.weight", (h, d, e), (e, h * d),
                   lambda w: w.T.reshape(h, d, e), lambda x: x.reshape(h * d, e).T),
            Tensor((*ours, "pre_mlp_norm", "scale"), hf + "post_attention_layernorm.weight",
                   (e,), (e,), _same, _same),
            Tensor((*ours, "mlp", "wi_0"), hf + "mlp.gate_proj.weight",
                   (e, m), (m, e), _transpose, _transpose),
            Tensor((*ours, "mlp", "wi_1"), hf + "mlp.up_proj.weight",
                   (e, m), (m, e), _transpose, _transpose),
            Tensor((*ours, "mlp", "wo"), hf + "mlp.down_proj.weight",
                   (m, e), (e, m), _transpose, _transpose),
        ]  # fmt: skip
    tensors.append(Tensor(("decoder_norm", "scale"), "model.norm.weight", (e,), (e,), _same, _same))
    if not tied:
        tensors.append(
            Tensor(("logits_kernel",), "lm_head.weight", (e, v), (v, e), _transpose, _transpose)
        )
    return tensors


def tensors_for(config) -> list[Tensor]:
    """`llama_tensors` of a trainer `Config` (decoder_block=llama)."""
    return llama_tensors(
        num_layers=config.num_decoder_layers,
        emb_dim=config.emb_dim,
        num_heads=config.num_query_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        mlp_dim=config.mlp_dim,
        vocab_size=config.vocab_size,
        tied=config.logits_via_embedding,
    )
