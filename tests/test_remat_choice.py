"""`remat_policy=auto`: the per-layer profile against a hand count, the choice against a brute-force
search, and the planner's predicted bytes against the compiled programs of each policy."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from small_model import SMALL_MODEL, merged

from MaxText import plan
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.planning import auto as plan_auto
from MaxText.planning import cost_model
from MaxText.planning import remat_choice as rc
from MaxText.planning.hardware import cpu_hardware

BASE = [str(CONFIGS_DIR / "base.yml"), *SMALL_MODEL, "dataset_type=synthetic"]


def _config(*overrides):
    config = load_config(merged(*BASE, *overrides))
    devices.setup(**config.device_args())
    return config


def test_layer_profile_matches_a_hand_count():
    """Matmul FLOPs of one layer's forward F (projections, MLP, the two attention products);
    without remat the gradient costs 3F (each product's two backward products), with full remat
    4F less the MLP's output projection (its result is not needed by the backward pass).
    Full remat keeps exactly the layer's input, every other policy more, `none` the most."""
    c = _config("max_target_length=16")
    L, E, M, D, hq, hkv = (
        c.max_target_length, c.emb_dim, c.mlp_dim, c.head_dim, c.num_query_heads, c.num_kv_heads
    )  # fmt: skip
    fwd = 2 * L * (E * D * (2 * hq + 2 * hkv) + 3 * E * M) + 4 * L * L * hq * D
    profile = rc.layer_profile(c)
    assert profile["none"].flops == 3 * fwd
    assert profile["full"].flops == 4 * fwd - 2 * L * M * E
    x_bytes = L * E * 4
    assert profile["full"].saved_bytes == x_bytes
    order = rc.by_recompute(profile)
    assert order[0] == "none" and order[-1] == "full"
    saved = [profile[p].saved_bytes for p in order]
    assert saved == sorted(saved, reverse=True) and len(set(saved)) == len(saved)


def _brute_force(profile, stage_layers, group_of, base, peak, act, units, memory):
    """Least total FLOPs over every assignment of policies to all stages whose predicted peaks
    all fit (None if none does)."""
    best = None
    for option in itertools.product(list(profile), repeat=len(stage_layers)):
        ok = True
        for g in range(len(peak)):
            stages = [s for s, o in enumerate(group_of) if o == g]
            delta = sum(
                stage_layers[s] * (profile[option[s]].saved_bytes - profile[base[s]].saved_bytes)
                for s in stages
            )
            ok = ok and peak[g] + units[g] * delta / len(stages) <= memory
        flops = sum(n * profile[p].flops for n, p in zip(stage_layers, option))
        if ok and (best is None or flops < best):
            best = flops
    return best


def test_choice_is_the_least_recompute_that_fits():
    rng = random.Random(0)
    names = ["none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "full"]
    for trial in range(40):
        saved = sorted(rng.sample(range(10, 1000), 5), reverse=True)
        flops = sorted(rng.sample(range(100, 200), 5))
        profile = {n: rc.PolicyCost(s, float(f)) for n, s, f in zip(names, saved, flops)}
        group_of = [0, 1, 0, 1] if trial % 2 else [0, 1, 2]
        stage_layers = [rng.randint(1, 4) for _ in group_of]
        groups = max(group_of) + 1
        base = [rng.choice(names) for _ in group_of]
        act = [rng.uniform(1e3, 1e4) for _ in range(groups)]
        peak = [a + rng.uniform(1e3, 5e3) for a in act]
        units = [rng.uniform(1, 8) for _ in range(groups)]
        memory = rng.uniform(3e3, 2e4)
        choice = rc.choose(profile, stage_layers, group_of, base, peak, act, units, memory)
        want = _brute_force(profile, stage_layers, group_of, base, peak, act, units, memory)
        got = sum(n * profile[p].flops for n, p in zip(stage_layers, choice.policies))
        assert choice.fits == (want is not None), trial
        if want is not None:
            assert got == want, (trial, choice)
            assert all(p <= memory for p in choice.peak_bytes)


def test_first_stages_get_at_least_as_much_remat_as_later_ones():
    """1F1B on 4 groups: stage s holds 4 - s microbatches; with equal bytes otherwise, earlier
    stages never recompute less than later ones, and some stage needs no remat."""
    profile = {
        "none": rc.PolicyCost(100, 3.0),
        "minimal": rc.PolicyCost(30, 3.1),
        "full": rc.PolicyCost(5, 3.8),
    }
    live = [4, 3, 2, 1]
    choice = rc.choose(
        profile, [2] * 4, [0, 1, 2, 3], ["full"] * 4, [1000.0] * 4, [40.0] * 4, live, 1500.0
    )
    order = rc.by_recompute(profile)
    rank = [order.index(p) for p in choice.policies]
    assert choice.fits and rank == sorted(rank, reverse=True) and rank[-1] == 0 and rank[0] > 0


@pytest.fixture(scope="module")
def compiled_by_policy():
    """The small model at pp=2 planned (compiled) with remat full, none and minimal."""
    config = _config("pipeline_parallelism=2", "num_pipeline_microbatches=4", "remat_policy=full")
    hardware = cpu_hardware(config.num_devices)
    plans = {}
    for policy in ("full", "none", "minimal"):
        one = config.replace(remat_policy=policy)
        plans[policy] = cost_model.plan_pipelined(one, hardware)
    return config, hardware, plans


def test_predicted_activations_match_the_compiled_programs(compiled_by_policy):
    """From the remat=full plan, each group's activation bytes under `none` and `minimal` are
    predicted within 10 % of those policies' compiled programs, and the predicted peak is not
    below the compiled one by more than 2 % (the prediction keeps full remat's temporaries,
    which are the largest here)."""
    config, _, plans = compiled_by_policy
    base = plans["full"]
    profile = rc.layer_profile(config)
    rows = config.microbatch_size / config.data_parallel_devices
    for policy in ("none", "minimal"):
        for g, (b, real) in enumerate(zip(base.groups, plans[policy].groups)):
            act = rc.predict_activation(
                b.activation_bytes,
                base.live_microbatches[g] * rows,
                [config.stage_layers[g]],
                ["full"],
                [policy],
                profile,
            )
            assert abs(act - real.activation_bytes) <= 0.10 * real.activation_bytes, (policy, g)
            peak = b.peak_bytes - b.activation_bytes + act
            assert peak >= 0.98 * real.peak_bytes, (policy, g, peak, real.peak_bytes)


def test_planner_picks_the_policy_the_compiled_programs_say_fits(compiled_by_policy):
    """A memory budget between `minimal`'s compiled peak and `none`'s: the planner (which
    compiles its choice again) picks a policy per group that fits, with no more recompute than
    `minimal`, and says so; below `full`'s peak nothing fits and the plan says that."""
    config, hardware, plans = compiled_by_policy
    peak = {p: max(g.peak_bytes for g in plans[p].groups) for p in plans}
    assert peak["minimal"] < peak["none"]
    budget = (peak["minimal"] + peak["none"]) / 2 * 1.02
    auto = config.replace(remat_policy="auto")
    got = plan_auto.plan_remat_auto(
        auto, dataclasses.replace(hardware, memory_bytes=budget), plans["full"]
    )
    profile = rc.layer_profile(config)
    assert got.fits and got.remat.fits and all(g.peak_bytes <= budget for g in got.groups)
    assert "none" not in got.stage_remat
    assert all(profile[p].flops <= profile["minimal"].flops for p in got.stage_remat)
    assert got.remat.policies == got.stage_remat
    assert "remat per stage" in plan.format_plan(got)

    tight = dataclasses.replace(
        hardware, memory_bytes=0.9 * min(g.peak_bytes for g in plans["full"].groups)
    )
    none_fit = plan_auto.plan_remat_auto(auto, tight, plans["full"])
    assert not none_fit.fits and none_fit.stage_remat == ("full", "full")
    assert "does not fit" in plan.format_plan(none_fit)


def test_trainer_resolves_remat_auto_to_typed_keys(caplog):
    """`resolve_auto` turns remat_policy=auto into pipeline_stage_remat (one policy per stage,
    logged) when pipelined and into a remat_policy without a pipeline; with this host's memory
    nothing needs recomputing."""
    argv = [*BASE, "pipeline_parallelism=2", "remat_policy=auto"]
    config = _config(*argv[1:])
    assert config.remat_auto and config.stage_remat == ("full", "full")
    caplog.set_level("INFO", logger="MaxText")
    got = plan_auto.resolve_auto(config, cpu_hardware(config.num_devices))
    assert not got.remat_auto and got.stage_remat == ("none", "none")
    assert got.pipeline_stage_remat == "none,none"
    assert any(r.getMessage().startswith("remat_policy=auto: ") for r in caplog.records)

    spmd = _config("remat_policy=auto")
    got = plan_auto.resolve_auto(spmd, cpu_hardware(1))
    assert got.remat_policy == "none" and not got.remat_auto


def test_pipeline_stage_remat_errors():
    with pytest.raises(Exception, match="one policy per stage"):
        _config("pipeline_parallelism=2", "pipeline_stage_remat=full")
    with pytest.raises(Exception, match="'nope' is not one of"):
        _config("pipeline_parallelism=2", "pipeline_stage_remat=full,nope")


@pytest.mark.slow
def test_split_and_remat_chosen_together_beat_remat_on_the_even_split(caplog):
    """`pipeline_stage_layers=auto` with `remat_policy=auto`: split and policies chosen together.

    16 scanned layers on 2 stages (stage 0 holds 2 microbatches, stage 1 one), activations
    dominating memory. A budget is taken where the cost model (`with_policy_options`) says one
    layer off stage 0 with lighter remat beats remat on the even split; then the compiled plans
    decide: the chosen split's compiled peaks fit the budget and agree with the model's
    prediction, and its predicted step is faster than the even split's with policies chosen for
    it (`plan_remat_auto`, also compiled). H100 compute with unbounded bandwidths, so that task
    times follow FLOPs as the model assumes."""
    from MaxText.planning.hardware import HARDWARE
    from MaxText.planning.stage_balance import balance_with_options

    config = _config(
        "pipeline_parallelism=2",
        "num_decoder_layers=16",
        "scan_layers=true",
        "max_target_length=512",
        "emb_dim=128",
        "mlp_dim=384",
        "num_pipeline_microbatches=4",
        "remat_policy=auto",
        "pipeline_stage_layers=auto",
    )
    hardware = dataclasses.replace(HARDWARE["h100"], hbm_gbps=1e12, link_gbps=1e12)
    base = cost_model.plan_pipelined(config, hardware)
    assert base.stage_layers == [8, 8] and base.stage_remat == ("full", "full")
    rows = config.microbatch_size / config.data_parallel_devices
    profile = rc.layer_profile(config)
    units = [live * rows for live in base.live_microbatches]
    temps = [g.temp_bytes for g in base.groups]
    costs = rc.with_policy_options(
        base.stage_costs, profile, config.stage_layers, base.stage_remat, units, temps
    )
    # at the measured split and policies the model gives the measured bytes
    measured = [g.peak_bytes for g in base.groups]
    full = [next(o for o in costs.stage_options(s) if o.policy == "full") for s in range(2)]
    assert costs.group_bytes([8, 8], full) == pytest.approx(measured, rel=1e-9)
    top, order = max(measured), rc.by_recompute(profile)

    def fastest_fitting(stage, layers, budget):
        share = budget - costs.fixed_bytes[stage]
        fits = [
            o for o in costs.stage_options(stage) if costs.stage_bytes(stage, layers, o) <= share
        ]
        return min(fits, key=lambda o: o.seconds).policy if fits else None

    for step in range(1, 60):  # the smallest budget where stage 0 moves a layer for less remat
        budget = top * (1 + 0.05 * step)
        found = balance_with_options(costs, 16, budget)
        on_even = fastest_fitting(0, 8, budget)
        if found and on_even and order.index(found.policies[0]) < order.index(on_even):
            break
    else:
        pytest.fail("the cost model never trades a layer for remat")
    assert found.split[0] < 8
    caplog.set_level("INFO", logger="MaxText")
    got = plan_auto.plan_layout(config, dataclasses.replace(hardware, memory_bytes=budget), base)
    even = got.compared
    assert even is not None and even.stage_layers == [8, 8] and even.fits
    assert got.stage_layers[0] < 8 and got.fits and all(g.peak_bytes <= budget for g in got.groups)
    # The planner's model is also calibrated on the policies compiled for the even split
    # (temporaries, activation bytes); so calibrated, its bytes for the chosen split and
    # policies against the compiled plan's: the peak not below the compiled one by more than
    # 2 %, and without temporaries within 10 %.
    by_policy = plan_auto._temp_by_policy(base, even)
    scales = rc.activation_scales(profile, [base, even])
    costs = rc.with_policy_options(
        base.stage_costs, profile, config.stage_layers, base.stage_remat, units, temps, by_policy,
        scales,
    )  # fmt: skip
    chosen = [
        next(o for o in costs.stage_options(s) if o.policy == p)
        for s, p in enumerate(got.stage_remat)
    ]
    predicted = costs.group_bytes(got.stage_layers, chosen)
    for g, n, want, option in zip(got.groups, got.stage_layers, predicted, chosen):
        assert g.peak_bytes <= 1.02 * want, (g, want)
        live = want - option.temp_bytes * max(1.0, n / option.temp_layers)
        assert abs(g.live_peak_bytes - live) <= 0.10 * g.live_peak_bytes, (g, live)
    assert got.predicted["step_time_s"] < even.predicted["step_time_s"]
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"pipeline_stage_layers=auto: {got.stage_layers}") for line in lines)
    text = plan.format_plan(got)
    assert "stage split, even vs auto:" in text and "  auto: layers " in text
