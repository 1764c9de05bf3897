"""Gemma 2 (`decoder_block=gemma2`): embeddings x sqrt(hidden) (in the activation dtype), RMSNorm
multiplying by (1 + w), four norms per layer (pre- and post-attention, pre- and post-MLP:
`use_post_attn_norm`, `use_post_ffw_norm`), GeGLU with tanh-approximated GELU
(`mlp_activations=[gelu, linear]`), attention scale `query_pre_attn_scalar ** -0.5`,
attention-logit and final-logit soft-capping, layer i local (`sliding_window_size`) iff i is
even, tied embeddings; Hugging Face's `Gemma2ForCausalLM` (transformers 4.47.1's modeling file).

Hugging Face's `post_attention_layernorm` is Gemma 2's norm *after* attention (Llama's is the
pre-MLP norm); `pre_feedforward_layernorm` is the pre-MLP one."""

from __future__ import annotations

from MaxText.model.family import Family, HfFormat, TensorRow, plain_except
from MaxText.model.llama import LLAMA_TENSORS

_LAYER = "model.layers.{i}."
_TENSORS = (
    *LLAMA_TENSORS[:6],  # embedding, input_layernorm, q, k, v, o
    TensorRow("layers_{i}/post_attention_norm/scale", _LAYER + "post_attention_layernorm.weight",
              "same"),
    TensorRow("layers_{i}/pre_mlp_norm/scale", _LAYER + "pre_feedforward_layernorm.weight",
              "same"),
    *LLAMA_TENSORS[7:10],  # gate, up, down
    TensorRow("layers_{i}/post_mlp_norm/scale", _LAYER + "post_feedforward_layernorm.weight",
              "same"),
    *LLAMA_TENSORS[10:],  # final norm, head (absent: tied)
)  # fmt: skip
_GELU = ("gelu_pytorch_tanh", None)
_CAPS = {"attn_logits_soft_cap": "attn_logit_softcapping",
         "final_logits_soft_cap": "final_logit_softcapping"}  # fmt: skip


def _read(hf: dict, where: str) -> dict:
    keys = {ours: float(hf.get(field) or 0.0) for ours, field in _CAPS.items()}
    keys["sliding_window_size"] = int(hf.get("sliding_window") or 0)
    keys["query_pre_attn_scalar"] = float(hf["query_pre_attn_scalar"])
    return keys


def _write(config) -> dict:
    out = {field: getattr(config, ours) or None for ours, field in _CAPS.items()}
    out["sliding_window"] = config.sliding_window_size or None
    out["query_pre_attn_scalar"] = config.query_pre_attn_scalar or config.head_dim
    return out


FAMILY = Family(
    name="gemma2",
    doc="Gemma 2 (Gemma2ForCausalLM): (1 + w) norms, GeGLU, local/global layers, soft-caps",
    norm_scale_offset=1.0,
    scale_embedding=True,
    window_pattern=(True, False),
    hf=HfFormat(
        architecture="Gemma2ForCausalLM",
        model_type="gemma2",
        tensors=_TENSORS,
        fixed=plain_except(*_CAPS, "sliding_window_size", "query_pre_attn_scalar",
                           mlp_activations=("gelu", "linear"), use_post_attn_norm=True,
                           use_post_ffw_norm=True),
        accepted={
            "hidden_activation": (_GELU, "Gemma 2's MLP is GeGLU with tanh-approximated GELU"),
            "hidden_act": (_GELU, "Gemma 2's MLP is GeGLU with tanh-approximated GELU"),
            "attention_bias": ((False, None), "Gemma 2's projections have no biases"),
        },
        template={"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                  "attention_bias": False, "cache_implementation": "hybrid"},
        # Gemma2Config's defaults (transformers 4.47.1), for fields a config.json leaves out
        defaults={"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "query_pre_attn_scalar": 256, "sliding_window": 4096,
                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        read=_read,
        write=_write,
    ),
)  # fmt: skip
