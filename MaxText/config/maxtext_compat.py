"""MaxText's key names and values, resolved onto this trainer's keys (used by `config.py`).

MaxText users set the model through `base_*` keys scaled by `global_parameter_scale`, name
decoder blocks after models (`llama2`, `gpt3`, `mistral`), and derive pipeline repeats from
`num_layers_per_pipeline_stage`. Here `base_emb_dim` & co. are other names of `emb_dim` & co.
(`MAXTEXT_ALIASES`), and `apply_maxtext_values` / `pipeline_repeats` rewrite the raw values
dict before the config validates it. Keys MaxText has and this trainer does not are listed
with their reason in `unsupported_keys.py`.
"""

from __future__ import annotations

from typing import Any

from MaxText.errors import ConfigError

MAXTEXT_ALIASES = {
    "base_emb_dim": "emb_dim",
    "base_num_query_heads": "num_query_heads",
    "base_num_kv_heads": "num_kv_heads",
    "base_mlp_dim": "mlp_dim",
    "base_num_decoder_layers": "num_decoder_layers",
}
# MaxText decoder_block values that are one of this trainer's blocks (MaxText's mistral block is
# the llama2 block; sliding-window attention is not part of it).
DECODER_BLOCK_ALIASES = {"llama2": "llama", "mistral": "llama", "gpt3": "gpt"}


def parameter_scales(scale: int) -> tuple[int, int, int, int]:
    """log2 multipliers (emb, heads, mlp, layers) for `global_parameter_scale` (MaxText's rule).

    log2(scale) is split in turns of three: heads and mlp double first, then the width, then the
    number of layers (scale 2: heads+mlp; 4: + emb; 8: + layers; 16: heads+mlp again, ...).
    """
    log2 = scale.bit_length() - 1
    if scale < 1 or 1 << log2 != scale:
        raise ConfigError(
            f"global_parameter_scale={scale} must be a power of 2 (1, 2, 4, ...); set "
            f"base_emb_dim, base_num_query_heads, base_mlp_dim, ... for finer control"
        )
    base, rem = divmod(log2, 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def apply_maxtext_values(v: dict[str, Any]) -> None:
    """Resolves MaxText's values in place: decoder_block names, global_parameter_scale; checks
    the compatibility keys' ranges. Runs before any other validation."""
    v["decoder_block"] = DECODER_BLOCK_ALIASES.get(v["decoder_block"], v["decoder_block"])
    if v["hardware"] == "tpu":
        raise ConfigError(
            "not supported here: hardware=tpu: this trainer is tested on CPU and written for "
            "GPU; use hardware=auto (the accelerator JAX finds), gpu, gpu_multiprocess or cpu"
        )
    emb, heads, mlp, layers = parameter_scales(v["global_parameter_scale"])
    v["emb_dim"] <<= emb
    v["num_query_heads"] <<= heads
    v["num_kv_heads"] <<= heads
    v["mlp_dim"] <<= mlp
    v["num_decoder_layers"] <<= layers
    if v["init_weights_seed"] < -1:
        raise ConfigError(f"init_weights_seed={v['init_weights_seed']}: must be >= 0 (or -1)")
    if v["num_layers_per_pipeline_stage"] < 0:
        raise ConfigError(
            f"num_layers_per_pipeline_stage={v['num_layers_per_pipeline_stage']}: must be >= 0 "
            f"(0: from num_pipeline_repeats)"
        )


def pipeline_repeats(v: dict[str, Any], pp: int) -> None:
    """num_pipeline_repeats (virtual stages per group) from MaxText's pipeline keys.

    num_layers_per_pipeline_stage=K > 0: repeats = layers / (groups x K), exactly (MaxText).
    num_pipeline_repeats=-1 without K: one layer per virtual stage for interleaved_1f1b
    (MaxText's maximally circular default), 2 for dualpipev, else 1.
    """
    layers, per_stage, repeats = (
        v["num_decoder_layers"],
        v["num_layers_per_pipeline_stage"],
        v["num_pipeline_repeats"],
    )
    if repeats == 0 or repeats < -1:
        raise ConfigError(f"num_pipeline_repeats={repeats}: must be >= 1 (or -1 for derived)")
    if pp == 1:
        v["num_pipeline_repeats"] = 1 if repeats == -1 else repeats
        return
    if per_stage > 0:
        if layers % (pp * per_stage):
            raise ConfigError(
                f"num_layers_per_pipeline_stage={per_stage} x {pp} pipeline groups does not "
                f"divide num_decoder_layers={layers}; use a divisor of {layers // pp or 1} or 0"
            )
        derived = layers // (pp * per_stage)
        if repeats not in (-1, derived):
            raise ConfigError(
                f"num_pipeline_repeats={repeats} disagrees with num_layers_per_pipeline_stage="
                f"{per_stage} ({layers} layers / ({pp} groups x {per_stage}) = {derived}); "
                f"set one of them"
            )
        v["num_pipeline_repeats"] = derived
    elif repeats == -1:
        schedule = v["pipeline_schedule"]
        if schedule == "interleaved_1f1b":
            v["num_pipeline_repeats"] = max(layers // pp, 1)
        else:
            v["num_pipeline_repeats"] = 2 if schedule == "dualpipev" else 1
