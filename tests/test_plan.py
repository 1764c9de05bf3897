"""`python -m MaxText.plan`: per-group memory and predicted time of the trainer's real step,
checked against references computed without the engine (parameter shapes from the model's own
init, Adam's two moments per weight, the schedule's bubble from the simulator's formula-checked
replay), plus the command's exit codes and JSON format."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_model import SMALL_MODEL, merged

from MaxText import plan
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder
from MaxText.planning import auto as plan_auto
from MaxText.planning import cost_model
from MaxText.planning.hardware import HARDWARE, cpu_hardware
from MaxText.planning.stage_balance import balance

BASE = [str(CONFIGS_DIR / "base.yml"), *SMALL_MODEL, "dataset_type=synthetic"]


def _config(*overrides):
    config = load_config(merged(*BASE, *overrides))
    devices.setup(**config.device_args())
    return config


def _param_bytes_per_stage(config) -> list[int]:
    """Parameter bytes of each stage from the model's init shapes and the stage split alone:
    the embedding is the first stage's, layers go by `stage_layers`, norm and head the last's."""
    shapes = jax.eval_shape(
        lambda: Decoder(config).init(
            jax.random.key(0), np.zeros((1, config.max_target_length), np.int32)
        )
    )["params"]
    bounds = np.cumsum(config.stage_layers)
    per_stage = [0] * config.num_stages
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = path[0].key
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if name.startswith("layers_"):
            stage = int(np.searchsorted(bounds, int(name.split("_")[1]), side="right"))
        elif name in ("token_embedding", "position_embedding"):
            stage = 0
        else:
            stage = config.num_stages - 1
        per_stage[stage] += nbytes
    return per_stage


@pytest.fixture(scope="module")
def pp2_plan():
    # an uneven split, so the per-stage reference below must follow `stage_layers`
    config = _config(
        "pipeline_parallelism=2", "num_pipeline_microbatches=4", "pipeline_stage_layers=1,3"
    )
    hardware = cpu_hardware(config.num_devices)
    return config, plan_auto.make_plan(config, hardware)


def test_pipelined_plan_state_bytes_match_the_model(pp2_plan):
    config, p = pp2_plan
    want = _param_bytes_per_stage(config)
    assert [g.params_bytes for g in p.groups] == want
    for g in p.groups:
        # AdamW: mu and nu per weight (float32), plus a few scalar counters
        assert 2 * g.params_bytes <= g.optimizer_bytes <= 2 * g.params_bytes + 256, g
        # one float32 gradient accumulator per weight, plus the loss/token sums
        assert g.params_bytes <= g.grad_bytes <= g.params_bytes + 256, g
        assert g.temp_bytes > 0 and g.activation_bytes >= 0
        # the peak holds at least the state and the accumulators at once
        assert g.peak_bytes >= g.params_bytes + g.optimizer_bytes + g.grad_bytes
    assert p.stage_layers == list(config.stage_layers)
    assert p.schedule == "1f1b" and p.num_microbatches == 4


def test_first_group_holds_more_activations_per_layer_than_the_last_under_1f1b(pp2_plan):
    """1F1B: stage 0 keeps p = 2 microbatches in flight, the last stage one at a time."""
    config, p = pp2_plan
    first, last = (g.activation_bytes / n for g, n in zip(p.groups, config.stage_layers))
    assert first > 1.5 * last > 0


def test_predicted_bubble_follows_the_schedule(pp2_plan):
    """1F1B on 2 stages whose second stage is the slower one (3 layers and the head against 1
    layer and the embedding): stage 1 never waits once its first forward arrives, so with
    per-microbatch costs f_s, b_s and a transfer t the loop takes
    f0 + t + m (f1 + b1) + t + b0, and the bubble is 1 - m (f0 + b0 + f1 + b1) / (2 makespan)."""
    from jaxpp_integration.schedules import Phase

    config, p = pp2_plan
    pred = p.predicted
    assert pred["step_time_s"] > 0 and 0 < pred["mfu"] < 1
    m, t = config.num_pipeline_microbatches, p.transfer_s
    (f0, b0), (f1, b1) = [
        [p.task_seconds[(ph, s)] for ph in (Phase.FWD, Phase.BWD)] for s in (0, 1)
    ]
    assert 2 * t + f0 + b0 <= f1 + b1  # the condition under which stage 1 never waits
    makespan = f0 + t + m * (f1 + b1) + t + b0
    formula = 1 - m * (f0 + b0 + f1 + b1) / (2 * makespan)
    assert pred["bubble"] == pytest.approx(formula, rel=1e-12)


def test_auto_split_is_the_best_split_under_the_measured_costs(pp2_plan):
    """`auto` balances with the costs measured on the planned split (`stage_balance.balance`, as
    `plan_auto.plan_layout` does): its slowest stage is the smallest any contiguous split
    reaches (brute force over every split)."""
    config, p = pp2_plan
    c = p.stage_costs
    assert c.seconds_per_layer > 0 and len(c.extra_seconds) == 2
    split = balance(c, config.num_decoder_layers, cpu_hardware(config.num_devices).memory_bytes)
    best = min(max(c.stage_seconds(s, n) for s, n in enumerate((k, 4 - k))) for k in range(1, 4))
    assert max(c.stage_seconds(s, n) for s, n in enumerate(split)) == pytest.approx(best)
    # 1 layer on stage 0 vs 3 on stage 1 (which also runs the head) is not balanced
    assert split != (1, 3)


def test_spmd_plan_counts_all_parameters_on_one_group():
    config = _config()
    p = plan_auto.make_plan(config, cpu_hardware(config.num_devices))
    (g,) = p.groups
    assert g.params_bytes == sum(_param_bytes_per_stage(config))
    assert 2 * g.params_bytes <= g.optimizer_bytes <= 2 * g.params_bytes + 256
    assert p.schedule == "spmd" and p.stage_layers == []


def test_command_exit_codes_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    # pp2_plan's model and split: the programs compiled are the ones that fixture compiled
    args = [*BASE, "pipeline_parallelism=2", "num_pipeline_microbatches=4"]
    args += ["pipeline_stage_layers=1,3", "--hardware", "h100"]
    assert plan.main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {
        "fits",
        "hardware",
        "stage_layers",
        "schedule",
        "num_microbatches",
        "groups",
        "predicted",
        "gradients",
    }
    assert set(data["gradients"]) == {
        "mode",
        "deferred_axes",
        "scattered_axes",
        "grad_bytes",
        "reductions",
        "in_loop_tasks",
        "reductions_per_group",
    }
    assert data["fits"] is True and data["hardware"] == "h100"
    assert set(data["predicted"]) == {"step_time_s", "bubble", "mfu"}
    assert [set(g) for g in data["groups"]] == [
        {
            "group",
            "params_bytes",
            "optimizer_bytes",
            "grad_bytes",
            "activation_bytes",
            "temp_bytes",
            "peak_bytes",
        }
    ] * 2
    capsys.readouterr()
    # 1 kB per device: nothing fits; one line per group, with a suggestion
    assert plan.main([*args, "--memory-gb", "1e-6"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("group ")]
    assert len(err) == 2 and all("per device but h100 has 1 KB (" in line for line in err)
    assert plan.main([*BASE, "pipeline_parallelism=3"]) == 2


def test_trainer_resolves_auto_schedule_microbatches_and_split(caplog):
    """The trainer's `resolve_auto`: one plan of the defaults decides schedule and microbatch
    count (logged with the runner-up), a plan of that schedule the stage split; the result is a
    validated config the trainer can build."""
    argv = [
        *BASE,
        "pipeline_parallelism=2",
        "pipeline_schedule=auto",
        "num_pipeline_microbatches=auto",
        "pipeline_stage_layers=auto",
    ]
    config = _config(*argv[1:])
    caplog.set_level("INFO", logger="MaxText")
    got = plan_auto.resolve_auto(config, cpu_hardware(config.num_devices))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("auto schedule: ") for line in lines), lines
    assert any(line.startswith("runner-up: ") for line in lines), lines
    assert any(line.startswith("pipeline_stage_layers=auto: ") for line in lines), lines
    assert not got.schedule_auto and not got.microbatches_auto
    assert got.global_batch_size % (got.num_pipeline_microbatches * got.data_parallel_devices) == 0
    assert sum(got.stage_layers) == 4 and len(got.stage_layers) == got.num_stages


PLAN_VS_MEASURED = [  # (schedule, pp, repeats, scan_layers)
    ("1f1b", 2, 1, "true"),
    ("1f1b", 2, 1, "false"),
    ("gpipe", 2, 1, "false"),
    ("eager_1f1b", 2, 1, "false"),
    ("zero_bubble", 2, 1, "false"),
    ("interleaved_1f1b", 2, 2, "false"),
    ("dualpipev", 2, 2, "false"),
    ("1f1b", 4, 1, "false"),
]


@pytest.mark.parametrize(
    "schedule,pp,repeats,scan",
    [
        pytest.param(*c, marks=[] if c == ("1f1b", 2, 1, "true") else [pytest.mark.slow])
        for c in PLAN_VS_MEASURED
    ],
    ids=[f"{s}_pp{p}_scan_{scan}" for s, p, _, scan in PLAN_VS_MEASURED],
)
def test_planned_peak_equals_measured(tmp_path, schedule, pp, repeats, scan):
    """The planned per-device peak of each group (live values, replayed statically from the
    program the planner compiles on abstract inputs: `cost_model.plan_pipelined`) against the
    device buffers measured during the trainer's real first step (`measured_train_step`, what
    the trainer logs as `peak_bytes_per_group`): equal to the byte (the replay counts exactly
    the buffers the devices hold; `benchmarks/plan_validation.py` finds the same on 24 rows).
    XLA's temporaries are not in either figure: device buffers on CPU do not show them (the
    plan adds them to `peak_bytes` from memory_analysis)."""
    from MaxText import sharding
    from MaxText.train_step import batch_shapes, build_trainer, measured_train_step

    config = _config(
        f"pipeline_parallelism={pp}",
        f"pipeline_schedule={schedule}",
        f"num_pipeline_repeats={repeats}",
        "num_pipeline_microbatches=8",
        f"scan_layers={scan}",
        f"base_output_directory={tmp_path}",
    )
    trainer = build_trainer(config, sharding.make_mesh(config, jax.devices()[: config.num_devices]))
    state = trainer.init_state()
    batch = trainer.put_batch(
        {k: np.zeros(v.shape, v.dtype) for k, v in batch_shapes(config).items()}
    )
    _, _, measured = measured_train_step(trainer, state, batch)
    assert trainer.train_step.last_device_bytes.mismatches() == []
    p = cost_model.plan_pipelined(config, cpu_hardware(config.num_devices))
    assert [g.live_peak_bytes for g in p.groups] == measured


def test_scan_counts_every_layer():
    """XLA's cost analysis counts a loop body once; the plan's FLOPs count a scan's body once per
    layer (checked on a hand count), so a scanned model's predicted step matches the unrolled
    model's (within 10 %; they are different programs) instead of looking layers x cheaper."""
    from MaxText.planning.flops import matmul_flops

    def stack(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    jaxpr = jax.make_jaxpr(stack)(jnp.zeros((5, 16, 16)), jnp.zeros((8, 16)))
    assert matmul_flops(jaxpr.jaxpr) == 5 * 2 * 8 * 16 * 16

    # compute-bound (bandwidth unlimited), so that the step time follows the FLOPs
    hardware = dataclasses.replace(HARDWARE["h100"], hbm_gbps=1e12, link_gbps=1e12)
    # The keys of test_planned_peak_equals_measured's 1f1b_pp2 rows: the programs planned here
    # are the ones compiled there (the session's compilation cache). A stage's scan counted once
    # would count one of its two layers; the difference left (scanned 7 % below unrolled, one
    # host) is the element-wise work, which XLA counts in the unrolled step but not per trip.
    times = {}
    for scanned in ("true", "false"):
        keys = ("pipeline_parallelism=2", f"scan_layers={scanned}", "num_pipeline_microbatches=8")
        times[scanned] = plan_auto.make_plan(_config(*keys), hardware).predicted["step_time_s"]
    assert abs(times["true"] / times["false"] - 1) < 0.10, times


def test_suggestions_never_ask_for_more_stages_than_layers():
    """A group whose state does not fit: more pipeline stages are suggested only while a stage
    can still get a layer of its own; otherwise fsdp alone (no compile: plans built by hand)."""

    def problem(stage_layers, num_layers):
        g = cost_model.GroupPlan(0, 600, 1200, 600, 10, 10, 2420)  # state 2400 B of 1000 B
        p = cost_model.Plan(
            fits=False,
            hardware="h100",
            stage_layers=stage_layers,
            schedule="1f1b",
            num_microbatches=4,
            groups=[g],
            predicted={},
            memory_bytes=1000,
            num_layers=num_layers,
        )
        (line,) = p.problems()
        return line.split(" (try ", 1)[1]

    assert problem([2, 2], 4) == (
        "more pipeline stages (pipeline_parallelism; at most 4 stages, one layer each) or "
        "ici_fsdp_parallelism)"
    )
    every_layer_a_stage = "ici_fsdp_parallelism (every stage already holds one of the 4 layers))"
    assert problem([1, 1, 1, 1], 4) == every_layer_a_stage
    assert problem([], 1) == "ici_fsdp_parallelism (every stage already holds one of the 1 layers))"
