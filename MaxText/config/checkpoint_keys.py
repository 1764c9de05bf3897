"""Model keys saved with a checkpoint: the config layer of `load_parameters_path`.

A checkpoint (a training run's step, or a parameters-only checkpoint written by
`MaxText.to_maxtext`) stores the config that wrote it as JSON in `<step>/config/metadata`. When
`load_parameters_path` names one, `load_config` takes the keys below from it, between the YAML
files and the command line (command line > checkpoint > configs/base.yml and the preset), so
`load_parameters_path=OUT/0/items` alone describes the model. The file is read directly (no
orbax): the config package sits below the checkpoint package.

`require_tokenizer(config)`: a converted checkpoint that records no tokenizer is refused by the
tools that would otherwise train a new tokenizer on the corpus for it (`train.py`, `generate`),
asking for `tokenizer_path=`.

Forms of `load_parameters_path` (newest step first when a folder holds several):
`<root>/<step>/items` | `<root>/<step>` | `<root>` (parameters-only, MaxText's layout), a run
folder, its `checkpoints` folder, one step's folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from MaxText.errors import ConfigError

# The keys that fix the shapes of a checkpoint's arrays: it restores only into the same shapes.
SHAPE_KEYS = (
    "decoder_block",
    "num_decoder_layers",
    "emb_dim",
    "num_query_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "vocab_size",
    "logits_via_embedding",
)
# The model a checkpoint holds (shapes and numerics of the forward pass).
MODEL_KEYS = (
    *SHAPE_KEYS,
    "normalization_layer_epsilon",
    "rope_max_timescale",
    "rope_type",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
    "use_qk_norm",
    "attention_bias",
    "mlp_activations",
    "sliding_window_size",
    "attn_logits_soft_cap",
    "final_logits_soft_cap",
    "query_pre_attn_scalar",
    "use_post_attn_norm",
    "use_post_ffw_norm",
)
# Taken too when the checkpoint names a tokenizer file (a converted Hugging Face checkpoint).
TOKENIZER_KEYS = ("tokenizer_path", "tokenizer_type", "add_bos", "add_eos")


def _step_dirs(path: Path) -> list[Path]:
    if path.name in ("items", "state") and path.parent.name.isdigit():
        return [path.parent]
    if path.name.isdigit():
        return [path]
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not folder.is_dir():
        return []
    steps = [p for p in folder.iterdir() if p.name.isdigit() and p.is_dir()]
    return sorted(steps, key=lambda p: int(p.name), reverse=True)


def saved_config(path: str) -> dict[str, Any] | None:
    """The config dict of the newest step under `path` whose saved config reads, or None."""
    for step_dir in _step_dirs(Path(path)):
        try:
            saved = json.loads((step_dir / "config" / "metadata").read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue  # no config item, or a damaged one: the checkpoint loader reports it
        if isinstance(saved, dict):
            return saved
    return None


def checkpoint_values(path: str) -> dict[str, Any]:
    """The keys of `MODEL_KEYS` (and `TOKENIZER_KEYS` when it names a tokenizer) saved with the
    checkpoint at `path`; {} when it has no readable config."""
    saved = saved_config(path) or {}
    keys = MODEL_KEYS + (TOKENIZER_KEYS if saved.get("tokenizer_path") else ())
    return {k: saved[k] for k in keys if k in saved}


# Data pipelines that train a sentencepiece tokenizer on the corpus when tokenizer_path is "".
TRAINS_A_TOKENIZER = ("text", "tfds")


def require_tokenizer(config: Any, path: str | None = None) -> None:
    """Refuses to go on without `tokenizer_path` from a converted checkpoint (`path`, by default
    `config.load_parameters_path`) that records no tokenizer: the data pipeline would train a new
    one on the corpus, which is not the tokenizer the model was trained with."""
    path = path if path is not None else config.load_parameters_path
    if config.tokenizer_path or not path or config.dataset_type not in TRAINS_A_TOKENIZER:
        return
    saved = saved_config(path) or {}
    if saved.get("converted_from") and not saved.get("tokenizer_path"):
        raise ConfigError(
            f"{path} records no tokenizer (converted from {saved['converted_from']}, which had no "
            f"tokenizer.json or tokenizer.model); give tokenizer_path=<the model's tokenizer file>"
        )
