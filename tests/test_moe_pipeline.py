"""Mixture of experts inside pipeline stages: the pipelined step against `jax.jit` of the same
step, the collectives of every task program, where the expert weights live, every schedule.

The model: the small trainer model (tests/small_model.py) with Mixtral's block, 4 experts, top 2,
experts 32 wide, 4 layers; global batch 16 in 4 microbatches, `load_balance_loss_weight=0.02`,
default keys otherwise (scanned layers, `gradient_reduction: auto`). The reference is `jax.jit`
of the very same step function on one device (the MoE block then runs every token on one device,
no shard_map and no all-to-all), from the same initial state.

Tolerances of the step comparisons, per leaf (of its largest magnitude), reasoned from what
differs: the order of float32 additions. The gradient sums over the `expert` (and `data`) devices
are deferred and added per device first, and each device runs its experts on its own rows, in
other matmul shapes than one device running every token (XLA:CPU picks kernels and blockings by
shape, so each row's dot products may round differently). Measured on this host over 3 steps:
metrics 1.2e-7 (a few ulps: bound 1e-6); parameters 5.9e-7 (bound 2e-6), except the token
embedding, 6.7e-6 (bound 3e-5): some of its gradient entries are sums of many tokens'
contributions that nearly cancel, and Adam divides each entry by its own running magnitude, so
their relative rounding becomes a relative update difference (the data-parallel tests bound it at
2e-6 after 2 steps, tests/test_collectives_trainer.py); Adam's moments 1.3e-5 (bound 5e-5): they
hold those per-entry gradients and their squares. Bounds are ~4x the measurements for other
CPUs' code generation. A routing decision would flip only where a token's k-th and (k+1)-th
router probabilities are within that rounding (~1e-7) of each other; the fixed data has none
(the metrics' tokens per expert would differ).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest
from compare import assert_bitwise, assert_close_per_leaf, assert_on_group
from small_model import SMALL_MODEL_SHAPE, merged

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
METRICS_RTOL, PARAMS_RTOL, EMBEDDING_RTOL, MOMENTS_RTOL = 1e-6, 2e-6, 3e-5, 5e-5


def moe_config(tmp_path, *overrides):
    return load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"), *MOE, f"base_output_directory={tmp_path}", *overrides
        )  # fmt: skip
    )


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """Builds each layout's trainer once for the whole file."""
    root = tmp_path_factory.mktemp("moe_pipeline")
    built: dict = {}

    def get(*overrides):
        if overrides not in built:
            config = moe_config(root, *overrides)
            mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
            built[overrides] = (config, build_trainer(config, mesh))
        return built[overrides]

    return get


def batches(config, n, seed=0):
    rng = np.random.default_rng(seed)
    b, length = config.global_batch_size, config.max_target_length
    out = []
    for _ in range(n):
        x = rng.integers(0, config.vocab_size, (b, length + 1)).astype(np.int32)
        mask = (rng.random((b, length)) > 0.2).astype(np.float32)
        out.append({"inputs": x[:, :-1], "targets": x[:, 1:], "targets_mask": mask})
    return out


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_same_step(want_state, want_metrics, state, metrics, what):
    """The per-leaf bounds of the module docstring."""
    assert_close_per_leaf(want_metrics, metrics, METRICS_RTOL, f"{what} metrics ")
    params, want_params = dict(state["params"]), dict(want_state["params"])
    embedding, want_embedding = params.pop("token_embedding"), want_params.pop("token_embedding")
    assert_close_per_leaf(want_params, params, PARAMS_RTOL, f"{what} params ")
    assert_close_per_leaf(want_embedding, embedding, EMBEDDING_RTOL, f"{what} embedding ")
    assert_close_per_leaf(want_state["opt_state"], state["opt_state"], MOMENTS_RTOL, f"{what} ")
    assert_close_per_leaf(want_state["step"], state["step"], 0.0, f"{what} step ")


def run_against_jit(config, trainer, steps=3):
    """Steps the pipelined trainer and `jax.jit` of its step function side by side; returns the
    pipelined state and the metrics of every step."""
    reference = jax.jit(
        make_train_step(config, trainer.model, trainer.optimizer, trainer.lr_schedule)
    )
    state = trainer.init_state()
    want_state = host(state)
    seen = []
    for i, batch in enumerate(batches(config, steps)):
        state, metrics = trainer.train_step(state, trainer.put_batch(batch))
        want_state, want_metrics = reference(want_state, batch)
        assert_same_step(want_state, host(want_metrics), host(state), host(metrics), f"step {i}")
        seen.append(host(metrics))
    return state, seen


# ------------------------------------------------------------------ exact against jax.jit


@pytest.mark.parametrize("layout", [PP2_EP2, PP2_EP2_DATA2], ids=["pp2_ep2", "pp2_ep2_data2"])
def test_pipelined_moe_step_equals_jit(trainers, layout):
    """3 Adam steps at pipeline_parallelism=2 x ici_expert_parallelism=2 (x data=2), default
    keys: state and metrics (loss, gradient norms, moe_lb_loss, tokens per expert) as `jax.jit`
    of the same step on one device. The experts route: tokens per expert differ from the mean."""
    config, trainer = trainers(*layout)
    assert config.scan_layers and config.gradient_reduction == "auto"
    assert config.stage_layers == (2, 2) and config.mesh_expert == 2
    _, metrics = run_against_jit(config, trainer)
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


def test_expert_weights_live_on_their_expert_shard(trainers):
    """After a step, each stage's expert weights (and Adam moments) are on its group only, each
    device holding
    the E / ep experts of its `expert` coordinate, the same on both data replicas; the router and
    attention weights whole on every device of the group."""
    config, trainer = trainers(*PP2_EP2_DATA2)
    state, _ = trainer.train_step(trainer.init_state(), trainer.put_batch(batches(config, 1)[0]))
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
    config, trainer = trainers(*PP2_EP2, f"pipeline_schedule={schedule}", *SCHEDULES[schedule])
    run_against_jit(config, trainer, steps=1)


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
        batch = batches(config, 1)[0]
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
    assert report["all_to_all"]["launches"] == 2 * 4 * m * 2
    assert 0 < report["all_to_all_share"] < 1 and plan.predicted["step_time_s"] > 0
    rows = 2 * c  # ep x C received slots, in blocks of B rows: ceil(rows / B) + G blocks
    block = moe.block_rows(rows, E // 2)
    blocks = -(-rows // block) + E // 2
    per_row = 2 * d * f * 2 + 2 * f * d
    counted_fwd, counted_bwd = moe_costs.counted_expert_flops(config)
    assert counted_fwd == blocks * block * per_row  # 3 matmuls per block
    assert counted_bwd == blocks * block * 8 * 2 * d * f  # 2 recomputed, 6 for the gradients


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
