"""Mixtral (`decoder_block=mixtral`): Llama's attention (grouped-query, RoPE, global: Hugging
Face's `sliding_window: null`) with a mixture-of-experts feed-forward (`MaxText/model/moe.py`):
softmax over `num_experts` router logits, the top `num_experts_per_tok`, their weights divided
by their sum (`norm_topk_prob`, which Mixtral's format implies), SwiGLU experts
`moe_mlp_dim` wide; Hugging Face's `MixtralForCausalLM` (transformers 4.47.1's
`modeling_mixtral.py`).

Tensors: the router `block_sparse_moe.gate.weight` [E, hidden] is our `mlp/gate` [hidden, E];
expert j's `w1` (gate), `w3` (up) [ffn, hidden] and `w2` (down) [hidden, ffn] are slice j of our
stacked `mlp/wi_0`, `mlp/wi_1` [E, hidden, ffn] and `mlp/wo` [E, ffn, hidden]. `intermediate_size`
is the experts' width (`moe_mlp_dim`; `mlp_dim` is read equal to it)."""

from __future__ import annotations

from MaxText.model.family import COMMON_FIELDS, Family, HfFormat, TensorRow
from MaxText.model.llama import LLAMA_TENSORS
from MaxText.model.moe import MoeBlock

_LAYER = "model.layers.{i}."
_MOE = _LAYER + "block_sparse_moe."
MIXTRAL_MOE_TENSORS = (
    TensorRow("layers_{i}/mlp/gate", _MOE + "gate.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wi_0", _MOE + "experts.{j}.w1.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wo", _MOE + "experts.{j}.w2.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wi_1", _MOE + "experts.{j}.w3.weight", "transpose"),
)
# Llama's rows with the MoE block in place of the MLP's three kernels.
_TENSORS = LLAMA_TENSORS[:7] + MIXTRAL_MOE_TENSORS + LLAMA_TENSORS[10:]

FAMILY = Family(
    name="mixtral",
    feed_forward=MoeBlock,
    doc="Mixtral (MixtralForCausalLM): Llama attention, softmax top-k mixture of SwiGLU experts",
    hf=HfFormat(
        architecture="MixtralForCausalLM",
        model_type="mixtral",
        tensors=_TENSORS,
        fields={
            **{k: v for k, v in COMMON_FIELDS.items() if k != "mlp_dim"},
            "moe_mlp_dim": "intermediate_size",
            "num_experts": "num_local_experts",
            "num_experts_per_tok": "num_experts_per_tok",
        },
        fixed={"use_qk_norm": False, "norm_topk_prob": True},
        accepted={
            "sliding_window": ((None, 0), "Mixtral's released checkpoints attend globally "
                               "(sliding_window: null); windowed attention is not a model here"),
            "hidden_act": (("silu", None), "Mixtral's experts are SwiGLU (silu)"),
            "router_jitter_noise": ((0, 0.0, None), "router jitter (noise on the router's "
                                    "input while training) is not implemented"),
        },
        template={"hidden_act": "silu", "sliding_window": None, "output_router_logits": False,
                  "router_jitter_noise": 0.0},
    ),
)  # fmt: skip
