"""Qwen 3 (`decoder_block=qwen3`): Llama's block with an RMSNorm over each head of q and of k
before RoPE (`use_qk_norm=true`, Hugging Face's `q_norm` / `k_norm`, over `head_dim`), an
explicit `head_dim`, no projection biases; Hugging Face's `Qwen3ForCausalLM` (modeling file read
at transformers commit 9ee3f431c32e9e5f6c0888f6b2b0ca3f6c289dd6; 4.47.1 has no Qwen 3).

Refused on import: `attention_bias: true` (Qwen 3's flag adds biases to q, k, v and o) and
`use_sliding_window: true` (no released Qwen 3 checkpoint turns it on)."""

from __future__ import annotations

from MaxText.model.family import Family, HfFormat, TensorRow, plain_except
from MaxText.model.llama import LLAMA_TENSORS

_LAYER = "model.layers.{i}."
QK_NORM_TENSORS = (
    TensorRow("layers_{i}/self_attention/query_norm/scale", _LAYER + "self_attn.q_norm.weight",
              "same"),
    TensorRow("layers_{i}/self_attention/key_norm/scale", _LAYER + "self_attn.k_norm.weight",
              "same"),
)  # fmt: skip
# Llama's rows with the two norms after the key projection (the order of Hugging Face's files).
QWEN3_TENSORS = LLAMA_TENSORS[:4] + QK_NORM_TENSORS + LLAMA_TENSORS[4:]
# Qwen 3's attention in config.json, shared with Qwen3-MoE (`qwen3_moe.py`): the fields this
# model refuses (one line each) and the values it writes.
QWEN3_ATTENTION_ACCEPTED = {
    "attention_bias": ((False, None), "Qwen 3's attention_bias adds biases to q, k, v "
                       "and o, which no released checkpoint has and this model does not"),
    "use_sliding_window": ((False, None), "sliding-window Qwen 3 is not a model here "
                           "(no released checkpoint uses it)"),
}  # fmt: skip
QWEN3_ATTENTION_TEMPLATE = {"attention_bias": False, "use_sliding_window": False,
                            "sliding_window": None}  # fmt: skip

FAMILY = Family(
    name="qwen3",
    doc="Qwen 3 (Qwen3ForCausalLM): Llama with q/k RMSNorm per head",
    hf=HfFormat(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        tensors=QWEN3_TENSORS,
        fixed=plain_except(use_qk_norm=True),
        defaults={"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
        accepted={
            **QWEN3_ATTENTION_ACCEPTED,
            "hidden_act": (("silu", None), "Qwen 3's MLP is SwiGLU (silu)"),
        },
        template={"hidden_act": "silu", **QWEN3_ATTENTION_TEMPLATE},
    ),
)  # fmt: skip
