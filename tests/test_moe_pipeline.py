"""Mixture of experts inside pipeline stages: the pipelined step against `jax.jit` of the same
step, the collectives of every task program, where the expert weights live, every schedule.

The model: the small trainer model (tests/small_model.py) with Mixtral's block, 4 experts, top 2,
experts 32 wide, 4 layers; global batch 16 in 4 microbatches, `load_balance_loss_weight=0.02`,
default keys otherwise (scanned layers, `gradient_reduction: auto`). The reference is `jax.jit`
of the step function on one device (the MoE block then runs every token on one device, no
shard_map and no all-to-all), from the same initial state. One reference serves every layout:
the step of pp=2's even stages ([2, 2] layers); a layout with other stages ([3, 1], or four
one-layer virtual stages) names its layers otherwise, so its state crosses to the reference's tree
and back through the checkpoints' canonical tree (every layer its own sub-tree; exact), and all
layouts start from the same initial values (the model's initialisation is the same in every
layout, `init_params`).

Tolerances of the step comparisons (tests/compare.py): the steps are compared one at a time, each
from the same input state, since float32 differences grow step after step through Adam. Within one
step the two programs compute the same values with their float32 sums in other orders (and, for
other stage layouts, in other layer scans): the gradient sums over the `expert` (and `data`) devices
are deferred and added per device first, each device runs its experts on its own rows in other
matmul shapes than one device running every token, and the microbatch partials are added per stage.
Every loss and gradient entry is a sum over at most the step's 256 tokens (global batch 16 x 16; an
expert's gradient over the token-slots routed to it, fewer), so each leaf is within Higham's
reordered-sum bound `reordered_sum_rtol(256)` of its largest magnitude, Adam's `nu` holding squares
of those sums (6.1e-5). A routing decision would flip only where a token's k-th and (k+1)-th router
probabilities are within that rounding of each other; the fixed data has none (the step's tokens per
expert, compared exactly as small integers in float32, would differ).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest
from compare import (
    assert_bitwise,
    assert_close_per_leaf,
    assert_on_group,
    host,
    reordered_sum_rtol,
)
from small_model import SMALL_MODEL_SHAPE, merged
from trainer_checks import fsdp_scatters_per_microbatch, random_batches, relayout

from jaxpp_integration.schedules.builtin import SCHEDULE_NAMES
from jaxpp_integration.tools.collectives import program_collectives, task_collectives
from MaxText import sharding
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.train_step import build_trainer, make_train_step

E, K = 4, 2
MOE = [
    *SMALL_MODEL_SHAPE,
    "decoder_block=mixtral",
    f"num_experts={E}",
    f"num_experts_per_tok={K}",
    "moe_mlp_dim=32",
    "global_batch_size=16",
    "num_pipeline_microbatches=4",
    "warmup_steps_fraction=0",
    "load_balance_loss_weight=0.02",
    "enable_progress_bar=false",
    "enable_tensorboard=false",
]
PP2_EP2 = ("pipeline_parallelism=2", "ici_expert_parallelism=2")
PP2_EP2_DATA2 = (*PP2_EP2, "ici_data_parallelism=2")
STEP_TOKENS = 16 * 16  # global_batch_size x max_target_length: the terms of a step's sums
STEP_RTOL = reordered_sum_rtol(STEP_TOKENS)  # see the module docstring


def moe_config(tmp_path, *overrides):
    return load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"), *MOE, f"base_output_directory={tmp_path}", *overrides
        )  # fmt: skip
    )


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """Builds each layout's trainer once for the whole file; `trainers.reference()` is the
    `jax.jit` reference step (pp=2 x ep=2's step function, on one device) and
    `trainers.initial()` the initial state (numpy, in that trainer's layout)."""
    root = tmp_path_factory.mktemp("moe_pipeline")
    built: dict = {}
    shared: dict = {}

    def get(*overrides):
        if overrides not in built:
            config = moe_config(root, *overrides)
            mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
            built[overrides] = (config, build_trainer(config, mesh))
        return built[overrides]

    def reference():
        if "step" not in shared:
            config, t = get(*PP2_EP2)
            shared["step"] = jax.jit(make_train_step(config, t.model, t.optimizer, t.lr_schedule))
        return shared["step"]

    def initial():
        if "state" not in shared:
            shared["state"] = host(get(*PP2_EP2)[1].init_state())
        return shared["state"]

    get.reference, get.initial = reference, initial
    return get


def initial_state(trainers, trainer):
    """The file's initial state in `trainer`'s layout, placed as its step takes it."""
    state = relayout(trainers.initial(), trainers(*PP2_EP2)[1], trainer)
    return jax.device_put(state, trainer.state_shardings)


def assert_same_step(want_state, want_metrics, state, metrics, what):
    """Per leaf within `STEP_RTOL` (the module docstring); the step counter and the tokens per
    expert (integers carried in float32) exactly."""
    for name in ("moe_tokens_per_expert_max", "moe_tokens_per_expert_mean"):
        assert metrics[name] == want_metrics[name], (what, name)
    assert_close_per_leaf(want_metrics, metrics, STEP_RTOL, f"{what} metrics ")
    assert_close_per_leaf(want_state, state, STEP_RTOL, f"{what} state ")


def run_against_jit(trainers, overrides, steps=3):
    """Steps the pipelined trainer of `overrides` `steps` times and, before each step, the
    `jax.jit` reference from the same input state (crossing to its layout and back); returns the
    pipelined metrics of every step."""
    config, trainer = trainers(*overrides)
    reference, ref_trainer = trainers.reference(), trainers(*PP2_EP2)[1]
    state, seen = host(initial_state(trainers, trainer)), []
    for i, batch in enumerate(random_batches(config, steps)):
        want_state, want_metrics = host(reference(relayout(state, trainer, ref_trainer), batch))
        want_state = relayout(want_state, ref_trainer, trainer)
        placed = jax.device_put(state, trainer.state_shardings)
        state, metrics = host(trainer.train_step(placed, trainer.put_batch(batch)))
        assert_same_step(want_state, want_metrics, state, metrics, f"step {i}")
        seen.append(metrics)
    assert int(state["step"]) == steps
    return seen


# ------------------------------------------------------------------ exact against jax.jit


@pytest.mark.parametrize("layout", [PP2_EP2, PP2_EP2_DATA2], ids=["pp2_ep2", "pp2_ep2_data2"])
def test_pipelined_moe_step_equals_jit(trainers, layout):
    """3 Adam steps at pipeline_parallelism=2 x ici_expert_parallelism=2 (x data=2), default
    keys: state and metrics (loss, gradient norms, moe_lb_loss, tokens per expert) as `jax.jit`
    of the same step on one device. The experts route: tokens per expert differ from the mean."""
    config, trainer = trainers(*layout)
    assert config.scan_layers and config.gradient_reduction == "auto"
    assert config.stage_layers == (2, 2) and config.mesh_expert == 2
    metrics = run_against_jit(trainers, layout)
    tokens = config.global_batch_size * config.max_target_length
    for m in metrics:
        assert m["moe_tokens_per_expert_mean"] == tokens * K / E
        assert m["moe_tokens_per_expert_max"] > m["moe_tokens_per_expert_mean"]
        assert 1.0 < m["moe_lb_loss"] < E  # between balanced (k) and collapsed (E)


# ------------------------------------------------------------------ collectives per task


def _layers(config, task):
    return config.stage_layers[int(task.split("_")[1])]


def test_all_to_alls_and_reductions_per_task(trainers):
    """pp=2 x ep=2 x data=2, read off every task program's HLO (per instance): each forward task
    runs 2 all-to-alls over `expert` per MoE layer (dispatch, return) and one all-reduce per layer
    of its 2 x E routing statistics over the token rows; each backward task 2 all-to-alls per
    layer and no reduction (the stage input's gradient is required: stage 0 feeds the
    embedding). No gradient is reduced inside the loop: the weights replicated over data and
    expert (attention, router, norms, embedding) and the expert weights over data are reduced
    once per step in each stage's `reduce_` task (one all-reduce over data+expert per stage). The
    expert weights' partial sums keep their expert split: each group's gradient accumulators take
    its parameters' bytes per device (plus the loss sums' scalars), not every expert's."""
    config, trainer = trainers(*PP2_EP2_DATA2)
    compiled = trainer.train_step
    counts = program_collectives(compiled)
    fwd = {t: c for t, c in counts["by_task"].items() if t.startswith("fwd_")}
    bwd = {t: c for t, c in counts["by_task"].items() if t.startswith("bwd_")}
    assert sorted(fwd) == ["fwd_0", "fwd_1"] and sorted(bwd) == ["bwd_0", "bwd_1"]
    for task, c in fwd.items():
        assert c == {"all-to-all": 2 * _layers(config, task), "all-reduce": _layers(config, task)}
    for task, c in bwd.items():
        assert c == {"all-to-all": 2 * _layers(config, task)}
    m = config.num_pipeline_microbatches
    assert task_collectives(compiled, "fwd_", "all-to-all", ("expert",)) == 2 * 4 * m
    assert task_collectives(compiled, "bwd_", "all-to-all", ("expert",)) == 2 * 4 * m
    stats = task_collectives(compiled, "fwd_", "all-reduce", ("data", "expert"))
    assert stats == 4 * m  # one per layer and microbatch: the statistics, nothing else
    by_axis = counts["by_axis"]["all-reduce"]["data+expert"]
    assert task_collectives(compiled, "bwd_", "all-reduce") == 0
    assert task_collectives(compiled, "reduce_", "all-reduce", ("data", "expert")) == 2
    assert by_axis["launches"] >= stats + 2
    choice = compiled.reduction_choice
    assert (choice.deferred_axes, choice.scattered_axes) == (("data", "expert"), ())
    from MaxText.planning import cost_model
    from MaxText.planning.hardware import cpu_hardware

    plan = cost_model.plan_compiled(config, cpu_hardware(8), compiled, trainer.abstract_state)
    for g in plan.groups:  # the partials hold one expert shard each, not every expert
        assert g.params_bytes <= g.grad_bytes <= g.params_bytes + 64, g


PP2_EP2_FSDP2 = (*PP2_EP2, "ici_fsdp_parallelism=2")


def test_moe_with_fsdp_scatters_each_layer_over_fsdp_only(trainers):
    """pp=2 x ep=2 x fsdp=2, default keys: the expert weights are split over expert and fsdp
    ([layers, E / ep, D / fsdp, F]); inside each backward task every fsdp-sharded weight's
    gradient (the experts' included) is reduce-scattered over fsdp alone, one layer at a time in
    the layer scan (issue 37), none over expert, and no all-reduce runs in the loop; the
    gradients of weights replicated over expert are deferred to the reduce_ tasks (one
    all-reduce over expert for the fsdp shards, one over fsdp+expert for the rest, per stage).
    The accumulators hold one shard per device (gradient bytes = parameter bytes). Two steps as
    `jax.jit` of the same step, each from the same state (`STEP_RTOL`)."""
    from MaxText.planning import cost_model
    from MaxText.planning.hardware import cpu_hardware

    config, trainer = trainers(*PP2_EP2_FSDP2)
    assert config.scan_layers and config.gradient_reduction == "auto"
    compiled = trainer.train_step
    choice = compiled.reduction_choice
    assert (choice.deferred_axes, choice.scattered_axes) == (("expert",), ("fsdp",))
    state = initial_state(trainers, trainer)
    wi = state["params"]["layers_stage_0"]["mlp"]["wi_0"]
    assert wi.sharding.spec[1:3] == ("expert", "fsdp"), wi.sharding.spec
    m = config.num_pipeline_microbatches
    per_microbatch = fsdp_scatters_per_microbatch(state)
    assert per_microbatch == 2 * (2 * 8 + 1)  # 8 stacked weights x 2 layers + embedding / head
    loop = lambda kind, axes=None: sum(  # noqa: E731
        task_collectives(compiled, p, kind, axes) for p in ("fwd_", "bwd_")
    )
    assert loop("reduce-scatter", ("fsdp",)) == loop("reduce-scatter") == m * per_microbatch
    assert task_collectives(compiled, "bwd_", "all-reduce") == 0
    assert task_collectives(compiled, "bwd_", "all-to-all", ("expert",)) == 2 * 4 * m
    assert task_collectives(compiled, "reduce_", "all-reduce", ("expert",)) == 2
    assert task_collectives(compiled, "reduce_", "all-reduce", ("fsdp", "expert")) == 2
    plan = cost_model.plan_compiled(config, cpu_hardware(8), compiled, trainer.abstract_state)
    for g in plan.groups:  # one shard of every weight per device, not full-size partials
        assert g.params_bytes <= g.grad_bytes <= g.params_bytes + 64, g
    run_against_jit(trainers, PP2_EP2_FSDP2, steps=2)


def test_expert_weights_live_on_their_expert_shard(trainers):
    """After a step, each stage's expert weights (and Adam moments) are on its group only, each
    device holding
    the E / ep experts of its `expert` coordinate, the same on both data replicas; the router and
    attention weights whole on every device of the group."""
    config, trainer = trainers(*PP2_EP2_DATA2)
    batch = trainer.put_batch(random_batches(config, 1)[0])
    state, _ = trainer.train_step(initial_state(trainers, trainer), batch)
    ep, per = config.mesh_expert, E // config.mesh_expert
    mesh = trainer.mpmd_mesh
    found = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        for s in range(config.num_stages):
            if f"['layers_stage_{s}']" not in name:
                continue
            assert_on_group(leaf, mesh, (s,))
            group = mesh.unstack[s]
            (array,) = leaf.arrays.values()
            for shard in array.addressable_shards:
                coords = np.argwhere(group.devices == shard.device)[0]
                j = coords[group.axis_names.index("expert")]
                if "['mlp']['wi_" in name or "['mlp']['wo']" in name:
                    assert shard.data.shape[1] == per, name  # [layers, E / ep, ...]
                    assert shard.index[1] == slice(j * per, (j + 1) * per), (name, shard.index)
                    found += 1
                else:
                    assert shard.data.shape == leaf.shape, name
    assert found == 3 * 3 * config.num_stages * 4  # params, mu, nu x 3 weights x 4 devices
    assert ep == 2


def test_full_remat_recomputes_the_dispatch(trainers):
    """remat_policy=full: each backward task recomputes the layer's forward, so it runs 4
    all-to-alls per MoE layer (the forward's 2 again, and 2 of its own); forward unchanged."""
    config, trainer = trainers(*PP2_EP2, "remat_policy=full")
    counts = program_collectives(trainer.train_step)["by_task"]
    for task in ("fwd_0", "fwd_1"):
        assert counts[task]["all-to-all"] == 2 * _layers(config, task)
    for task in ("bwd_0", "bwd_1"):
        assert counts[task]["all-to-all"] == 4 * _layers(config, task)


# ------------------------------------------------------------------ schedules and stages


SCHEDULES = {
    "gpipe": (),  # the same stage programs as 1F1B's, in another order
    "eager_1f1b": (),
    "interleaved_1f1b": ("num_pipeline_repeats=2",),  # 4 one-layer stages on 2 groups
    "zero_bubble": ("pipeline_stage_layers=3,1",),  # uneven: a boundary anywhere
    "dualpipev": ("num_pipeline_repeats=2",),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_runs_moe_stages(trainers, schedule):
    """Every built-in schedule (1F1B above) runs MoE stages at pp=2 x ep=2, stage boundaries
    anywhere between layers (3 + 1 layers; 4 one-layer virtual stages): one step as `jax.jit` of
    the same step."""
    assert {"1f1b", *SCHEDULES} == set(SCHEDULE_NAMES)
    run_against_jit(trainers, (*PP2_EP2, f"pipeline_schedule={schedule}", *SCHEDULES[schedule]),
                    steps=1)  # fmt: skip


# ------------------------------------------------------------------ the load-balancing loss


def test_router_gradient_of_the_lm_loss_alone_when_the_weight_is_0(tmp_path):
    """load_balance_loss_weight=0: the step's gradient of every router equals the gradient of the
    LM loss alone (bitwise: the load-balancing term adds exact zeros); at 0.02 the routers'
    differ while the last layer's experts, which no router sees, still get the LM gradient.
    Two layers, one device (the step's microbatch gradient, `microbatch_fn`)."""
    from MaxText.model import Decoder
    from MaxText.train_step import make_loss_fn, microbatch_fn, split_microbatches

    grads = {}
    for weight in (0.0, 0.02):
        config = moe_config(tmp_path, "num_decoder_layers=2", f"load_balance_loss_weight={weight}")
        model = Decoder(config)
        batch = random_batches(config, 1)[0]
        shapes = jax.eval_shape(model.init, jax.random.key(0), batch["inputs"][:1])["params"]
        rng = np.random.default_rng(0)  # random values without compiling an initialisation
        params = jax.tree.map(lambda s, rng=rng: rng.normal(0, 0.2, s.shape).astype(s.dtype),
                              nn.unbox(shapes))  # fmt: skip
        m = config.num_pipeline_microbatches
        mb = {k: split_microbatches(v, m)[0] for k, v in batch.items()}
        step = jax.jit(lambda p, b, mb, c=config, m=model: microbatch_fn(c, m, p, b)(mb)[2])
        grads[weight] = host(step(params, batch, mb))
    lm = jax.jit(jax.grad(lambda p, mb, m=model: make_loss_fn(m)(p, mb)[0]))(params, mb)
    lm_alone = host(lm)["layers"]["mlp"]
    with_zero, with_lb = (grads[w]["layers"]["mlp"] for w in (0.0, 0.02))
    assert_bitwise(lm_alone["gate"], with_zero["gate"], "routers")
    for layer in range(2):
        assert not np.array_equal(lm_alone["gate"][layer], with_lb["gate"][layer])
    assert_bitwise(lm_alone["wo"][1], with_lb["wo"][1], "the last layer's experts")


# ------------------------------------------------------------------ the planner


def test_planner_reads_the_moe_step(trainers):
    """The plan of the compiled pp=2 x ep=2 step (no new compile): total parameters are the
    state's, active ones that less (E - k) of every layer's experts; each group's experts take
    the bytes its devices hold; one layer's dispatch buffers are [ep, C, D + 1] twice and
    [ep, C, D] twice at C = T x min(k, E / ep); the all-to-alls are the HLO's 2 per layer and
    microbatch in each direction; the experts' counted work is the blocks kernel's padded blocks,
    its custom backward recomputing the gate and up projections (so the planner replaces it by
    the balanced routing's)."""
    from MaxText.model import moe
    from MaxText.planning import cost_model, moe_costs
    from MaxText.planning.hardware import cpu_hardware

    config, trainer = trainers(*PP2_EP2)
    plan = cost_model.plan_compiled(
        config, cpu_hardware(config.num_devices), trainer.train_step, trainer.abstract_state
    )
    report = plan.moe
    params = trainer.abstract_state["params"]
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    d, f = config.emb_dim, config.moe_mlp_dim
    assert report["params_total"] == total
    assert report["params_active"] == total - 4 * (E - K) * 3 * d * f
    expert = [0, 0]
    for s in range(2):
        for name in ("wi_0", "wi_1", "wo"):
            leaf = params[f"layers_stage_{s}"]["mlp"][name]  # [layers, E, ...] over ep devices
            expert[s] += int(np.prod(leaf.shape)) * 4 // config.mesh_expert
    assert report["expert_bytes_per_device"] == expert
    t = config.microbatch_size // config.data_parallel_devices * config.max_target_length
    c = t * min(K, E // 2)
    assert report["dispatch_bytes_per_layer"] == 2 * c * (2 * (d + 1) + 2 * d) * 4
    m = config.num_pipeline_microbatches
    assert report["all_to_all"]["launches"] == 2 * 4 * m * 2  # over both groups
    per_group = 2 * 2 * m * 2 * moe_costs.all_to_all_bytes(config)  # a device: its group's
    assert report["all_to_all"]["bytes_per_device"] == [per_group, per_group]
    assert 0 < report["all_to_all_share"] < 1 and plan.predicted["step_time_s"] > 0
    rows = 2 * c  # ep x C received slots, in blocks of B rows: ceil(rows / B) + G blocks
    block = moe.block_rows(rows, E // 2)
    blocks = -(-rows // block) + E // 2
    per_row = 2 * d * f * 2 + 2 * f * d
    counted_fwd, counted_bwd = moe_costs.counted_expert_flops(config)
    assert counted_fwd == blocks * block * per_row  # 3 matmuls per block
    assert counted_bwd == blocks * block * 8 * 2 * d * f  # 2 recomputed, 6 for the gradients


def test_per_layer_bound_of_a_moe_layer(tmp_path):
    """The planner's per-layer bound (`planning/layer_bound.py`, one layer compiled alone on one
    device) of a MoE layer at pp=2 x ep=2: its weights and their gradients are what one device of
    the group holds while the layer runs, the attention, norms and router whole and E / ep of the
    experts (here 4 x 3 x 4096 + 2 x 32 + 128, x 4 bytes); its working set includes the layer's
    dispatch buffers, which the one-device program does not have, and is the `blocks` kernel's
    whatever kernel the target runs."""
    from MaxText.planning import moe_costs
    from MaxText.planning.layer_bound import layer_bound

    config = moe_config(tmp_path, *PP2_EP2)
    d, f, heads, kv, hd = config.emb_dim, config.moe_mlp_dim, 4, 2, 8
    attention = d * heads * hd * 2 + d * kv * hd * 2  # query and out, key and value
    experts = 3 * E * d * f // config.mesh_expert
    bound = layer_bound(config, "none")
    assert bound.weight_bytes == bound.grad_bytes == 4 * (attention + 2 * d + d * E + experts)
    dispatch = moe_costs.dispatch_bytes(config)
    assert dispatch == 2 * (16 // 4 // 2 * 16 * K) * (2 * (d + 1) + 2 * d) * 4
    assert bound.working_bytes > dispatch > 0
    # planned for a GPU (moe_matmul ragged_dot), the bound still runs the blocks kernel: XLA:CPU
    # lowers ragged_dot to a masked dense matmul holding E x the rows, no GPU's working set
    assert layer_bound(config.replace(moe_matmul="ragged_dot"), "none") == bound


def test_stage_costs_weigh_each_layer_by_its_all_to_alls(trainers):
    """`pipeline_stage_layers=auto` balances on the planned cost of a layer, which includes its
    all-to-alls: planned over links 100x slower, the cost per layer grows by exactly the time of
    one layer's 4 all-to-alls (2 forward, 2 backward) per microbatch at the two link speeds."""
    import dataclasses

    from jaxpp_integration.tools.collectives import program_collectives
    from MaxText.planning import cost_model, moe_costs
    from MaxText.planning.hardware import cpu_hardware

    config, trainer = trainers(*PP2_EP2)
    fast = cpu_hardware(config.num_devices)
    slow = dataclasses.replace(fast, ici_gbps=fast.ici_gbps / 100)
    plans = [
        cost_model.plan_compiled(config, hw, trainer.train_step, trainer.abstract_state)
        for hw in (fast, slow)
    ]
    by_task = program_collectives(trainer.train_step)["by_task"]
    assert by_task["fwd_0"]["all-to-all"] == by_task["bwd_0"]["all-to-all"] == 2 * 2
    a2a = program_collectives(trainer.train_step, where=lambda code: code.name == "fwd_0")
    per_call = a2a["all-to-all"]["bytes"] / a2a["all-to-all"]["launches"]  # float32: as compiled
    assert per_call == moe_costs.all_to_all_bytes(config)
    layer = 4 * per_call  # one layer's 2 + 2 all-to-alls of one microbatch
    grown = plans[1].stage_costs.seconds_per_layer - plans[0].stage_costs.seconds_per_layer
    want = moe_costs.all_to_all_seconds(layer, 2, slow) - moe_costs.all_to_all_seconds(
        layer, 2, fast
    )
    assert grown == pytest.approx(want, rel=1e-6)
