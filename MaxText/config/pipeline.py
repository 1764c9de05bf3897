"""Pipeline keys of the config: schedule, stages, layers and remat per stage, microbatches.

`derive_pipeline(values, pp, dp)` validates them and fills the derived fields (`num_stages`,
`stage_layers`, `stage_remat`, `microbatch_size`, the `*_auto` flags) in the raw values dict that
`MaxText.config` builds; every error is a `ConfigError` naming the key and the fix. "auto" values
(`pipeline_schedule`, `num_pipeline_microbatches`, `pipeline_stage_layers`, `remat_policy`) keep a
safe default here and are decided later by the planner (`MaxText.planning.auto.resolve_auto`).
"""

from __future__ import annotations

from typing import Any

from MaxText.config.maxtext_compat import pipeline_repeats
from MaxText.errors import ConfigError

REMAT_POLICIES = ("none", "full", "minimal", "save_qkv_proj", "save_dot_except_mlp")


def derive_pipeline(v: dict[str, Any], pp: int, dp: int) -> None:
    """Validates the pipeline and batch keys of `v` (pp pipeline groups, dp data-parallel
    devices) and derives the stage layout and microbatching from them."""
    pipeline_repeats(v, pp)
    v["schedule_auto"] = v["pipeline_schedule"] == "auto"
    if v["schedule_auto"]:
        v["pipeline_schedule"] = "1f1b"
    v["microbatches_auto"] = v["num_pipeline_microbatches"] == "auto"
    if v["microbatches_auto"]:
        v["num_pipeline_microbatches"] = -1
    repeats = v["num_pipeline_repeats"]
    schedule = v["pipeline_schedule"]
    num_stages = pp * repeats
    v["num_stages"] = num_stages
    if v["num_decoder_layers"] < num_stages:
        raise ConfigError(
            f"num_decoder_layers={v['num_decoder_layers']} is less than the {num_stages} pipeline "
            f"stages (ici_pipeline_parallelism={pp} x num_pipeline_repeats={repeats}); "
            f"every stage needs at least one layer"
        )
    if pp > 1 and repeats > 1 and schedule not in ("interleaved_1f1b", "dualpipev"):
        raise ConfigError(
            f"num_pipeline_repeats={repeats} needs pipeline_schedule=interleaved_1f1b or "
            f"dualpipev; {schedule} runs one stage per pipeline group"
        )
    if pp > 1 and schedule == "dualpipev" and repeats != 2:
        raise ConfigError(
            f"pipeline_schedule=dualpipev runs exactly 2 stages per group; "
            f"set num_pipeline_repeats=2 (got {repeats})"
        )
    v["stage_layers"] = stage_layer_counts(v["num_decoder_layers"], num_stages)
    split = _stage_split(v["pipeline_stage_layers"], v["num_decoder_layers"], num_stages)
    if isinstance(split, tuple):
        v["stage_layers"] = split
    v["pipeline_stage_layers"] = split if isinstance(split, str) else ",".join(map(str, split))

    # remat per stage: pipeline_stage_remat lists one policy per stage; remat_policy=auto leaves
    # the choice to the planner (MaxText/planning/remat_choice.py), "full" until it is resolved
    v["remat_auto"] = v["remat_policy"] == "auto" and not v["pipeline_stage_remat"]
    if v["remat_policy"] == "auto":
        v["remat_policy"] = "full"
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
    if v["num_pipeline_microbatches"] < 1:
        raise ConfigError(
            f"num_pipeline_microbatches={v['num_pipeline_microbatches']}: must be >= 1 "
            f"(or -1 for automatic)"
        )
    v["num_pipeline_microbatches"] *= ga
    m = v["num_pipeline_microbatches"]
    if v["global_batch_size"] % (m * dp):
        raise ConfigError(
            f"global_batch_size={v['global_batch_size']} is not divisible by "
            f"num_pipeline_microbatches={m} x {dp} data-parallel devices (data x fsdp); "
            f"use a global batch that is a multiple of {m * dp}"
        )
    v["microbatch_size"] = v["global_batch_size"] // m
    if pp > 1 and schedule == "interleaved_1f1b" and m % pp:
        raise ConfigError(
            f"pipeline_schedule=interleaved_1f1b needs num_pipeline_microbatches={m} to be a "
            f"multiple of ici_pipeline_parallelism={pp}"
        )
    if pp > 1 and schedule == "dualpipev" and m < num_stages:
        raise ConfigError(
            f"pipeline_schedule=dualpipev needs num_pipeline_microbatches >= {num_stages} "
            f"stages, got {m}"
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


def _stage_split(value: Any, num_layers: int, num_stages: int) -> tuple[int, ...] | str:
    """`pipeline_stage_layers`: 'even', 'auto' (resolved by the trainer through the planner,
    MaxText/planning/stage_balance.py) or explicit counts per stage."""
    try:
        return parse_stage_layers(value, num_layers, num_stages)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
    """'even' | 'auto' | '6,9,9,8' -> 'even', 'auto' or the counts; ValueError names the fix."""
    text = str(value).strip().lower()
    if text in ("even", "auto"):
        return text
    try:
        counts = tuple(int(x) for x in text.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(
            f"pipeline_stage_layers={value!r} is not 'even', 'auto' or a comma-separated list of "
            f"layer counts such as '{_example(num_layers, num_stages)}'"
        ) from None
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"pipeline_stage_layers={value!r} must list {num_stages} stage sizes (each >= 1) "
            f"summing to num_decoder_layers={num_layers}, e.g. "
            f"'{_example(num_layers, num_stages)}'"
        )
    return counts


def _example(num_layers: int, num_stages: int) -> str:
    base, extra = divmod(num_layers, num_stages)
    return ",".join(str(base + (1 if s < extra else 0)) for s in range(num_stages))
