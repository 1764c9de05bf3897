"""The trainer's `auto` keys, decided from plans (`MaxText.plan_step`).

- `pipeline_schedule=auto`, `num_pipeline_microbatches=auto`: `resolve_schedule`
  (`MaxText.schedule_choice` ranks candidates from one plan of the defaults);
- `pipeline_stage_layers=auto`: `auto_stage_layers` (`MaxText.stage_balance` on the even split's
  measured costs);
- `remat_policy=auto`: `plan_remat_auto` (`MaxText.remat_choice`), then compiled again to check.

`make_plan` is what `python -m MaxText.plan` prints, every `auto` key decided; `resolve_auto` is
what `train.py` runs before building its step: the same decisions, returned as typed keys.
"""

from __future__ import annotations

import dataclasses
import logging

from MaxText.hardware import Hardware, local_hardware
from MaxText.plan_step import Plan, format_bytes, plan_pipelined, plan_spmd

log = logging.getLogger("MaxText")


def make_plan(config, hardware: Hardware) -> Plan:
    """The plan for `config` (devices must already exist: see `main`), every "auto" key decided
    as the trainer decides it. With `pipeline_stage_layers=auto` the even split is planned
    first, `stage_balance` picks the split from its costs, and that split is planned (compiled)
    again; `.compared` holds the even plan for the side-by-side view. With `remat_policy=auto`
    the policies per stage are chosen last (`plan_remat_auto`)."""
    if not config.is_pipelined:
        return (
            plan_spmd_remat_auto(config, hardware)
            if config.remat_auto
            else plan_spmd(config, hardware)
        )
    plan = plan_pipelined(config, hardware)
    if config.pipeline_stage_layers == "auto":
        split = auto_stage_layers(config, plan, hardware)
        if split is not None and list(split) != plan.stage_layers:
            config = dataclasses.replace(config, stage_layers=tuple(split))
            plan = dataclasses.replace(plan_pipelined(config, hardware), compared=plan)
    if config.remat_auto:
        plan = plan_remat_auto(config, hardware, plan)
    return plan


def plan_remat_auto(config, hardware: Hardware, base: Plan) -> Plan:
    """`remat_policy=auto` on a pipeline: the policies per stage `remat_choice.choose` picks
    from `base` (this config planned with its current policies), compiled and planned again to
    check them; a group that still does not fit moves its stages to the next heavier policy
    (at most twice). The returned plan carries the choice in `.remat`."""
    from MaxText import remat_choice as rc

    profile = rc.layer_profile(config)
    rows = config.microbatch_size / config.data_parallel_devices
    group_of = base.stage_costs.group_of
    choice = rc.choose(
        profile,
        config.stage_layers,
        group_of,
        base.stage_remat,
        [g.peak_bytes for g in base.groups],
        [g.activation_bytes for g in base.groups],
        [live * rows for live in base.live_microbatches],
        hardware.memory_bytes,
    )
    policies = choice.policies
    plan = dataclasses.replace(  # base, judged against this hardware
        base,
        fits=all(g.peak_bytes <= hardware.memory_bytes for g in base.groups),
        memory_bytes=hardware.memory_bytes,
    )
    for _ in range(3):
        if tuple(policies) != tuple(plan.stage_remat):
            chosen = dataclasses.replace(config, stage_remat=tuple(policies), remat_auto=False)
            plan = plan_pipelined(chosen, hardware)
        over = {g.group for g in plan.groups if g.peak_bytes > hardware.memory_bytes}
        heavier = [
            rc.heavier(p, profile) if group_of[s] in over else p for s, p in enumerate(policies)
        ]
        if not over or heavier == list(policies):
            break
        policies = heavier
    spent = sum(n * profile[p].flops for n, p in zip(config.stage_layers, plan.stage_remat))
    none = sum(config.stage_layers) * profile["none"].flops
    report = dataclasses.replace(
        choice,
        policies=tuple(plan.stage_remat),
        peak_bytes=tuple(g.peak_bytes for g in plan.groups),
        fits=plan.fits,
        recompute_fraction=spent / none - 1.0,
    )
    log.info("remat_policy=auto: %s", describe_remat(report))
    return dataclasses.replace(plan, remat=report, compared=plan.compared or base.compared)


def plan_spmd_remat_auto(config, hardware: Hardware) -> Plan:
    """`remat_policy=auto` without a pipeline: the policy with the least recompute whose
    compiled step fits (each candidate compiled in that order; the last one if none fits)."""
    from MaxText import remat_choice as rc

    profile = rc.layer_profile(config)
    for policy in rc.by_recompute(profile):
        one = dataclasses.replace(config, remat_policy=policy, stage_remat=(policy,))
        plan = plan_spmd(one, hardware)
        if plan.fits:
            break
    extra = profile[policy].flops / profile["none"].flops - 1.0
    choice = rc.RematChoice((policy,), (plan.groups[0].peak_bytes,), plan.fits, extra)
    log.info("remat_policy=auto: %s", describe_remat(choice))
    return dataclasses.replace(plan, remat=choice, stage_remat=(policy,))


def describe_remat(choice) -> str:
    return (
        f"remat per stage {list(choice.policies)}: layer FLOPs "
        f"+{100 * choice.recompute_fraction:.0f}% over remat_policy=none, "
        + ("every group fits" if choice.fits else "does not fit")
    )


def auto_stage_layers(config, even: Plan, hardware: Hardware):
    """The balanced split for `config` from the even split's plan (None if nothing fits)."""
    from MaxText.stage_balance import balance

    return balance(even.stage_costs, config.num_decoder_layers, hardware.memory_bytes)


def resolve_schedule(argv, config, hardware: Hardware, base: Plan | None = None):
    """`pipeline_schedule=auto` / `num_pipeline_microbatches=auto`: the fastest predicted
    (schedule, virtual stages, microbatches) that fits (`schedule_choice`, from one plan of the
    defaults), logged with the runner-up. Returns (config, keys): the choice as `key=value`
    strings appended to `argv` and the config loaded again, so it is validated like a typed one."""
    from MaxText.config import load_config
    from MaxText.schedule_choice import choose, microbatch_options

    if not (config.is_pipelined and (config.schedule_auto or config.microbatches_auto)):
        return config, []
    base = base or plan_pipelined(config, hardware)
    schedules = _all_schedules() if config.schedule_auto else [config.pipeline_schedule]
    if config.microbatches_auto:
        counts = microbatch_options(base.baseline)
    else:
        counts = [config.num_pipeline_microbatches]
    ranked = choose(base.baseline, hardware.memory_bytes, schedules, counts)
    if not ranked:
        log.info("auto schedule: no candidate for this batch; keeping %s", config.pipeline_schedule)
        return config, []
    log.info("auto schedule: %s", ranked[0].describe())
    if len(ranked) > 1:
        log.info("runner-up: %s", ranked[1].describe())
    best = ranked[0]
    keys = [
        f"pipeline_schedule={best.schedule}",
        f"num_pipeline_repeats={best.repeats}",
        f"num_pipeline_microbatches={best.microbatches}",
    ]
    return load_config([*argv, *keys]), keys


def resolve_auto(argv, config, hardware: Hardware | None = None):
    """The trainer's config with every "auto" key decided, in the planner's order: schedule and
    microbatches (`resolve_schedule`), then `pipeline_stage_layers=auto` from a plan of that
    schedule, then `remat_policy=auto` (`plan_remat_auto`) on that split. Each decision is logged
    and appended to `argv` as a typed key, and the config is loaded again."""
    from MaxText.config import load_config

    split_auto = config.is_pipelined and config.pipeline_stage_layers == "auto"
    if not (config.schedule_auto or config.microbatches_auto or split_auto or config.remat_auto):
        return config
    hardware = hardware or local_hardware(config)
    config, keys = resolve_schedule(argv, config, hardware)
    base = None
    if split_auto:
        base = plan_pipelined(config, hardware)
        split = auto_stage_layers(config, base, hardware)
        if split is None:
            log.info(
                "pipeline_stage_layers=auto: no split fits %s per device; keeping %s",
                format_bytes(hardware.memory_bytes),
                base.stage_layers,
            )
            split = tuple(base.stage_layers)
        else:
            log.info(
                "pipeline_stage_layers=auto: %s (even split %s; predicted slowest stage %.3g s "
                "vs %.3g s)",
                list(split),
                base.stage_layers,
                _slowest(base.stage_costs, split),
                _slowest(base.stage_costs, base.stage_layers),
            )
        keys.append("pipeline_stage_layers=" + ",".join(map(str, split)))
        config = load_config([*argv, *keys])
        if list(split) != base.stage_layers:
            base = None
    if config.remat_auto:
        if config.is_pipelined:
            plan = plan_remat_auto(config, hardware, base or plan_pipelined(config, hardware))
            keys.append("pipeline_stage_remat=" + ",".join(plan.stage_remat))
        else:
            plan = plan_spmd_remat_auto(config, hardware)
            keys.append(f"remat_policy={plan.stage_remat[0]}")
        config = load_config([*argv, *keys])
    return config


def _all_schedules() -> list[str]:
    from MaxText.config import PIPELINE_SCHEDULES

    return list(PIPELINE_SCHEDULES)


def _slowest(costs, split) -> float:
    return max(costs.stage_seconds(s, n) for s, n in enumerate(split))
