"""Mistral (`decoder_block=mistral`): Llama's block with sliding-window attention on every layer
(`sliding_window_size` W: a query at position q attends the keys q - W < k <= q, W of them
including itself, as transformers 4.47.1's eager/SDPA mask does; its FlashAttention-2 path
attends W + 1) and a `head_dim` that may differ from hidden / heads (Mistral Nemo); Hugging Face's
`MistralForCausalLM`. `sliding_window: null` (v0.3, Nemo) is global attention."""

from __future__ import annotations

from MaxText.errors import ConfigError
from MaxText.model.family import Family, HfFormat, plain_except
from MaxText.model.llama import LLAMA_TENSORS


def _read(hf: dict, where: str) -> dict:
    window = hf.get("sliding_window") or 0
    if not isinstance(window, int) or window < 0:
        raise ConfigError(f"{where}: sliding_window={window!r} must be a positive integer or null")
    return {"sliding_window_size": window}


FAMILY = Family(
    name="mistral",
    doc="Mistral 7B v0.1 / v0.3, Nemo (MistralForCausalLM): Llama with a sliding window",
    window_pattern=(True,),
    hf=HfFormat(
        architecture="MistralForCausalLM",
        model_type="mistral",
        tensors=LLAMA_TENSORS,
        fixed=plain_except("sliding_window_size"),
        accepted={"hidden_act": (("silu", None), "Mistral's MLP is SwiGLU (silu)")},
        template={"hidden_act": "silu"},
        # MistralConfig's defaults (transformers 4.47.1), for fields a config.json leaves out
        defaults={"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "sliding_window": 4096},
        read=_read,
        write=lambda config: {"sliding_window": config.sliding_window_size or None},
    ),
)  # fmt: skip
