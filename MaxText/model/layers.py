"""One decoder layer (the residual block every family runs) and its rematerialisation.

`DecoderLayer`: x + attn(norm(x)), then + ffn(norm(.)); the norms, the attention block's options
and the feed-forward block come from the config's family (`registry.family_of`). `layer_class`
wraps it in `nn.remat` with the stage's policy. Shape suffixes: B batch, L length, E embed.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from MaxText.config import Config
from MaxText.model.params import dtype_of
from MaxText.model.registry import family_of
from MaxText.model.self_attention import Attention

__all__ = ["DecoderLayer", "ScannedDecoderLayer", "dtype_of", "layer_class", "norm_for"]


def norm_for(config: Config, name: str) -> nn.Module:
    """A norm of the config's family (every norm of a model is of one kind)."""
    family = family_of(config)
    kw = {"scale_offset": family.norm_scale_offset} if family.norm_scale_offset else {}
    return family.norm(
        epsilon=config.normalization_layer_epsilon,
        dtype=dtype_of(config.dtype),
        weight_dtype=dtype_of(config.weight_dtype),
        name=name,
        **kw,
    )


QKV = frozenset({"query", "key", "value"})


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.)); with
    `use_post_attn_norm` / `use_post_ffw_norm` (Gemma 2) the attention / MLP output is normed
    again before its residual add. `window`: this layer's attention window (0: global), or the
    `layer_window` argument (a scanned layer's per-layer input, traced).
    With a KV `cache` (decoding, see `Attention`) it returns (output, updated cache)."""

    config: Config
    window: int = 0

    @nn.compact
    def __call__(self, x_BxLxE, positions_BxL, segment_ids_BxL=None, cache=None, layer_window=None):
        c = self.config
        family = family_of(c)
        attention = Attention(
            c,
            biases=family.fixed_biases | (QKV if c.attention_bias else frozenset()),
            rope=family.rope,
            norm_scale_offset=family.norm_scale_offset,
            windows=tuple(sorted(set(family.layer_windows(c)))),
            name="self_attention",
        )
        window = self.window if layer_window is None else layer_window
        h = attention(norm_for(c, "pre_attention_norm")(x_BxLxE), positions_BxL,
                      segment_ids_BxL, cache, window)  # fmt: skip
        if cache is not None:
            h, cache = h
        if c.use_post_attn_norm:
            h = norm_for(c, "post_attention_norm")(h)
        x_BxLxE = x_BxLxE + h
        h = family.feed_forward(c, name="mlp")(norm_for(c, "pre_mlp_norm")(x_BxLxE))
        if c.use_post_ffw_norm:
            h = norm_for(c, "post_mlp_norm")(h)
        return x_BxLxE + h if cache is None else (x_BxLxE + h, cache)


class ScannedDecoderLayer(DecoderLayer):
    """`DecoderLayer` with the (carry, output) signature `nn.scan` expects; `layer_window` is
    the scanned per-layer window when the model's layers differ."""

    @nn.compact
    def __call__(self, x_BxLxE, positions_BxL, segment_ids_BxL=None, layer_window=None):
        out = super().__call__(x_BxLxE, positions_BxL, segment_ids_BxL, None, layer_window)
        return out, None


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
