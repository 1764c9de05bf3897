"""Pipeline keys of the config: schedule, stages, layers and remat per stage, microbatches.

`auto_defaults(values)` records which keys are "auto" (`pipeline_schedule`,
`num_pipeline_microbatches`, `remat_policy`; `pipeline_stage_layers` stays "auto") and puts safe
defaults in their place until the planner decides them (`MaxText.planning.auto.resolve_auto`).
`derive_pipeline(values)` validates the rest and derives `num_stages`, `stage_layers`,
`stage_remat` and `microbatch_size`. Which stage and microbatch counts a schedule accepts is the
engine's rule (`STAGES_PER_RANK`, `Schedule.microbatch_rule`); this module words it in keys.
"""

from __future__ import annotations

from typing import Any

from jaxpp_integration.schedules import STAGES_PER_RANK, schedule_from_name
from MaxText.config.maxtext_compat import pipeline_repeats
from MaxText.errors import ConfigError

REMAT_POLICIES = ("none", "full", "minimal", "save_qkv_proj", "save_dot_except_mlp")


def auto_defaults(v: dict[str, Any]) -> None:
    v["schedule_auto"] = v["pipeline_schedule"] == "auto"
    v["microbatches_auto"] = v["num_pipeline_microbatches"] == "auto"
    v["remat_auto"] = v["remat_policy"] == "auto" and not v["pipeline_stage_remat"]
    if v["schedule_auto"]:
        v["pipeline_schedule"] = "1f1b"
    if v["microbatches_auto"]:
        v["num_pipeline_microbatches"] = -1
    if v["remat_policy"] == "auto":  # the planner picks per stage (planning/remat_choice.py)
        v["remat_policy"] = "full"


def derive_pipeline(v: dict[str, Any]) -> None:
    """Validates the pipeline and batch keys of `v` (mesh sizes already derived) and derives the
    stage layout and microbatching from them."""
    pp, dp, schedule = v["mesh_pipeline"], v["data_parallel_devices"], v["pipeline_schedule"]
    pipeline_repeats(v, pp)
    repeats = v["num_pipeline_repeats"]
    num_stages = v["num_stages"] = pp * repeats
    if v["num_decoder_layers"] < num_stages:
        raise ConfigError(
            f"num_decoder_layers={v['num_decoder_layers']} is less than the {num_stages} pipeline "
            f"stages (ici_pipeline_parallelism={pp} x num_pipeline_repeats={repeats}); "
            f"every stage needs at least one layer"
        )
    per_rank = STAGES_PER_RANK[schedule]
    if pp > 1 and per_rank == 1 and repeats > 1:
        several = " or ".join(name for name, n in STAGES_PER_RANK.items() if n != 1)
        raise ConfigError(
            f"num_pipeline_repeats={repeats} needs pipeline_schedule={several}; "
            f"{schedule} runs one stage per pipeline group"
        )
    if pp > 1 and per_rank not in (None, 1, repeats):
        raise ConfigError(
            f"pipeline_schedule={schedule} runs exactly {per_rank} stages per group; "
            f"set num_pipeline_repeats={per_rank} (got {repeats})"
        )
    split = parse_stage_layers(v["pipeline_stage_layers"], v["num_decoder_layers"], num_stages)
    v["stage_layers"] = (
        split
        if isinstance(split, tuple)
        else stage_layer_counts(v["num_decoder_layers"], num_stages)
    )
    v["pipeline_stage_layers"] = split if isinstance(split, str) else ",".join(map(str, split))
    v["stage_remat"] = _stage_remat(v["pipeline_stage_remat"], v["remat_policy"], num_stages)

    # batch: per_device_batch_size counts every device (pipeline and tensor included) as in
    # MaxText; gradient_accumulation_steps multiplies the batch and the number of microbatches
    ga = v["gradient_accumulation_steps"]
    if v["global_batch_size"] == 0:
        rows = v["per_device_batch_size"] * v["num_devices"] * ga
        if rows != int(rows):
            raise ConfigError(
                f"per_device_batch_size={v['per_device_batch_size']} x {v['num_devices']} devices"
                f" x gradient_accumulation_steps={ga} = {rows:g} rows is not a whole number; "
                f"choose per_device_batch_size so that it is (or set global_batch_size)"
            )
        v["global_batch_size"] = int(rows)
    if v["num_pipeline_microbatches"] == -1:
        v["num_pipeline_microbatches"] = 2 * pp if pp > 1 else 1
    m = v["num_pipeline_microbatches"] = v["num_pipeline_microbatches"] * ga
    if v["global_batch_size"] % (m * dp):
        raise ConfigError(
            f"global_batch_size={v['global_batch_size']} is not divisible by "
            f"num_pipeline_microbatches={m} x {dp} data-parallel devices (data x fsdp); "
            f"use a global batch that is a multiple of {m * dp}"
        )
    v["microbatch_size"] = v["global_batch_size"] // m
    if pp > 1:
        multiple, minimum = schedule_from_name(schedule, num_stages, pp).microbatch_rule()
        groups = "ici_pipeline_parallelism" if v["dcn_pipeline_parallelism"] == 1 else "groups"
        if m % multiple:
            of = f"{groups}={pp}" if multiple == pp else str(multiple)
            raise ConfigError(
                f"pipeline_schedule={schedule} needs num_pipeline_microbatches={m} to be a "
                f"multiple of {of}"
            )
        if m < minimum:
            raise ConfigError(
                f"pipeline_schedule={schedule} needs num_pipeline_microbatches >= {minimum} "
                f"({num_stages} stages on {groups}={pp}), got {m}"
            )


def stage_layer_counts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Decoder layers per stage: an even split, remainder layers to the middle stages first.

    The first stage also holds the embedding and the last stage the final norm, logits and loss,
    so extra layers go to the stages nearest the middle, then to the first, then to the last.
    """
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    middle = sorted(range(1, num_stages - 1), key=lambda s: (abs(2 * s - (num_stages - 1)), s))
    order = middle + [0] + ([num_stages - 1] if num_stages > 1 else [])
    for stage in order[:extra]:
        counts[stage] += 1
    return tuple(counts)


def _stage_remat(value: str, default: str, num_stages: int) -> tuple[str, ...]:
    """`pipeline_stage_remat`: '' (remat_policy on every stage) or one policy per stage."""
    text = str(value).strip()
    if not text:
        return (default,) * num_stages
    policies = tuple(p.strip() for p in text.split(","))
    bad = [p for p in policies if p not in REMAT_POLICIES]
    if bad or len(policies) != num_stages:
        what = (
            f"{bad[0]!r} is not one of {' | '.join(REMAT_POLICIES)}"
            if bad
            else (f"it lists {len(policies)} policies for {num_stages} stages")
        )
        raise ConfigError(
            f"pipeline_stage_remat={value!r}: {what}; give one policy per stage, e.g. "
            f"'{','.join(['full'] + ['minimal'] * (num_stages - 1))}'"
        )
    return policies


def parse_stage_layers(value: str, num_layers: int, num_stages: int) -> tuple[int, ...] | str:
    """`pipeline_stage_layers`: 'even' | 'auto' (balanced by the planner,
    MaxText/planning/stage_balance.py) | '6,9,9,8' -> 'even', 'auto' or the counts. A
    ConfigError (a ValueError) names the fix."""
    text = str(value).strip().lower()
    if text in ("even", "auto"):
        return text
    example = ",".join(map(str, stage_layer_counts(num_layers, num_stages)))
    try:
        counts = tuple(int(x) for x in text.replace(" ", "").split(","))
    except ValueError:
        raise ConfigError(
            f"pipeline_stage_layers={value!r} is not 'even', 'auto' or a comma-separated list of "
            f"layer counts such as '{example}'"
        ) from None
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(
            f"pipeline_stage_layers={value!r} must list {num_stages} stage sizes (each >= 1) "
            f"summing to num_decoder_layers={num_layers}, e.g. '{example}'"
        )
    return counts
