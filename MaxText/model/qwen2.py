"""Qwen 2 / 2.5 (`decoder_block=qwen2`; Hugging Face's name, MaxText has no such block): Llama's
block with biases on the q, k and v projections (`attention_bias=true`; none on o); small sizes
tie the embeddings; Hugging Face's `Qwen2ForCausalLM`.

`use_sliding_window: true` is refused: transformers 4.47.1's eager/SDPA mask would apply the
window to every layer while only its FlashAttention-2 path honours `max_window_layers`, and no
released Qwen 2.5 checkpoint turns it on. With it false, the `sliding_window` field released
configs carry (131072 or 32768, never below max_position_embeddings) changes nothing: the eager
mask's window is then no shorter than any sequence the model takes."""

from __future__ import annotations

from MaxText.model.family import Family, HfFormat, TensorRow, plain_except
from MaxText.model.llama import LLAMA_TENSORS

_LAYER = "model.layers.{i}."
BIAS_TENSORS = tuple(
    TensorRow(f"layers_{{i}}/self_attention/{ours}_bias", _LAYER + f"self_attn.{hf}_proj.bias",
              "heads_bias")
    for ours, hf in (("query", "q"), ("key", "k"), ("value", "v"))
)  # fmt: skip

FAMILY = Family(
    name="qwen2",
    doc="Qwen 2 / 2.5 (Qwen2ForCausalLM): Llama with q/k/v biases",
    hf=HfFormat(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        tensors=LLAMA_TENSORS[:5] + BIAS_TENSORS + LLAMA_TENSORS[5:],
        fixed=plain_except(attention_bias=True),
        accepted={
            "use_sliding_window": ((False, None), "transformers 4.47.1's eager/SDPA attention "
                                   "would window every layer while FlashAttention-2 windows only "
                                   "layers >= max_window_layers, and no released Qwen 2.5 uses it"),
            "hidden_act": (("silu", None), "Qwen 2's MLP is SwiGLU (silu)"),
        },
        template={"hidden_act": "silu", "use_sliding_window": False, "sliding_window": None},
        # Qwen2Config's defaults (transformers 4.47.1), for fields a config.json leaves out
        defaults={"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    ),
)  # fmt: skip
