"""Llama (`decoder_block=llama`; MaxText's `llama2` is another name of it): RMSNorm, RoPE
(optionally Llama 3.1's frequency scaling), grouped-query attention, SwiGLU; Hugging Face's
`LlamaForCausalLM`.

The tensor table below is also the one every Llama-like family starts from (`LLAMA_TENSORS`):
Mistral's and Qwen's checkpoints use the same names."""

from __future__ import annotations

from MaxText.model.family import Family, HfFormat, TensorRow, plain_except

_LAYER = "model.layers.{i}."
# Our canonical path <-> Hugging Face name, and the layout change (MaxText/convert/layout.py).
LLAMA_TENSORS = (
    TensorRow("token_embedding", "model.embed_tokens.weight", "same"),
    TensorRow("layers_{i}/pre_attention_norm/scale", _LAYER + "input_layernorm.weight", "same"),
    TensorRow("layers_{i}/self_attention/query_kernel", _LAYER + "self_attn.q_proj.weight",
              "heads_in"),
    TensorRow("layers_{i}/self_attention/key_kernel", _LAYER + "self_attn.k_proj.weight",
              "heads_in"),
    TensorRow("layers_{i}/self_attention/value_kernel", _LAYER + "self_attn.v_proj.weight",
              "heads_in"),
    TensorRow("layers_{i}/self_attention/out_kernel", _LAYER + "self_attn.o_proj.weight",
              "heads_out"),
    TensorRow("layers_{i}/pre_mlp_norm/scale", _LAYER + "post_attention_layernorm.weight", "same"),
    TensorRow("layers_{i}/mlp/wi_0", _LAYER + "mlp.gate_proj.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wi_1", _LAYER + "mlp.up_proj.weight", "transpose"),
    TensorRow("layers_{i}/mlp/wo", _LAYER + "mlp.down_proj.weight", "transpose"),
    TensorRow("decoder_norm/scale", "model.norm.weight", "same"),
    TensorRow("logits_kernel", "lm_head.weight", "transpose"),  # absent when tied
)  # fmt: skip

FAMILY = Family(
    name="llama",
    doc="Llama 2 / 3 / 3.1 (LlamaForCausalLM)",
    hf=HfFormat(
        architecture="LlamaForCausalLM",
        model_type="llama",
        tensors=LLAMA_TENSORS,
        fixed=plain_except(),
        defaults={"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
        accepted={
            "attention_bias": ((False, None), "LlamaForCausalLM with projection biases (q, k, "
                               "v and o) is not a model here; Qwen 2's q/k/v biases are "
                               "decoder_block=qwen2"),
            "mlp_bias": ((False, None), "the MLP has no biases here"),
            "hidden_act": (("silu", None), "Llama's MLP is SwiGLU (silu)"),
            "sliding_window": ((None, 0), "Llama attends globally; a sliding window is Mistral"),
        },
        template={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    ),
)  # fmt: skip
