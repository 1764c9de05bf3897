"""Hugging Face `config.json` <-> the trainer's model keys, for every family with a format.

`model_keys(hf)` picks the family by `architectures` (`MaxText/model/registry.py`), checks the
fields its format refuses (`HfFormat.accepted`, one line naming the field), and reads the keys:
the ones every family shares (below), then the family's own (`HfFormat.read`), then the keys its
format implies (`HfFormat.fixed`). `hf_config(config, ...)` writes them back: over the source's
config.json when the checkpoint was converted from one (every field kept, only the fields of
model keys that changed rewritten, `torch_dtype` the export dtype), else a fresh one.

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
from MaxText.model import COMMON_FIELDS, family_for_architecture, family_of, hf_architectures

TRANSFORMERS_VERSION = "4.47.1"  # what a freshly written config.json says it was made for

ROPE_SCALING_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_position_embeddings": "original_max_position_embeddings",
}
# Our key -> its config.json field, for the shared keys that are not copied one-to-one.
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


def hf_field(key: str, decoder_block: str = "llama") -> str:
    """The config.json field our model key `key` comes from (for messages)."""
    if key in ROPE_SCALING_KEYS:
        return f"rope_scaling.{ROPE_SCALING_KEYS[key]}"
    family_fields = family_of(decoder_block).hf.fields if family_of(decoder_block).hf else {}
    return COMMON_FIELDS.get(key) or _OTHER_FIELDS.get(key) or family_fields.get(key, key)


def _refuse(where: str, field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{where}: {field}={value!r} is not supported: {why}")


def _family(hf: dict[str, Any], where: str):
    """The family of a config.json: by `architectures`, else by `model_type` (old files)."""
    known = hf_architectures()
    arch = hf.get("architectures")
    if not arch:
        model_type = hf.get("model_type", "llama")
        arch = [a for a in known if family_for_architecture(a).hf.model_type == model_type][:1]
    family = family_for_architecture(arch[0]) if len(arch) == 1 else None
    model_type = hf.get("model_type", family.hf.model_type if family else None)
    if family is not None and model_type != family.hf.model_type:
        raise ConfigError(
            f"{where}: model_type={model_type!r} does not match architectures={arch!r} (model_type "
            f"{family.hf.model_type!r}); the file is inconsistent: fix model_type or architectures"
        )
    if family is None:
        names = ", ".join(f"{a} (model_type {family_for_architecture(a).hf.model_type})"
                          for a in known)  # fmt: skip
        raise _refuse(where, "architectures", hf.get("architectures"), f"only {names} convert"
                      if len(known) > 1 else f"only {names} converts")  # fmt: skip
    return family


def _rope_keys(hf: dict[str, Any], where: str) -> dict[str, Any]:
    scaling = hf.get("rope_scaling")
    if not scaling:
        return {"rope_type": "default"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise _refuse(
            where, "rope_scaling.rope_type", kind, "only Llama 3's (rope_type: llama3) scaling"
        )
    absent = [f for f in ROPE_SCALING_KEYS.values() if f not in scaling]
    if absent:
        raise ConfigError(f"{where}: rope_scaling lacks {', '.join(absent)}")
    keys: dict[str, Any] = {"rope_type": "llama3.1"}
    for ours, field in ROPE_SCALING_KEYS.items():
        keys[ours] = (int if ours.endswith("embeddings") else float)(scaling[field])
    return keys


def model_keys(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our model keys from a Hugging Face config.json dict (see the module docstring)."""
    family = _family(hf, where)
    fmt = family.hf
    for field, (allowed, why) in fmt.accepted.items():
        if hf.get(field, fmt.defaults.get(field)) not in allowed:
            raise _refuse(where, field, hf.get(field, fmt.defaults.get(field)), why)
    missing = [f for f in COMMON_FIELDS.values() if f not in hf]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; is it a {fmt.architecture}?")
    keys: dict[str, Any] = {ours: int(hf[field]) for ours, field in COMMON_FIELDS.items()}
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
    keys["decoder_block"] = family.name

    def get(field: str, fallback: Any) -> Any:  # an absent field means the family's default
        return hf[field] if field in hf else fmt.defaults.get(field, fallback)

    keys["normalization_layer_epsilon"] = float(get("rms_norm_eps", 1e-6))
    keys["rope_max_timescale"] = float(get("rope_theta", 10000.0))
    keys["logits_via_embedding"] = bool(get("tie_word_embeddings", False))
    keys.update(_rope_keys(hf, where))
    keys.update(fmt.fixed)
    for ours, field in fmt.fields.items():
        if ours not in COMMON_FIELDS:
            keys[ours] = get(field, None)
    if fmt.read is not None:
        keys.update(fmt.read({**fmt.defaults, **hf}, where))
    return keys


def owned_fields(config: Any) -> dict[str, Any]:
    """The config.json fields our model keys determine, with `config`'s values."""
    c = config
    fmt = family_of(c).hf
    scaling = None
    if c.rope_type == "llama3.1":
        scaling = {"rope_type": "llama3"}
        scaling.update({field: getattr(c, ours) for ours, field in ROPE_SCALING_KEYS.items()})
    out = {field: getattr(c, ours) for ours, field in fmt.fields.items()}
    out.update({
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.normalization_layer_epsilon,
        "rope_theta": c.rope_max_timescale,
        "rope_scaling": scaling,
        "tie_word_embeddings": c.logits_via_embedding,
    })  # fmt: skip
    if fmt.write is not None:
        out.update(fmt.write(c))
    return out


def check_exportable(config: Any) -> None:
    """Refuses (one line) a config its family's format cannot express: the keys the format
    fixes (`HfFormat.fixed`) at other values."""
    family = family_of(config)
    if family.hf is None:
        raise ConfigError(
            f"decoder_block={family.name} has no Hugging Face format; to_huggingface writes "
            f"{', '.join(hf_architectures())}"
        )
    for key, value in family.hf.fixed.items():
        if getattr(config, key) != value:
            raise ConfigError(
                f"{key}={getattr(config, key)!r} cannot be written as {family.hf.architecture}, "
                f"which implies {key}={value!r}"
            )


def _fresh(config: Any) -> dict[str, Any]:
    c = config
    fmt = family_of(c).hf
    max_positions = c.max_target_length
    if c.rope_type == "llama3.1":
        max_positions = int(c.rope_original_max_position_embeddings * c.rope_scaling_factor)
    out = {"architectures": [fmt.architecture], "model_type": fmt.model_type}
    out.update(fmt.template)
    out.update(owned_fields(c))
    out.update({
        "max_position_embeddings": max(max_positions, c.max_target_length),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    })  # fmt: skip
    return out


def hf_config(
    config: Any,
    dtype: str,
    bos_id: int = -1,
    eos_id: int = -1,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config.json of `config` with weights in `dtype`.

    With `source` (the config.json the checkpoint was converted from): that file, with the
    fields of the model keys that differ from it rewritten and `torch_dtype` set; its token ids
    are kept. Without: a fresh config.json (token ids from the tokenizer when known)."""
    if source is not None:
        out = dict(source)
        ours = model_keys(source)
        if any(getattr(config, k) != v for k, v in ours.items()):
            for field, value in owned_fields(config).items():
                if out.get(field) != value:
                    out[field] = value
        out["torch_dtype"] = DTYPE_NAMES[dtype]
        return out
    out = _fresh(config)
    out["torch_dtype"] = DTYPE_NAMES[dtype]
    out["transformers_version"] = TRANSFORMERS_VERSION
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
