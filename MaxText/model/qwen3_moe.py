"""Qwen3-MoE (`decoder_block=qwen3_moe`): Qwen 3's attention (q/k RMSNorm per head before RoPE,
explicit `head_dim`, no biases) with a mixture-of-experts feed-forward in every layer
(`MaxText/model/moe.py`): softmax over `num_experts` router logits, the top
`num_experts_per_tok`, divided by their sum when `norm_topk_prob`, SwiGLU experts
`moe_intermediate_size` wide; Hugging Face's `Qwen3MoeForCausalLM` (modeling file read at
transformers commit 9ee3f431c32e9e5f6c0888f6b2b0ca3f6c289dd6; 4.47.1 has no Qwen3-MoE).

Refused on import, one line each: `mlp_only_layers` not empty or `decoder_sparse_step` not 1
(dense MLP layers among the MoE ones: every layer here is a MoE layer), and Qwen 3's refusals
(`attention_bias`, `use_sliding_window`). `intermediate_size` (the width of those dense layers)
is kept as `mlp_dim`, unused by the model, so config.json round-trips."""

from __future__ import annotations

from MaxText.model.family import COMMON_FIELDS, Family, HfFormat, TensorRow, plain_except
from MaxText.model.moe import MoeBlock
from MaxText.model.qwen3 import QWEN3_ATTENTION_ACCEPTED, QWEN3_ATTENTION_TEMPLATE, QWEN3_TENSORS

_LAYER = "model.layers.{i}."
QWEN3_MOE_TENSORS = (
    TensorRow("layers_{i}/mlp/gate", _LAYER + "mlp.gate.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wi_0", _LAYER + "mlp.experts.{j}.gate_proj.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wi_1", _LAYER + "mlp.experts.{j}.up_proj.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wo", _LAYER + "mlp.experts.{j}.down_proj.weight", "transpose"),
)
_MLP = [r for r in QWEN3_TENSORS if "/mlp/" in r.ours]
_AT = QWEN3_TENSORS.index(_MLP[0])
_TENSORS = QWEN3_TENSORS[:_AT] + QWEN3_MOE_TENSORS + QWEN3_TENSORS[_AT + len(_MLP) :]

FAMILY = Family(
    name="qwen3_moe",
    feed_forward=MoeBlock,
    doc="Qwen3-MoE (Qwen3MoeForCausalLM): Qwen 3 attention, softmax top-k SwiGLU experts",
    hf=HfFormat(
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        tensors=_TENSORS,
        fields={
            **COMMON_FIELDS,
            "moe_mlp_dim": "moe_intermediate_size",
            "num_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_tok",
            "norm_topk_prob": "norm_topk_prob",
        },
        fixed=plain_except(use_qk_norm=True),
        accepted={
            "mlp_only_layers": (([], None), "every layer is a mixture of experts here; "
                                "mlp_only_layers lists dense-MLP layers, which this model lacks"),
            "decoder_sparse_step": ((1, None), "every layer is a mixture of experts here; "
                                    "decoder_sparse_step > 1 makes the others dense MLPs"),
            **QWEN3_ATTENTION_ACCEPTED,
            "hidden_act": (("silu", None), "Qwen3-MoE's experts are SwiGLU (silu)"),
        },
        template={"hidden_act": "silu", **QWEN3_ATTENTION_TEMPLATE, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "output_router_logits": False},
        # Qwen3MoeConfig's defaults (transformers, the commit above)
        defaults={"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "norm_topk_prob": False, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768},
        write=lambda c: {"max_window_layers": c.num_decoder_layers},
    ),
)  # fmt: skip
