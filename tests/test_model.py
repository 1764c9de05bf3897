"""The decoder: parameter layout, logical axes, causality, stage markers, remat, scan, dtypes."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compare import assert_close_per_leaf, reordered_sum_rtol
from small_model import merged

from jaxpp_integration.frontend import marker as jaxpp_marker
from MaxText import sharding
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder, cross_entropy_sums, layers
from MaxText.train_step import CPU_INIT_COMPILER_OPTIONS

SMALL = [
    "scan_layers=false",  # the unrolled tree; scanned configs say scan_layers=true
    "emb_dim=32",
    "num_query_heads=4",
    "num_kv_heads=2",
    "head_dim=8",
    "mlp_dim=64",
    "num_decoder_layers=2",
    "vocab_size=64",
    "max_target_length=16",
    "max_prefill_predict_length=4",
    "max_predict_length=16",
]


GPT = ("decoder_block=gpt", "logits_via_embedding=true")


@functools.cache
def small_config(*overrides: str):
    return load_config(merged(str(CONFIGS_DIR / "base.yml"), *SMALL, *overrides))


def tokens(config, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(
        rng.integers(0, config.vocab_size, (batch, config.max_target_length)), jnp.int32
    )


# Compiles are the cost of these tests: initialise and jit each config's forward pass once.
@functools.cache
def init(config, seed=0):
    model = Decoder(config)
    args = (jax.random.key(seed), tokens(config))
    options = CPU_INIT_COMPILER_OPTIONS if jax.devices()[0].platform == "cpu" else {}
    boxed = jax.jit(model.init).lower(*args).compile(compiler_options=options)(*args)["params"]
    return model, boxed


@functools.cache
def _jitted_apply(config):
    return jax.jit(Decoder(config).apply)


def apply(model, params, x):
    return _jitted_apply(model.config)({"params": params}, x)


def test_llama_parameter_tree_and_logical_axes():
    config = small_config()
    _, boxed = init(config)
    specs = nn.get_partition_spec(boxed)
    params = nn.unbox(boxed)
    assert set(params) == {
        "token_embedding",
        "layers_0",
        "layers_1",
        "decoder_norm",
        "logits_kernel",
    }
    attn = params["layers_0"]["self_attention"]
    assert attn["query_kernel"].shape == (32, 4, 8)
    assert attn["key_kernel"].shape == attn["value_kernel"].shape == (32, 2, 8)  # GQA
    assert attn["out_kernel"].shape == (4, 8, 32)
    mlp = params["layers_0"]["mlp"]
    assert set(mlp) == {"wi_0", "wi_1", "wo"}  # SwiGLU
    assert specs["token_embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
    assert specs["layers_0"]["self_attention"]["key_kernel"] == jax.sharding.PartitionSpec(
        "embed", "kv_heads", "kv"
    )
    mesh_specs = sharding.logical_to_specs(specs)
    assert mesh_specs["layers_0"]["mlp"]["wi_0"] == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert mesh_specs["logits_kernel"] == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert mesh_specs["decoder_norm"]["scale"] == jax.sharding.PartitionSpec(None)


def test_gpt_block_and_tied_head():
    config = small_config(*GPT)
    model, boxed = init(config)
    params = nn.unbox(boxed)
    assert "position_embedding" in params and "logits_kernel" not in params
    assert set(params["layers_0"]["mlp"]) == {"wi", "wi_bias", "wo", "wo_bias"}
    assert set(params["decoder_norm"]) == {"scale", "bias"}  # LayerNorm
    logits = apply(model, params, tokens(config))
    assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32


@pytest.mark.parametrize("overrides", [(), GPT], ids=["llama", "gpt-tied"])
def test_causal(overrides):
    config = small_config(*overrides)
    model, boxed = init(config)
    params = nn.unbox(boxed)
    x = tokens(config)
    y = x.at[:, 9].set((x[:, 9] + 1) % config.vocab_size)
    a, b = apply(model, params, x), apply(model, params, y)
    np.testing.assert_array_equal(np.asarray(a[:, :9]), np.asarray(b[:, :9]))
    assert not np.allclose(np.asarray(a[:, 9:]), np.asarray(b[:, 9:]))


def test_initial_loss_is_near_uniform():
    config = small_config()
    model, boxed = init(config)
    x = tokens(config)
    loss_sum, count = cross_entropy_sums(apply(model, nn.unbox(boxed), x), x, jnp.ones(x.shape))
    assert count == x.size
    assert abs(float(loss_sum / count) - np.log(config.vocab_size)) < 1.0


def test_cross_entropy_sums_by_hand():
    logits = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))
    targets = jnp.asarray([[0, 1]])
    loss, count = cross_entropy_sums(logits, targets, jnp.asarray([[1.0, 0.0]]))
    # float32: a log-softmax over 3 entries and a sum of 2 terms, each rounded once: a few ulps
    # of ~0.7 (6e-8 each)
    assert float(count) == 1.0 and abs(float(loss) - np.log(2.0)) < 1e-6
    loss, count = cross_entropy_sums(logits, targets, jnp.ones((1, 2)))
    assert abs(float(loss) - (np.log(2.0) - np.log(0.8))) < 1e-6


def abstract_params(config):
    """Parameter shapes only: tracing tests need no compiled init."""
    model = Decoder(config)
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens(config))["params"]
    return model, nn.unbox(boxed)


def _top_level_markers(config):
    """Stage ids of the markers bound at the top level of the traced forward pass."""
    model, params = abstract_params(config)
    x = tokens(config)
    with jaxpp_marker.stage_counting():
        jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)
    top = [e.params["stage_id"] for e in jaxpr.jaxpr.eqns if jaxpp_marker.is_marker(e)]
    nested = []

    def walk(eqns):
        for e in eqns:
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                nested.extend(x for x in sub.eqns if jaxpp_marker.is_marker(x))
                walk(sub.eqns)

    walk(jaxpr.jaxpr.eqns)
    return top, nested


@pytest.mark.parametrize("remat", ["none", "full"])
def test_stage_markers_between_stages_at_top_level(remat):
    config = small_config("pipeline_parallelism=4", "num_decoder_layers=7", f"remat_policy={remat}")
    top, nested = _top_level_markers(config)
    assert top == [0, 1, 2] and not nested  # one marker after each stage but the last


def test_marker_positions(monkeypatch):
    """Markers follow layers 1, 3 and 5 for stage_layers (2, 2, 2, 1)."""
    config = small_config("pipeline_parallelism=4", "num_decoder_layers=7")
    assert config.stage_layers == (2, 2, 2, 1)
    events = []

    def record(next_fun, args, kwargs, context):
        if (
            context.method_name == "__call__"
            and context.module.name
            and context.module.name.startswith("layers_")
        ):
            events.append(context.module.name)
        return next_fun(*args, **kwargs)

    import MaxText.model.decoder as model_module

    def marker(x, name=None):
        events.append("|")
        return x

    monkeypatch.setattr(model_module.jaxpp, "pipeline_enter_stage", marker)
    model, params = abstract_params(config)
    events.clear()  # init traced the model once already
    with nn.intercept_methods(record):
        jax.eval_shape(lambda p: model.apply({"params": p}, tokens(config)), params)
    assert (
        " ".join(events) == "layers_0 layers_1 | layers_2 layers_3 | layers_4 layers_5 | layers_6"
    )


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_stages_are_one_scan_each_with_markers_between(remat):
    """scan_layers=true, 7 layers on 4 stages (2, 2, 2, 1): the top level of the forward pass is
    scan, marker, scan, marker, scan, marker, scan; each scan runs its stage's layers over a
    `layers_stage_<s>` stack; no marker inside a scan; remat (jax's `remat2` equation, i.e.
    `jax.checkpoint`) sits inside the scan body."""
    config = small_config(
        "scan_layers=true",
        "pipeline_parallelism=4",
        "num_decoder_layers=7",
        f"remat_policy={remat}",
    )
    model, params = abstract_params(config)
    assert {k: params[k]["mlp"]["wo"].shape[0] for k in params if k.startswith("layers")} == {
        "layers_stage_0": 2, "layers_stage_1": 2, "layers_stage_2": 2, "layers_stage_3": 1,
    }  # fmt: skip
    x = tokens(config)
    with jaxpp_marker.stage_counting():
        jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)
    kinds = [
        "|" if jaxpp_marker.is_marker(e) else f"scan{e.params['length']}"
        for e in jaxpr.jaxpr.eqns
        if jaxpp_marker.is_marker(e) or e.primitive.name == "scan"
    ]
    assert " ".join(kinds) == "scan2 | scan2 | scan2 | scan1"
    top, nested = _top_level_markers(config)
    assert top == [0, 1, 2] and not nested
    bodies = [e.params["jaxpr"].jaxpr for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    has_remat = ["remat2" in {q.primitive.name for q in b.eqns} for b in bodies]
    assert has_remat == [remat == "full"] * 4


def test_pipeline_stage_remat_sets_each_stage_scan_policy():
    """pipeline_stage_remat=full,none,minimal,none: remat (`remat2`) inside the scans of stages
    0 and 2 only; unrolled, the layers of those stages are the rematerialised class."""
    keys = (
        "pipeline_parallelism=4",
        "num_decoder_layers=7",
        "pipeline_stage_remat=full,none,minimal,none",
    )
    config = small_config("scan_layers=true", *keys)
    model, params = abstract_params(config)
    with jaxpp_marker.stage_counting():
        jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens(config)))(params)
    bodies = [e.params["jaxpr"].jaxpr for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert ["remat2" in {q.primitive.name for q in b.eqns} for b in bodies] == [
        True, False, True, False
    ]  # fmt: skip
    unrolled = small_config(*keys)
    remat = [layers.layer_class(unrolled, stage=s) is not layers.DecoderLayer for s in range(4)]
    assert remat == [True, False, True, False]


def test_no_markers_without_pipeline():
    top, nested = _top_level_markers(small_config())
    assert top == [] and nested == []


@functools.cache
def _base_loss_and_grads():
    config = small_config()
    return _loss_and_grads(config, nn.unbox(init(config)[1]))


def _loss_and_grads(config, params):
    model = Decoder(config)
    x = tokens(config)

    def loss(p):
        s, c = cross_entropy_sums(model.apply({"params": p}, x), x, jnp.ones(x.shape))
        return s / c

    return jax.jit(jax.value_and_grad(loss))(params)


def test_every_remat_policy_builds():
    for name in ("full", "minimal", "save_qkv_proj", "save_dot_except_mlp"):
        assert layers.layer_class(small_config(f"remat_policy={name}")) is not layers.DecoderLayer
    assert layers.layer_class(small_config()) is layers.DecoderLayer


@pytest.mark.parametrize("policy", ["full", "minimal"])
def test_remat_policies_do_not_change_numbers(policy):
    params = nn.unbox(init(small_config())[1])
    loss0, grads0 = _base_loss_and_grads()
    loss1, grads1 = _loss_and_grads(small_config(f"remat_policy={policy}"), params)
    # Recomputation repeats the same float32 ops; XLA may fuse them differently, adding the
    # loss and each gradient entry, sums over the batch's 2 x 16 tokens, in another order
    # (`reordered_sum_rtol`, tests/compare.py): per leaf.
    rtol = reordered_sum_rtol(2 * 16, squared=False)
    assert_close_per_leaf((loss0, grads0), (loss1, grads1), rtol=rtol)


def test_scan_layers_matches_unrolled():
    unrolled = small_config()
    scanned = small_config("scan_layers=true")
    params = nn.unbox(init(unrolled)[1])
    stacked = {k: v for k, v in params.items() if not k.startswith("layers_")}
    stacked["layers"] = jax.tree.map(
        lambda *xs: jnp.stack(xs),
        *[params[f"layers_{i}"] for i in range(unrolled.num_decoder_layers)],
    )
    shapes = jax.tree.map(jnp.shape, abstract_params(scanned)[1])
    assert shapes == jax.tree.map(jnp.shape, stacked)
    x = tokens(unrolled)
    a = apply(Decoder(unrolled), params, x)
    b = apply(Decoder(scanned), stacked, x)
    # the loop body may be fused differently from an unrolled layer: dot products of at most
    # mlp_dim = 64 terms in another order (`reordered_sum_rtol`, tests/compare.py)
    assert_close_per_leaf(a, b, rtol=reordered_sum_rtol(64, squared=False))


def test_bfloat16_compute_keeps_f32_weights_and_logits():
    config = small_config("dtype=bfloat16")
    params = abstract_params(config)[1]  # weight_dtype=float32: stored in float32
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    params = nn.unbox(init(small_config())[1])  # same tree: reuse the float32 model's values
    logits = apply(Decoder(config), params, tokens(config))
    assert logits.dtype == jnp.float32
    f32 = apply(Decoder(small_config()), params, tokens(config))
    assert float(jnp.max(jnp.abs(logits - f32))) < 0.1  # same model, bf16 rounding only
    assert layers.dtype_of("bfloat16") == jnp.bfloat16
