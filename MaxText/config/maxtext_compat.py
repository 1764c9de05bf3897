"""MaxText's key names and values, resolved onto this trainer's keys (used by the loader).

MaxText users set the model through `base_*` keys scaled by `global_parameter_scale`, name
decoder blocks after models (`llama2`, `gpt3`), and derive pipeline repeats from
`num_layers_per_pipeline_stage`. Here `base_emb_dim` & co. are other names of `emb_dim` & co.
(`MAXTEXT_ALIASES`), MaxText's block names other names of ours (`VALUE_ALIASES`), and
`apply_parameter_scale` / `pipeline_repeats` rewrite the values before the rules between keys
run. Keys MaxText has and this trainer does not are listed with their reason in
`unsupported_keys.py`.
"""

from __future__ import annotations

from typing import Any

from jaxpp_integration.schedules import STAGES_PER_RANK
from MaxText.errors import ConfigError

MAXTEXT_ALIASES = {
    "base_emb_dim": "emb_dim",
    "base_num_query_heads": "num_query_heads",
    "base_num_kv_heads": "num_kv_heads",
    "base_mlp_dim": "mlp_dim",
    "base_num_decoder_layers": "num_decoder_layers",
}
# MaxText decoder_block values that are other names of this trainer's blocks.
VALUE_ALIASES = {"decoder_block": {"llama2": "llama", "gpt3": "gpt"}}
# MaxText keys accepted with no effect here, and why (they are dropped at load).
NO_EFFECT = {
    "override_model_config": "a model preset never conflicts with the command line: command-line "
    "keys always win (MaxText stops when the two disagree unless it is true)",
}


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


def apply_parameter_scale(v: dict[str, Any]) -> None:
    """Scales the model keys in place by `global_parameter_scale`."""
    emb, heads, mlp, layers = parameter_scales(v["global_parameter_scale"])
    v["emb_dim"] <<= emb
    v["num_query_heads"] <<= heads
    v["num_kv_heads"] <<= heads
    v["mlp_dim"] <<= mlp
    v["num_decoder_layers"] <<= layers


def pipeline_repeats(v: dict[str, Any], pp: int) -> None:
    """num_pipeline_repeats (virtual stages per group) from MaxText's pipeline keys.

    num_layers_per_pipeline_stage=K > 0: repeats = layers / (groups x K), exactly (MaxText).
    num_pipeline_repeats=-1 without K: as many as the schedule runs per group (dualpipev 2,
    1F1B & co. 1), and for interleaved_1f1b one layer per virtual stage (MaxText's maximally
    circular default).
    """
    layers, per_stage, repeats = (
        v["num_decoder_layers"],
        v["num_layers_per_pipeline_stage"],
        v["num_pipeline_repeats"],
    )
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
        v["num_pipeline_repeats"] = STAGES_PER_RANK[v["pipeline_schedule"]] or max(layers // pp, 1)
