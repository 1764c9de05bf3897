"""Mixtral (`decoder_block=mixtral`): Mistral's attention (grouped-query, RoPE, a sliding window
`sliding_window_size` on every layer when config.json sets `sliding_window`; the released
checkpoints set null: global) with a mixture-of-experts feed-forward (`MaxText/model/moe.py`):
softmax over `num_experts` router logits, the top `num_experts_per_tok`, their weights divided
by their sum (`norm_topk_prob`, which Mixtral's format implies), SwiGLU experts
`moe_mlp_dim` wide; Hugging Face's `MixtralForCausalLM` (transformers 4.47.1's
`modeling_mixtral.py`).

Tensors: the router `block_sparse_moe.gate.weight` [E, hidden] is our `mlp/gate` [hidden, E];
expert j's `w1` (gate), `w3` (up) [ffn, hidden] and `w2` (down) [hidden, ffn] are slice j of our
stacked `mlp/wi_0`, `mlp/wi_1` [E, hidden, ffn] and `mlp/wo` [E, ffn, hidden]. `intermediate_size`
is the experts' width (`moe_mlp_dim`; `mlp_dim` is read equal to it)."""

from __future__ import annotations

from MaxText.model import mistral
from MaxText.model.family import COMMON_FIELDS, Family, HfFormat, TensorRow, plain_except
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
    window_pattern=(True,),
    doc="Mixtral (MixtralForCausalLM): Mistral attention, softmax top-k mixture of SwiGLU experts",
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
        fixed=plain_except("sliding_window_size", norm_topk_prob=True),
        accepted={
            "hidden_act": (("silu", None), "Mixtral's experts are SwiGLU (silu)"),
            "router_jitter_noise": ((0, 0.0, None), "router jitter (noise on the router's "
                                    "input while training) is not implemented"),
        },
        template={"hidden_act": "silu", "output_router_logits": False,
                  "router_jitter_noise": 0.0},
        # MixtralConfig's defaults (transformers 4.47.1), for fields a config.json leaves out
        defaults={"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                  "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
        read=mistral.FAMILY.hf.read,
        write=mistral.FAMILY.hf.write,
    ),
)  # fmt: skip
