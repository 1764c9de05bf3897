"""The trainer's `auto` keys, decided from plans (`MaxText.planning.cost_model`).

- `pipeline_schedule=auto`, `num_pipeline_microbatches=auto`: `resolve_schedule`
  (`MaxText.planning.schedule_choice` ranks candidates from one plan of the defaults);
- `pipeline_stage_layers=auto`: `plan_layout` (`MaxText.planning.stage_balance` on the even
  split's measured costs, the chosen split compiled and planned again);
- `remat_policy=auto`: `plan_remat_auto` (`MaxText.planning.remat_choice`), then compiled again to
  check.

`make_plan` is what `python -m MaxText.plan` prints, every `auto` key decided; `resolve_auto` is
what `train.py` runs before building its step: the same decisions, as a config whose keys hold
them (every changed config comes from `Config.replace`, so it is checked and derived again).
"""

from __future__ import annotations

import dataclasses
import logging

from jaxpp_integration.schedules import SCHEDULE_NAMES
from MaxText.errors import ConfigError
from MaxText.planning.cost_model import Plan, plan_pipelined, plan_spmd
from MaxText.planning.hardware import Hardware, local_hardware

log = logging.getLogger("MaxText")


def make_plan(config, hardware: Hardware, base: Plan | None = None) -> Plan:
    """The plan for `config` (devices must already exist: see `MaxText.plan.main`), every
    "auto" key decided as the trainer decides it (`base`: this config already planned)."""
    if not config.is_pipelined:
        return (
            plan_spmd_remat_auto(config, hardware)
            if config.remat_auto
            else plan_spmd(config, hardware)
        )
    return plan_layout(config, hardware, base)


def plan_layout(config, hardware: Hardware, base: Plan | None = None) -> Plan:
    """`pipeline_stage_layers=auto` and `remat_policy=auto` on a pipeline, decided and planned.

    The configured split (even, unless counts are given) is planned first (`base`). With a fixed
    remat, `stage_balance.balance` picks the split from base's measured costs. With
    `remat_policy=auto` too, split and policies are chosen together
    (`stage_balance.balance_with_options` over `remat_choice.with_policy_options`), and the even
    split with policies chosen for it (`plan_remat_auto`) is the alternative. The chosen split is
    compiled and planned again; it is kept only if it fits and is predicted faster than the
    even split (or the even split does not fit), and `.compared` holds the even plan for the
    side-by-side view. With only `remat_policy=auto`, `plan_remat_auto` on the base."""
    from MaxText.planning import remat_choice as rc
    from MaxText.planning.stage_balance import balance_with_options

    base = base or plan_pipelined(config, hardware)
    if config.pipeline_stage_layers != "auto":
        return plan_remat_auto(config, hardware, base) if config.remat_auto else base
    even = plan_remat_auto(config, hardware, base) if config.remat_auto else base
    costs = base.stage_costs
    if config.remat_auto:  # calibrated on both plans compiled so far
        profile = rc.layer_profile(config)
        costs = rc.with_policy_options(
            costs,
            profile,
            config.stage_layers,
            base.stage_remat,
            [live * base.rows_per_microbatch for live in base.live_microbatches],
            [g.temp_bytes for g in base.groups],
            _temp_by_policy(base, even),
            rc.activation_scales(profile, [base, even]),
        )
    found = balance_with_options(costs, config.num_decoder_layers, hardware.memory_bytes)
    if found is None or list(found.split) == base.stage_layers:
        why = "no other split fits" if found is None else "the even split is the best"
        log.info("pipeline_stage_layers=auto: %s; keeping %s", why, base.stage_layers)
        return even
    split = config.replace(pipeline_stage_layers=",".join(map(str, found.split)))
    chosen = (
        split.replace(pipeline_stage_remat=",".join(found.policies)) if config.remat_auto else split
    )
    plan = plan_pipelined(chosen, hardware)
    if config.remat_auto:
        if not plan.fits:  # the prediction missed: move its groups to heavier policies
            plan = plan_remat_auto(split, hardware, plan)
        else:
            report = _remat_report(chosen, plan)
            plan = dataclasses.replace(
                plan, remat=dataclasses.replace(report, full_step_s=_full_step_s(base))
            )
    faster = plan.predicted["step_time_s"] < even.predicted["step_time_s"]
    if plan.fits and (faster or not even.fits):
        log.info(
            "pipeline_stage_layers=auto: %s (even split %s): predicted step %.3g s vs %.3g s",
            plan.stage_layers,
            base.stage_layers,
            plan.predicted["step_time_s"],
            even.predicted["step_time_s"],
        )
        return dataclasses.replace(plan, compared=even)
    log.info(
        "pipeline_stage_layers=auto: %s planned at %.3g s per step%s; keeping %s",
        plan.stage_layers,
        plan.predicted["step_time_s"],
        "" if plan.fits else " and does not fit",
        base.stage_layers,
    )
    return dataclasses.replace(even, compared=None)


def _temp_by_policy(*plans: Plan) -> dict[str, float]:
    """XLA temporaries per remat policy: the largest of the groups whose stages all run it."""
    out: dict[str, float] = {}
    for plan in plans:
        group_of = plan.stage_costs.group_of
        for g in plan.groups:
            policies = {p for s, p in enumerate(plan.stage_remat) if group_of[s] == g.group}
            if len(policies) == 1:
                (p,) = policies
                out[p] = max(out.get(p, 0.0), float(g.temp_bytes))
    return out


def _remat_report(config, plan: Plan):
    """`remat_choice.RematChoice` describing `plan`'s policies per stage."""
    from MaxText.planning import remat_choice as rc

    profile = rc.layer_profile(config)
    spent = sum(n * profile[p].flops for n, p in zip(plan.stage_layers, plan.stage_remat))
    none = sum(plan.stage_layers) * profile["none"].flops
    return rc.RematChoice(
        tuple(plan.stage_remat),
        tuple(g.peak_bytes for g in plan.groups),
        plan.fits,
        spent / none - 1.0,
        plan.predicted["step_time_s"],
    )


def plan_remat_auto(config, hardware: Hardware, base: Plan) -> Plan:
    """`remat_policy=auto` on a pipeline: the policies per stage `remat_choice.choose` picks
    from `base` (this config planned with its current policies), compiled and planned again to
    check them; a group that still does not fit moves its stages to the next heavier policy
    (at most twice). The returned plan carries the choice in `.remat`."""
    from MaxText.planning import remat_choice as rc

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
            plan = plan_pipelined(config.replace(pipeline_stage_remat=",".join(policies)), hardware)
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
        step_s=plan.predicted["step_time_s"],
        full_step_s=_full_step_s(base),
    )
    log.info("remat_policy=auto: %s", describe_remat(report))
    return dataclasses.replace(plan, remat=report, compared=plan.compared or base.compared)


def plan_spmd_remat_auto(config, hardware: Hardware) -> Plan:
    """`remat_policy=auto` without a pipeline: the policy with the least recompute whose
    compiled step fits (each candidate compiled in that order; the last one if none fits)."""
    from MaxText.planning import remat_choice as rc

    profile = rc.layer_profile(config)
    for policy in rc.by_recompute(profile):
        plan = plan_spmd(config.replace(remat_policy=policy), hardware)
        if plan.fits:
            break
    extra = profile[policy].flops / profile["none"].flops - 1.0
    choice = rc.RematChoice((policy,), (plan.groups[0].peak_bytes,), plan.fits, extra)
    log.info("remat_policy=auto: %s", describe_remat(choice))
    return dataclasses.replace(plan, remat=choice, stage_remat=(policy,))


def describe_remat(choice) -> str:
    versus = ""
    if choice.step_s and choice.full_step_s:
        versus = (
            f"; predicted step {choice.step_s:.3g} s vs {choice.full_step_s:.3g} s with remat "
            f"full on every stage ({choice.full_step_s / choice.step_s:.2f}x)"
        )
    return (
        f"remat per stage {list(choice.policies)}: layer FLOPs "
        f"+{100 * choice.recompute_fraction:.0f}% over remat_policy=none, "
        + ("every group fits" if choice.fits else "does not fit")
        + versus
    )


def _full_step_s(plan: Plan) -> float:
    """`plan`'s predicted step when it was planned with remat full on every stage, else 0."""
    return plan.predicted["step_time_s"] if set(plan.stage_remat) == {"full"} else 0.0


def resolve_schedule(config, hardware: Hardware, base: Plan | None = None):
    """`pipeline_schedule=auto` / `num_pipeline_microbatches=auto`: the fastest predicted
    (schedule, virtual stages, microbatches) that fits (`schedule_choice`, from one plan of the
    defaults), logged with the runner-up. Returns (config, plan): the config with the choice in
    its keys, and the plan of that config when it is the one already planned (else None)."""
    from MaxText.planning.schedule_choice import choose, microbatch_options

    if not (config.is_pipelined and (config.schedule_auto or config.microbatches_auto)):
        return config, base
    base = base or plan_pipelined(config, hardware)
    schedules = list(SCHEDULE_NAMES) if config.schedule_auto else [config.pipeline_schedule]
    # microbatches per step; the key counts them per accumulation step (gradient_accumulation)
    ga = config.gradient_accumulation_steps
    if config.microbatches_auto:
        counts = [m for m in microbatch_options(base.baseline) if m % ga == 0]
    else:
        counts = [config.num_pipeline_microbatches]
    ranked = choose(base.baseline, hardware.memory_bytes, schedules, counts)
    if not ranked:
        log.info("auto schedule: no candidate for this batch; keeping %s", config.pipeline_schedule)
        return config, base
    log.info("auto schedule: %s", ranked[0].describe())
    if len(ranked) > 1:
        log.info("runner-up: %s", ranked[1].describe())
    best = ranked[0]
    chosen = config.replace(
        pipeline_schedule=best.schedule,
        num_pipeline_repeats=int(best.repeats),
        num_pipeline_microbatches=int(best.microbatches) // ga,
    )
    same = (chosen.pipeline_schedule, chosen.num_pipeline_repeats, chosen.num_pipeline_microbatches)
    planned = (
        config.pipeline_schedule,
        config.num_pipeline_repeats,
        config.num_pipeline_microbatches,
    )
    return chosen, base if same == planned else None


def _refuse_several_processes(config) -> None:
    """The planner reads every group's compiled programs; under several processes each process
    compiles only its own groups' (and all must decide alike), so pipelined `auto` keys are
    decided beforehand on one host."""
    import jax

    if config.is_pipelined and jax.process_count() > 1:
        raise ConfigError(
            f"'auto' pipeline keys need the planner, which compiles every pipeline group in one "
            f"process, but this run has {jax.process_count()} processes; run `python -m "
            "MaxText.plan` with the same arguments on one host and pass the keys it chose"
        )


def resolve_auto(config, hardware: Hardware | None = None):
    """The trainer's config with every "auto" key decided, in the planner's order: schedule and
    microbatches (`resolve_schedule`), then the split and remat per stage of that schedule
    (`plan_layout`). Each decision is logged and set in the config's keys."""
    split_auto = config.is_pipelined and config.pipeline_stage_layers == "auto"
    if not (config.schedule_auto or config.microbatches_auto or split_auto or config.remat_auto):
        return config
    _refuse_several_processes(config)
    hardware = hardware or local_hardware(config)
    config, base = resolve_schedule(config, hardware)
    if not config.is_pipelined:
        if config.remat_auto:
            config = config.replace(
                remat_policy=plan_spmd_remat_auto(config, hardware).stage_remat[0]
            )
        return config
    keys = {}
    if split_auto or config.remat_auto:
        plan = plan_layout(config, hardware, base)
        if split_auto:
            keys["pipeline_stage_layers"] = ",".join(map(str, plan.stage_layers))
        if config.remat_auto or plan.stage_remat != tuple(config.stage_remat):
            keys["pipeline_stage_remat"] = ",".join(plan.stage_remat)
    return config.replace(**keys)
