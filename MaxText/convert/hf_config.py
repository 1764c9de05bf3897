"""Hugging Face `config.json` (LlamaForCausalLM) <-> the trainer's model keys.

`model_keys(hf)` reads a config.json dict into our keys, refusing (one line, naming the field) what
the model cannot represent: another architecture, a sliding window, attention or MLP biases, an
activation other than silu, a `rope_scaling` other than Llama 3's. `hf_config(config)` writes our
keys back as a config.json dict, and `generation_config` the small generation_config.json.

    hidden_size -> emb_dim                intermediate_size -> mlp_dim
    num_hidden_layers -> num_decoder_layers   num_attention_heads -> num_query_heads
    num_key_value_heads -> num_kv_heads   head_dim (or hidden_size / heads) -> head_dim
    vocab_size -> vocab_size              rms_norm_eps -> normalization_layer_epsilon
    rope_theta -> rope_max_timescale      tie_word_embeddings -> logits_via_embedding
    rope_scaling {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
                  original_max_position_embeddings} -> rope_type=llama3.1, rope_scaling_factor, ...
"""

from __future__ import annotations

from typing import Any

from MaxText.errors import ConfigError

ARCHITECTURE = "LlamaForCausalLM"
TRANSFORMERS_VERSION = "4.47.1"  # what the written config.json says it was made for

# Our key -> the config.json field it comes from (the fields every Llama config has).
FIELDS = {
    "emb_dim": "hidden_size",
    "mlp_dim": "intermediate_size",
    "num_decoder_layers": "num_hidden_layers",
    "num_query_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
}
ROPE_SCALING_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_position_embeddings": "original_max_position_embeddings",
}
_OTHER_FIELDS = {
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "decoder_block": "architectures",
    "normalization_layer_epsilon": "rms_norm_eps",
    "rope_max_timescale": "rope_theta",
    "logits_via_embedding": "tie_word_embeddings",
    "rope_type": "rope_scaling",
}
DTYPE_NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


def hf_field(key: str) -> str:
    """The config.json field our model key `key` comes from."""
    if key in ROPE_SCALING_KEYS:
        return f"rope_scaling.{ROPE_SCALING_KEYS[key]}"
    return FIELDS.get(key) or _OTHER_FIELDS[key]


def _refuse(where: str, field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{where}: {field}={value!r} is not supported: {why}")


def model_keys(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our model keys from a Hugging Face config.json dict (see the module docstring)."""
    arch = hf.get("architectures") or [ARCHITECTURE]
    if arch != [ARCHITECTURE] or hf.get("model_type", "llama") != "llama":
        raise _refuse(
            where, "architectures", arch, f"only {ARCHITECTURE} (model_type llama) converts"
        )
    if hf.get("sliding_window") not in (None, 0):
        raise _refuse(where, "sliding_window", hf["sliding_window"], "global attention only")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _refuse(where, field, hf[field], "the llama block has no projection biases")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(where, "hidden_act", act, "the llama block's MLP is SwiGLU (silu)")
    missing = [f for f in FIELDS.values() if f not in hf]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; is it a Llama config?")
    keys: dict[str, Any] = {ours: int(hf[field]) for ours, field in FIELDS.items()}
    heads = keys["num_query_heads"]
    keys["num_kv_heads"] = int(hf.get("num_key_value_heads") or heads)
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if keys["emb_dim"] % heads:
            raise ConfigError(
                f"{where}: hidden_size={keys['emb_dim']} is not divisible by "
                f"num_attention_heads={heads} and head_dim is not given"
            )
        head_dim = keys["emb_dim"] // heads
    keys["head_dim"] = int(head_dim)
    keys["decoder_block"] = "llama"
    keys["normalization_layer_epsilon"] = float(hf.get("rms_norm_eps", 1e-6))
    keys["rope_max_timescale"] = float(hf.get("rope_theta", 10000.0))
    keys["logits_via_embedding"] = bool(hf.get("tie_word_embeddings", False))
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise _refuse(
                where, "rope_scaling.rope_type", kind, "only Llama 3's (rope_type: llama3) scaling"
            )
        absent = [f for f in ROPE_SCALING_KEYS.values() if f not in scaling]
        if absent:
            raise ConfigError(f"{where}: rope_scaling lacks {', '.join(absent)}")
        keys["rope_type"] = "llama3.1"
        for ours, field in ROPE_SCALING_KEYS.items():
            kind_of = int if ours.endswith("embeddings") else float
            keys[ours] = kind_of(scaling[field])
    else:
        keys["rope_type"] = "default"
    return keys


def hf_config(config: Any, dtype: str, bos_id: int = -1, eos_id: int = -1) -> dict[str, Any]:
    """The config.json of our `config` (decoder_block=llama) with weights in `dtype`."""
    c = config
    if c.rope_type == "llama3.1":
        scaling = {"rope_type": "llama3"}
        scaling.update({field: getattr(c, ours) for ours, field in ROPE_SCALING_KEYS.items()})
        max_positions = int(c.rope_original_max_position_embeddings * c.rope_scaling_factor)
    else:
        scaling = None
        max_positions = c.max_target_length
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.emb_dim,
        "intermediate_size": c.mlp_dim,
        "num_hidden_layers": c.num_decoder_layers,
        "num_attention_heads": c.num_query_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max(max_positions, c.max_target_length),
        "rms_norm_eps": c.normalization_layer_epsilon,
        "rope_theta": c.rope_max_timescale,
        "rope_scaling": scaling,
        "tie_word_embeddings": c.logits_via_embedding,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
        "transformers_version": TRANSFORMERS_VERSION,
    }
    if bos_id >= 0:
        out["bos_token_id"] = bos_id
    if eos_id >= 0:
        out["eos_token_id"] = eos_id
    return out


def generation_config(bos_id: int = -1, eos_id: int = -1) -> dict[str, Any]:
    """generation_config.json: the special token ids (when known) and greedy decoding."""
    out: dict[str, Any] = {"_from_model_config": True, "do_sample": False}
    if bos_id >= 0:
        out["bos_token_id"] = bos_id
    if eos_id >= 0:
        out["eos_token_id"] = eos_id
    out["transformers_version"] = TRANSFORMERS_VERSION
    return out
