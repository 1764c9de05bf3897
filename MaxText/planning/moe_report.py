"""A mixture of experts' terms of a plan, read off the compiled step (`moe_costs` holds the
formulas): the bytes each loop task's all-to-alls move per device (`task_all_to_all_bytes`,
launches counted in the task's HLO) and their seconds (`all_to_all_seconds`, which
`cost_model.plan_compiled` adds to the task's time), the plan's MoE report (`moe_report`:
parameters total and active, experts and dispatch buffers per device, the step's all-to-alls
and their share of the step; `Plan.moe`) and its printed line (`describe_moe`).
"""

from __future__ import annotations

from MaxText.planning import moe_costs
from MaxText.planning.hardware import Hardware, format_bytes


def all_to_all_seconds(config, nbytes: float, hardware: Hardware) -> float:
    """Seconds of all-to-alls moving `nbytes` per device over the expert group's links."""
    return moe_costs.all_to_all_seconds(nbytes, config.mesh_expert, hardware)


def task_all_to_all_bytes(config, compiled, report) -> dict:
    """Task index -> bytes per device of its all-to-alls (counted in its HLO; see
    `moe_costs`)."""
    from jaxpp_integration.tools.collectives import instruction_collectives

    per_launch = moe_costs.all_to_all_bytes(config)
    cache: dict = {}
    out = {}
    for t in report.tasks:
        if t.kind == "loop" and t.flops:  # compiled here (another process's group: zeros)
            counts = instruction_collectives(compiled, t.index, cache)
            out[t.index] = counts.get("all-to-all", (0, 0))[0] * per_launch
    return out


def moe_report(config, compiled, report, a2a_bytes: dict, a2a_seconds: dict, step_time) -> dict:
    """A mixture of experts' plan terms (`moe_costs`): parameters total and active, the
    experts' bytes per device of each group, one layer's dispatch buffers per device, the step's
    all-to-alls (launches from the HLO over every group; bytes in `dtype` per device of each
    group, which carries its own group's) and their time: the largest total of one group's
    tasks, and its share of the predicted step."""
    from jaxpp_integration.tools.collectives import program_collectives
    from MaxText.planning import flops as flops_of

    total, active = moe_costs.param_counts(config)
    layers_on = [0] * report.num_groups
    for s, n in enumerate(config.stage_layers):
        layers_on[report.schedule.stage_to_rank(s)] += n
    counts = program_collectives(compiled)
    per_group, bytes_per_group = [0.0] * report.num_groups, [0.0] * report.num_groups
    for t in report.tasks:
        per_group[t.group] += a2a_seconds.get(t.index, 0.0)
        bytes_per_group[t.group] += a2a_bytes.get(t.index, 0.0)
    a2a = counts["all-to-all"]
    return {
        "params_total": total,
        "params_active": active,
        "experts_per_device": config.num_experts // config.mesh_expert,
        "expert_bytes_per_device": [moe_costs.expert_bytes(config, n) for n in layers_on],
        "dispatch_bytes_per_layer": moe_costs.dispatch_bytes(config),
        "all_to_all": {
            "launches": a2a["launches"],
            "bytes": a2a["launches"] * moe_costs.all_to_all_bytes(config),  # all groups'
            "bytes_per_device": bytes_per_group,  # a device of each group
        },
        "all_to_all_s": max(per_group),
        "all_to_all_share": max(per_group) / step_time if step_time else 0.0,
        "model_flops_per_step": flops_of.training_flops_per_step(config).total,
    }


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def describe_moe(report: dict) -> str:
    """One line of `moe_report` for the printed plan."""
    a2a = report["all_to_all"]
    return (
        f"mixture of experts: {_count(report['params_total'])} parameters, "
        f"{_count(report['params_active'])} active per token; "
        f"{report['experts_per_device']} experts per device "
        f"({' / '.join(format_bytes(b) for b in report['expert_bytes_per_device'])} per group); "
        f"dispatch buffers {format_bytes(report['dispatch_bytes_per_layer'])} per layer; "
        f"all-to-all {a2a['launches']} per step over the groups "
        f"({format_bytes(max(a2a['bytes_per_device']))} per device of the busiest group), "
        f"{report['all_to_all_s']:.3f} s = {100 * report['all_to_all_share']:.1f}% of the step"
    )
