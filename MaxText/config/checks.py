"""Checks of the config blocks that derive nothing: data keys, attention kernel, profiler.

Each `validate_*(values)` raises a `ConfigError` naming the key and the fix; `MaxText.config`
calls them while it validates the raw values.
"""

from __future__ import annotations

import difflib
from typing import Any

from MaxText.errors import ConfigError

# ------------------------------------------------------- attention kernel and profiler keys

ATTENTION_KERNELS = ("dot_product", "autoselected", "cudnn_flash", "chunked")
PROFILERS = ("", "xplane")


def validate_attention_and_profiler(v: dict[str, Any]) -> None:
    """`attention`, `attention_block_size`, `profiler`, `profiler_steps`,
    `skip_first_n_steps_for_profiler`; cudnn_flash's dtype and packed rows (whether it has a GPU:
    `devices.setup`)."""
    if v["attention"] not in ATTENTION_KERNELS:
        match = difflib.get_close_matches(v["attention"], ATTENTION_KERNELS, n=1, cutoff=0.5)
        hint = f"; did you mean '{match[0]}'?" if match else ""
        raise ConfigError(
            f"attention={v['attention']} is not one of {' | '.join(ATTENTION_KERNELS)}{hint}"
        )
    if v["attention_block_size"] < 1:
        raise ConfigError(f"attention_block_size={v['attention_block_size']}: must be >= 1")
    if v["attention"] == "cudnn_flash" and v["dtype"] == "float32":
        raise ConfigError(
            "attention=cudnn_flash needs dtype=bfloat16 or float16 (cuDNN flash attention has no "
            "float32 kernel); set dtype=bfloat16, or keep float32 with attention=chunked"
        )
    if v["attention"] == "cudnn_flash" and v["dataset_type"] == "grain" and v["packing"]:
        raise ConfigError(
            "attention=cudnn_flash cannot keep packed documents apart (JAX's public API has no "
            "segment ids for it; a [L, L] mask would become a dense bias); use attention=chunked "
            "with packing, or packing=false"
        )
    if v["profiler"] == "nsys":
        raise ConfigError(
            "profiler=nsys is not supported here: run train.py under `nsys profile` yourself, "
            "or use profiler=xplane"
        )
    if v["profiler"] not in PROFILERS:
        raise ConfigError(f"profiler={v['profiler']} is not one of '' (off) | xplane")
    if v["profiler_steps"] < 1:
        raise ConfigError(f"profiler_steps={v['profiler_steps']}: must be >= 1")
    if v["skip_first_n_steps_for_profiler"] < 0:
        raise ConfigError(
            f"skip_first_n_steps_for_profiler={v['skip_first_n_steps_for_profiler']}: must be >= 0"
        )


# ------------------------------------------------------------------------------------ data keys

# MaxText's tokenizer_type values this trainer does not read, with the reason.
UNSUPPORTED_TOKENIZER_TYPES = {
    "tiktoken": "read Llama 3's tokenizer.json with tokenizer_type=huggingface instead",
}
TOKENIZER_TYPES = ("sentencepiece", "huggingface")


def validate_data(v: dict[str, Any]) -> None:
    """The data block's checks (dataset_type is checked with the other choices)."""
    if v["tokenizer_type"] in UNSUPPORTED_TOKENIZER_TYPES:
        raise ConfigError(
            f"tokenizer_type={v['tokenizer_type']} is not supported here: "
            f"{UNSUPPORTED_TOKENIZER_TYPES[v['tokenizer_type']]}"
        )
    if v["tokenizer_type"] not in TOKENIZER_TYPES:
        raise ConfigError(
            f"tokenizer_type={v['tokenizer_type']} is not one of {' | '.join(TOKENIZER_TYPES)}"
        )
    if v["tokenizer_type"] == "huggingface" and not v["tokenizer_path"]:
        raise ConfigError(
            "tokenizer_type=huggingface needs tokenizer_path= (a tokenizer.json file, or the "
            "Hugging Face folder holding it)"
        )
    if v["grain_worker_count"] < 0:
        raise ConfigError(f"grain_worker_count={v['grain_worker_count']}: must be >= 0")
    if v["dataset_type"] == "grain" and not v["grain_train_files"]:
        raise ConfigError(
            "dataset_type=grain needs grain_train_files= (a glob of *.array_record shards written "
            "by python -m MaxText.data.prepare)"
        )
    if v["dataset_type"] == "grain" and v["eval_interval"] > 0 and not v["grain_eval_files"]:
        raise ConfigError(
            f"eval_interval={v['eval_interval']} needs held-out data: set grain_eval_files= (e.g. "
            "the eval-*.array_record of prepare --eval_fraction) or eval_interval=0"
        )
    if not v["train_split"]:
        raise ConfigError("train_split= must name a split (MaxText's default: train)")
    if not v["packing"] and v["dataset_type"] in ("text", "tfds"):
        raise ConfigError(
            f"packing=false is not supported with dataset_type={v['dataset_type']}, which "
            "concatenates documents into windows; use dataset_type=grain for one document per row"
        )


# ------------------------------------------------------------------------------------- RoPE keys


def validate_rope(v: dict[str, Any]) -> None:
    """`rope_max_timescale` and the llama3.1 scaling keys (used only with rope_type=llama3.1)."""
    if v["rope_max_timescale"] <= 1:
        raise ConfigError(f"rope_max_timescale={v['rope_max_timescale']}: must be > 1")
    if v["rope_type"] != "llama3.1":
        return
    if v["rope_scaling_factor"] < 1:
        raise ConfigError(f"rope_scaling_factor={v['rope_scaling_factor']}: must be >= 1")
    if not 0 < v["rope_low_freq_factor"] < v["rope_high_freq_factor"]:
        raise ConfigError(
            f"rope_low_freq_factor={v['rope_low_freq_factor']} and rope_high_freq_factor="
            f"{v['rope_high_freq_factor']}: need 0 < low < high"
        )
    if v["rope_original_max_position_embeddings"] < 1:
        raise ConfigError(
            f"rope_original_max_position_embeddings={v['rope_original_max_position_embeddings']}"
            ": must be >= 1"
        )
