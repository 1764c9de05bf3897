"""One configuration's plan: does it fit, per pipeline group, and how fast will it be?

`plan_pipelined` / `plan_spmd` build the trainer's real step for a config (the same
`make_train_step`, model, optimizer, shardings and schedule `train.py` uses) and compile it on
abstract inputs (`jax.ShapeDtypeStruct`s): emulated devices as needed, no parameter memory.
From the compiled program they read, per pipeline group and per device:

- parameters, optimizer state (everything else in the train state), gradient accumulators, peak
  forward activations (the schedule's in-flight microbatches, from the engine's memory events
  replayed statically: `compiled.report().memory(per_device=True, temps=True)`), XLA temporaries
  (the largest `temp_bytes` of the group's tasks) and the total peak (live values at every
  instruction plus the running task's temporaries); the in-place update (the after-loop tasks
  consume the state) is in those events;
- the predicted step time: each task of the report costs max(FLOPs / (peak x efficiency), bytes /
  HBM bandwidth) from the compiled task's cost analysis, activations cross groups at the link's
  bandwidth, and the simulator (`jaxpp_integration.schedules.simulate`) replays the schedule with
  those costs; before- and after-loop work (the optimizer) is added per group. MFU = the model
  FLOPs of `MaxText.planning.flops` / (devices x step time x peak); a mixture of experts' loop
  tasks add their all-to-alls' time, and the plan its MoE report (`MaxText.planning.moe_report`);
- the cost model the `auto` keys decide with (`Plan.stage_costs`, `Plan.baseline`).

Temporaries come from the backend that compiles the plan: on a CPU host that is XLA:CPU, a proxy
for the accelerator's compiler (usually larger: XLA:CPU reuses scratch buffers less, and overlaps
the layers of an unrolled stage). A plan for other hardware that does not fit by them is judged,
group by group, by the per-layer bound where that is smaller (`judge_temporaries`,
`MaxText.planning.layer_bound`). A `Plan` is
data (`Plan.as_json`); `MaxText.planning.auto` decides the `auto` keys from plans, `MaxText.plan` is
the command line.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from MaxText.planning.hardware import GB, Hardware, format_bytes
from MaxText.planning.moe_report import all_to_all_seconds, moe_report, task_all_to_all_bytes

log = logging.getLogger("MaxText")

# the time of a task with no work of its own (and the floor of `Hardware.task_seconds`)
NO_WORK_S = 1e-9


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Bytes per device of one pipeline group (the SPMD step is one group)."""

    group: int
    params_bytes: int
    optimizer_bytes: int
    grad_bytes: int
    activation_bytes: int
    temp_bytes: int
    peak_bytes: int
    live_peak_bytes: int = 0  # peak without XLA temporaries (what device buffers show)
    xla_temp_bytes: int = 0  # the compiler's own temporaries when the per-layer bound replaced them


@dataclasses.dataclass(frozen=True)
class Plan:
    fits: bool
    hardware: str
    stage_layers: list
    schedule: str
    num_microbatches: int
    groups: list  # of GroupPlan
    predicted: dict  # step_time_s, bubble, mfu
    memory_bytes: float = 0.0  # per device, of the hardware planned for
    stage_costs: Any = None  # stage_balance.StageCosts measured on this split (pipelined only)
    baseline: Any = None  # schedule_choice.Baseline measured on this configuration
    compared: Any = None  # the even split's Plan when this one was balanced automatically
    stage_remat: tuple = ()  # remat policy per stage
    live_microbatches: tuple = ()  # per group: microbatches (x stages) in flight at its peak
    rows_per_microbatch: float = 0.0  # one microbatch's batch rows on each device
    remat: Any = None  # remat_choice.RematChoice when remat_policy=auto chose the policies
    gradient_reduction: str = "step"
    task_seconds: dict = dataclasses.field(default_factory=dict)  # (Phase, stage) -> s
    transfer_s: float = 0.0  # one stage boundary crossing (activation or cotangent)
    num_layers: int = 0  # decoder layers: a stage holds at least one, so stages <= layers
    gradients: dict | None = None  # `gradient_communication` of the compiled step
    moe: dict | None = None  # `moe_report` of a mixture-of-experts step
    layer_bound: Any = None  # layer_bound.LayerBound when the plan was judged by it

    def as_json(self) -> dict[str, Any]:
        extra = {"gradients": self.gradients} if self.gradients is not None else {}
        if self.moe is not None:
            extra["moe"] = self.moe
        if self.layer_bound is not None:
            extra["temporaries"] = {
                "layer_bound": dataclasses.asdict(self.layer_bound),
                "layer_bound_bytes": self.layer_bound.total_bytes,
                "compiler_temp_bytes": [g.xla_temp_bytes or g.temp_bytes for g in self.groups],
            }
        hidden = ("live_peak_bytes", "xla_temp_bytes")
        return {
            **extra,
            "fits": self.fits,
            "hardware": self.hardware,
            "stage_layers": list(self.stage_layers),
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "groups": [
                {k: v for k, v in dataclasses.asdict(g).items() if k not in hidden}
                for g in self.groups
            ],
            "predicted": dict(self.predicted),
        }

    def problems(self) -> list[str]:
        return [
            f"group {g.group} needs {format_bytes(g.peak_bytes)} per device but "
            f"{self.hardware} has {format_bytes(self.memory_bytes)}" + _suggestion(g, self)
            for g in self.groups
            if g.peak_bytes > self.memory_bytes
        ]


def _suggestion(g: GroupPlan, plan: Plan) -> str:
    """What to change for group `g` that does not fit, most effective first."""
    tips = []
    if plan.gradient_reduction != "microbatch" and g.grad_bytes > 1.5 * g.params_bytes:
        tips.append(
            f"gradient_reduction=microbatch accumulates gradients sharded like the parameters "
            f"({format_bytes(g.grad_bytes)} -> about {format_bytes(g.params_bytes)})"
        )
    stages = len(plan.stage_layers) or 1
    more_stages = (
        f"more pipeline stages (pipeline_parallelism; at most {plan.num_layers} stages, one "
        f"layer each) or ici_fsdp_parallelism"
        if stages < plan.num_layers
        else f"ici_fsdp_parallelism (every stage already holds one of the {plan.num_layers} layers)"
    )
    state = g.params_bytes + g.optimizer_bytes + g.grad_bytes
    if state > plan.memory_bytes / 2:
        tips.append(more_stages)
    if g.activation_bytes + g.temp_bytes > g.peak_bytes / 3:
        remat = "remat_policy=auto or full, " if set(plan.stage_remat) != {"full"} else ""
        tips.append(
            f"{remat}more num_pipeline_microbatches (smaller microbatches) or a smaller "
            f"per_device_batch_size (activations {format_bytes(g.activation_bytes)}, temporaries "
            f"{format_bytes(g.temp_bytes)})"
        )
    return f" (try {'; '.join(tips or [more_stages])})"


# ---------------------------------------------------------------------------------- building


def _state_kind(path) -> str:
    """'params' | 'optimizer' | 'batch' for one flat step input (args are (state, batch))."""
    if path[0].idx != 0:
        return "batch"
    return "params" if getattr(path[1], "key", None) == "params" else "optimizer"


def _cost(task, hardware: Hardware, config=None) -> tuple[float, float]:
    """(FLOPs, bytes) per device of one task of the engine's report, for `hardware.task_seconds`.

    FLOPs: XLA's `cost_analysis()` counts a loop's body once, so a scanned stage would look
    `layers` times cheaper; the task's own matmul FLOPs (`report.matmul_flops`, scans counted
    per iteration, split over the devices running it) are used when larger. Bytes: XLA's bytes
    accessed (scaled like the FLOPs) when the compiling backend is the one that will run
    (`hardware.compiler_bytes`); for a preset planned elsewhere, the program's arguments and
    outputs (`memory_analysis()`), the traffic any backend must do: XLA:CPU's fusion, and so
    its traffic, says little about a GPU's. A mixture of experts' loop task counts its experts'
    work at balanced routing (`moe_costs.flops_correction`)."""
    counted = task.matmul_flops / task.devices
    if config is not None and config.is_moe and task.kind == "loop":
        from MaxText.planning import moe_costs

        layers = config.stage_layers[task.stage]
        recompute = config.stage_remat[task.stage] != "none"
        counted += moe_costs.flops_correction(config, task.phase.value, layers, recompute)
    return _roofline_inputs(
        task.flops,
        task.bytes_accessed,
        counted,
        task.argument_bytes + task.output_bytes,
        hardware,
    )


def _roofline_inputs(flops, nbytes, counted, io_bytes, hardware: Hardware):
    if counted > flops:
        nbytes *= counted / flops if flops else 1.0
        flops = counted
    if not hardware.compiler_bytes:
        nbytes = float(io_bytes)
    return flops, nbytes


def plan_pipelined(config, hardware: Hardware) -> Plan:
    import jax

    from MaxText import sharding
    from MaxText import train_step as ts
    from MaxText.model import Decoder
    from MaxText.optimizer import make_optimizer

    mesh = sharding.make_mesh(config, jax.devices()[: config.num_devices])
    model = Decoder(config)
    optimizer, lr = make_optimizer(config)
    abstract_state, specs = ts.state_specs(config, model, optimizer)
    # gradient_reduction=auto decides for the hardware planned for (this host's CPU: as the
    # trainer here would, from what the devices report)
    memory = None if hardware.name == "cpu" else hardware.memory_bytes
    fn = ts.pipelined_train_step(
        config, model, optimizer, lr, specs, sharding.make_mpmd_mesh(mesh), memory
    )
    t0 = time.perf_counter()
    with sharding.axis_rules():  # as the trainer compiles it
        compiled = fn.compile(*ts.step_inputs(config, abstract_state))  # DPO: + reference
    log.info("plan: step compiled on abstract inputs in %.1f s", time.perf_counter() - t0)
    return plan_compiled(config, hardware, compiled, abstract_state)


def plan_compiled(config, hardware: Hardware, compiled, abstract_state) -> Plan:
    """The plan read off an already compiled pipelined step (the planner's abstract one, or the
    trainer's own `trainer.train_step`), through the engine's report (`compiled.report()`)."""
    import jax

    from jaxpp_integration.schedules import Phase
    from jaxpp_integration.schedules.simulate import Costs, simulate

    report = compiled.report()
    schedule = report.schedule
    moe_b = task_all_to_all_bytes(config, compiled, report) if config.is_moe else {}
    moe_s = {i: all_to_all_seconds(config, b, hardware) for i, b in moe_b.items()}
    seconds = {
        t.index: hardware.task_seconds(*_cost(t, hardware, config)) + moe_s.get(t.index, 0.0)
        for t in report.tasks
    }
    peaks = report.memory(per_device=True, temps=True)

    n = report.num_groups
    params, opt, layer_params = [0] * n, [0] * n, [0] * n
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((abstract_state, 0))[0]][:-1]
    for path, inp in zip(paths, report.inputs):
        kind = _state_kind(path)
        in_layer = any(str(getattr(k, "key", "")).startswith("layers") for k in path)
        for r, nbytes in inp.device_bytes.items():
            if kind == "params":
                params[r] += nbytes
            elif kind == "optimizer":
                opt[r] += nbytes
            if in_layer and kind == "params":
                layer_params[r] += nbytes
    zeros = (0,) * n
    groups = []
    for r in range(n):
        group_temp = max((t.temp_bytes for t in report.tasks_of(r)), default=0)
        groups.append(
            GroupPlan(
                group=r,
                params_bytes=params[r],
                optimizer_bytes=opt[r],
                grad_bytes=peaks.peak_by_kind.get("acc", zeros)[r],
                activation_bytes=peaks.peak_activation_bytes[r],
                temp_bytes=group_temp,
                peak_bytes=peaks.peak_with_temp_bytes[r],
                live_peak_bytes=peaks.peak_bytes[r],
            )
        )

    # Step time: loop tasks through the simulator, before/after-loop work added per group.
    per_task: dict = {}
    outside = [0.0] * n
    for t in report.tasks:
        if t.kind == "loop":
            key = (t.phase, t.stage)
            per_task[key] = max(per_task.get(key, 0.0), seconds[t.index])
        else:
            outside[t.group] += seconds[t.index]
    # a stage boundary (activation forward, its gradient backward)
    transfer_bytes = max((t.device_bytes for t in report.transfers if t.from_loop), default=0)
    for stage in range(schedule.num_stages):  # a task with no work of its own (the last
        for phase in Phase:  # stage's backward folded into its forward) costs nothing
            per_task.setdefault((phase, stage), NO_WORK_S)
    costs = Costs(transfer=transfer_bytes / (hardware.link_gbps * GB), per_task=per_task or None)
    sim = simulate(schedule, config.num_pipeline_microbatches, costs)
    step_time = sim.makespan + max(outside)
    outside_temps = [
        max((t.temp_bytes for t in report.tasks_of(r) if t.kind != "loop"), default=0)
        for r in range(n)
    ]
    groups, bound = judge_temporaries(config, hardware, groups, outside_temps)
    out = _finish(config, hardware, groups, schedule, step_time, sim.bubble)
    stage_costs = _stage_costs(config, schedule, per_task, groups, layer_params)
    baseline = _baseline(config, schedule, per_task, groups, stage_costs, sim, costs, outside)
    return dataclasses.replace(
        out,
        layer_bound=bound,
        gradients=gradient_communication(compiled, groups),
        moe=moe_report(config, compiled, report, moe_b, moe_s, step_time)
        if config.is_moe
        else None,
        stage_costs=stage_costs,
        baseline=baseline,
        stage_remat=tuple(config.stage_remat),
        live_microbatches=tuple(sim.peak_live_activations),
        rows_per_microbatch=config.microbatch_size / config.data_parallel_devices,
        task_seconds=dict(per_task),
        transfer_s=costs.transfer,
    )


def judge_temporaries(config, hardware: Hardware, groups: list, outside_temps: list):
    """(groups, per-layer bound or None): when the plan does not fit by XLA:CPU's temporaries
    and is for other hardware (a GPU preset planned on a CPU host), each group whose loop
    tasks' temporaries exceed the per-layer bound (`layer_bound`, one bound per remat policy of
    the stages, the largest) is judged by the bound there: its temporaries become the larger of
    the bound and those of its tasks outside the loop (`outside_temps[g]`: before-loop work,
    the once-per-step reductions, the optimizer, which the bound does not describe), its peak
    the live peak plus those (at most the measured peak)."""
    import jax

    from MaxText.planning import layer_bound as lb

    over = any(g.peak_bytes > hardware.memory_bytes for g in groups)
    if hardware.compiler_bytes or jax.default_backend() != "cpu" or not over:
        return groups, None
    policies = sorted(set(config.stage_remat))
    bounds = {p: lb.layer_bound(config, p) for p in policies}
    bound = max(bounds.values(), key=lambda b: b.total_bytes)
    judged = []
    for g, outside in zip(groups, outside_temps):
        temp = max(lb.judged_temp(g.temp_bytes, bound), outside)
        if temp < g.temp_bytes:
            g = dataclasses.replace(
                g,
                temp_bytes=int(temp),
                peak_bytes=int(min(g.peak_bytes, g.live_peak_bytes + temp)),
                xla_temp_bytes=g.temp_bytes,
            )
        judged.append(g)
    return judged, bound


def gradient_communication(compiled, groups) -> dict:
    """What the step's `gradient_reduction` chose and costs: the mode and the axes it defers to
    once per step or reduce-scatters every microbatch, the gradient accumulator bytes per device
    of each group (`GroupPlan.grad_bytes`), and the reduction launches and bytes per device per
    step of the loop and `reduce_r` tasks by kind and mesh axes (counted in the compiled HLO,
    loops per trip; the optimizer's own reductions, e.g. the global norm, excluded), those of
    the loop tasks alone ("in_loop_tasks"), and launches and bytes per device of each group
    ("reductions_per_group": a device takes part in its own group's collectives only)."""
    from jaxpp_integration.tools.collectives import program_collectives

    choice = compiled.reduction_choice
    cache: dict = {}  # each program's HLO read once for both counts
    counts = program_collectives(
        compiled,
        where=lambda code: code.kind == "loop" or code.name.startswith("reduce_"),
        cache=cache,
    )
    in_loop = program_collectives(compiled, where=lambda code: code.kind == "loop", cache=cache)
    kinds = ("all-reduce", "reduce-scatter")
    return {
        "in_loop_tasks": {
            kind: in_loop[kind]["launches"]
            for kind in ("all-reduce", "reduce-scatter")
            if in_loop[kind]["launches"]
        },
        "mode": choice.mode,
        "deferred_axes": list(choice.deferred_axes),
        "scattered_axes": list(choice.scattered_axes),
        "grad_bytes": [g.grad_bytes for g in groups],
        "reductions": {
            kind: counts["by_axis"][kind]
            for kind in ("all-reduce", "reduce-scatter")
            if kind in counts["by_axis"]
        },
        "reductions_per_group": [
            {
                k: sum(
                    c[k] for kind, c in counts["by_group"].get(g.group, {}).items() if kind in kinds
                )
                for k in ("launches", "bytes")
            }
            for g in groups
        ],
    }


def describe_gradients(report: dict) -> str:
    """One line of `gradient_communication`'s report for the printed plan."""
    axes = []
    if report["deferred_axes"]:
        axes.append(f"deferred over {'+'.join(report['deferred_axes'])}")
    if report["scattered_axes"]:
        axes.append(f"reduce-scattered over {'+'.join(report['scattered_axes'])} every microbatch")
    launches = [
        f"{kind} {c['launches']} over {where or 'one device'} ({format_bytes(c['bytes'])})"
        for kind, by_axes in report["reductions"].items()
        for where, c in by_axes.items()
    ]
    return (
        f"gradient_reduction={report['mode']}"
        + (f" ({'; '.join(axes)})" if axes else "")
        + f": per step {', '.join(launches) or 'no reduction'}; gradients per device "
        + " / ".join(format_bytes(b) for b in report["grad_bytes"])
    )


def _baseline(config, schedule, per_task, groups, stage_costs, sim, costs, outside):
    """What `schedule_choice` needs from this plan (see its module docstring)."""
    from jaxpp_integration.schedules import Phase
    from MaxText.planning.schedule_choice import Baseline

    fwd = sum(t for (phase, _), t in per_task.items() if phase is Phase.FWD and t > NO_WORK_S)
    total = sum(t for t in per_task.values() if t > NO_WORK_S)
    layers = list(config.stage_layers)
    stages0 = [s for s in range(len(layers)) if schedule.stage_to_rank(s) == 0]
    mean0 = sum(layers[s] for s in stages0) / len(stages0)
    live0 = max(sim.peak_live_activations[0], 1)
    return Baseline(
        num_groups=len(groups),
        num_layers=config.num_decoder_layers,
        microbatches=config.num_pipeline_microbatches,
        global_batch=config.global_batch_size,
        data_parallel=config.data_parallel_devices,
        seconds_per_layer=stage_costs.seconds_per_layer,
        first_extra_s=stage_costs.extra_seconds[0],
        last_extra_s=stage_costs.extra_seconds[-1],
        fwd_fraction=fwd / total if total else 1 / 3,
        transfer_s=costs.transfer,
        outside_s=max(outside),
        activation_bytes_per_layer=groups[0].activation_bytes / (live0 * mean0),
        other_bytes=tuple(g.peak_bytes - g.activation_bytes - g.temp_bytes for g in groups),
        temp_bytes=tuple(g.temp_bytes for g in groups),
    )


def _stage_costs(config, schedule, per_task, groups, layer_params):
    """The linear per-stage cost model `stage_balance` needs, read off this split's plan."""
    from MaxText.planning.stage_balance import StageCosts

    layers = list(config.stage_layers)
    num_stages = len(layers)
    group_of = tuple(schedule.stage_to_rank(s) for s in range(num_stages))
    stage_time = [
        sum(t for (_, stage), t in per_task.items() if stage == s and t > NO_WORK_S)
        for s in range(num_stages)
    ]
    middle = range(1, num_stages - 1)
    if middle:
        per_layer = sum(stage_time[s] for s in middle) / sum(layers[s] for s in middle)
    else:  # two stages: the embedding lookup is negligible next to the first stage's layers
        per_layer = stage_time[0] / layers[0]
    extra = tuple(max(0.0, stage_time[s] - layers[s] * per_layer) for s in range(num_stages))
    layers_on = [0] * len(groups)
    for s, g in enumerate(group_of):
        layers_on[g] += layers[s]
    # What a group holds at its peak besides activations and temporaries is state (parameters,
    # optimizer state, gradient accumulators, and at an optimizer-time peak their updated
    # copies); the decoder layers' share of it, by their share of the group's parameters,
    # grows with the group's layers.
    state_per_layer = [
        (g.peak_bytes - g.activation_bytes - g.temp_bytes)
        * (layer_params[i] / g.params_bytes if g.params_bytes else 0.0)
        / layers_on[i]
        for i, g in enumerate(groups)
    ]
    act_per_layer = tuple(groups[g].activation_bytes / layers_on[g] for g in group_of)
    fixed = tuple(
        g.peak_bytes - layers_on[i] * state_per_layer[i] - g.activation_bytes
        for i, g in enumerate(groups)
    )
    state = tuple(state_per_layer[g] for g in group_of)
    return StageCosts(per_layer, extra, state, act_per_layer, fixed, group_of)


def plan_spmd(config, hardware: Hardware) -> Plan:
    import jax
    from jax.sharding import NamedSharding

    from jaxpp_integration.tools.report import matmul_flops, xla_costs
    from MaxText import sharding
    from MaxText import train_step as ts
    from MaxText.model import Decoder
    from MaxText.optimizer import make_optimizer

    mesh = sharding.make_mesh(config, jax.devices()[: config.num_devices])
    model = Decoder(config)
    optimizer, lr = make_optimizer(config)
    abstract_state, specs = ts.state_specs(config, model, optimizer)
    shardings = sharding.named_shardings(mesh, specs)
    batch_sharding = NamedSharding(mesh, sharding.batch_spec())
    step = ts.make_train_step(config, model, optimizer, lr, schedule=None)
    state_in = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    batch_in = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
        for k, v in ts.batch_shapes(config).items()
    }
    with jax.set_mesh(mesh), sharding.axis_rules():
        exe = jax.jit(step, donate_argnums=(0,)).lower(state_in, batch_in).compile()
        jaxpr = jax.make_jaxpr(step)(state_in, batch_in)

    def per_device(tree):
        return sum(
            _prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
        )

    params = per_device(state_in["params"])
    opt = per_device({k: v for k, v in state_in.items() if k != "params"})
    m = exe.memory_analysis()
    temp = int(m.temp_size_in_bytes)
    peak = int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + temp)
    # SPMD: gradients and activations live inside XLA's temporaries
    groups = [GroupPlan(0, params, opt, 0, 0, temp, peak)]
    c = xla_costs(exe)
    counted = matmul_flops(jaxpr.jaxpr) / config.num_devices
    io_bytes = c.argument_bytes + c.output_bytes
    flops, nbytes = _roofline_inputs(c.flops, c.bytes_accessed, counted, io_bytes, hardware)
    return _finish(config, hardware, groups, None, hardware.task_seconds(flops, nbytes), 0.0)


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _finish(config, hardware, groups, schedule, step_time, bubble) -> Plan:
    from MaxText.planning.flops import training_flops_per_step

    model_flops = training_flops_per_step(config).total
    mfu = model_flops / (config.num_devices * step_time * hardware.peak_tflops * 1e12)
    fits = all(g.peak_bytes <= hardware.memory_bytes for g in groups)
    return Plan(
        fits=fits,
        hardware=hardware.name,
        stage_layers=list(config.stage_layers) if config.is_pipelined else [],
        schedule=config.pipeline_schedule if schedule is not None else "spmd",
        num_microbatches=config.num_pipeline_microbatches,
        groups=groups,
        predicted={"step_time_s": step_time, "bubble": bubble, "mfu": mfu},
        memory_bytes=hardware.memory_bytes,
        stage_remat=tuple(config.stage_remat),
        gradient_reduction=config.gradient_reduction,
        num_layers=config.num_decoder_layers,
    )
