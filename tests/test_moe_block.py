"""The MoE block (`MaxText/model/moe.py`) against a float64 numpy reference written here from
the published formulas (Mixtral / Qwen3-MoE: softmax over all experts -> top-k -> renormalise
-> sum of weighted SwiGLU experts), on one device and split over expert / data / fsdp / tensor
axes of emulated devices.

Fixtures assert a margin of at least 1e-3 between the k-th and (k+1)-th router probability of
every token, so float32 against float64 cannot flip a routing decision.

Tolerances (tests/compare.py), per leaf of its largest magnitude, reasoned: a float32 result here
is made of chained sums, each within (n-1)u of its terms' magnitudes in whatever order it is
evaluated (Higham's bound, u = 2^-24), first-order errors adding along the chain: the router's
D-term logits, the softmax's E-term normaliser, the k-term renormaliser, the experts' D-term and
F-term dot products and the k-term combine; a weight gradient adds a sum over the B x L tokens.
`RTOL` is `reordered_sum_rtol` of all those terms, (n-1) EPS32 = 2(n-1)u: twice the float32
against float64 bound, and the bound of two float32 orders (split layouts compute every slot's
rows with the same formulas in other block shapes and sum the partial weight gradients in
another order, so they are held to it against the unsplit block). Gradients are checked against
central differences of the float64 reference along a fixed random direction, per parameter leaf:
`RTOL` of the directional derivative's terms' magnitudes, plus 1e-9 for the difference itself
(step 1e-5: truncation ~1e-10 and float64 cancellation ~1e-16 x |loss| / 1e-5 ~ 1e-10).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compare import assert_close_per_leaf, reordered_sum_rtol
from small_model import merged

from jaxpp_integration.tools.collectives import hlo_collectives
from MaxText import sharding
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import moe

E, K, D, F = 8, 2, 16, 32
B, L = 4, 8
RTOL = reordered_sum_rtol(D + E + K + D + F + K + B * L, squared=False)  # 1.3e-5
MARGIN = 1e-3


def _config(*extra):
    return load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"),
            "decoder_block=mixtral",
            f"num_experts={E}",
            f"num_experts_per_tok={K}",
            f"emb_dim={D}",
            f"moe_mlp_dim={F}",
            "norm_topk_prob=true",  # Mixtral's format implies it
            "moe_matmul=blocks",
            *extra,
        )
    )


# ------------------------------------------------------------------ the float64 reference


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _silu(z):
    return z / (1.0 + np.exp(-z))


def reference(params, x, k=K, normalize=True):
    """(output [B, L, D], probs [T, E], top-k ids [T, k]) in float64."""
    p = {n: np.asarray(v, np.float64) for n, v in params.items()}
    x = np.asarray(x, np.float64)
    t = x.reshape(-1, D)
    probs = _softmax(t @ p["gate"])
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        w = w / w.sum(axis=-1, keepdims=True)
    out = np.zeros_like(t)
    for j in range(k):
        e = ids[:, j]
        gate = np.einsum("td,tdf->tf", t, p["wi_0"][e])
        up = np.einsum("td,tdf->tf", t, p["wi_1"][e])
        out += w[:, j : j + 1] * np.einsum("tf,tfd->td", _silu(gate) * up, p["wo"][e])
    return out.reshape(x.shape), probs, ids


def _margin(probs, k=K):
    top = -np.sort(-probs, axis=-1)
    return float(np.min(top[:, k - 1] - top[:, k]))


@pytest.fixture(scope="module")
def case():
    """Parameters and tokens whose routing has a margin >= 1e-3 for every token."""
    for seed in range(100):
        rng = np.random.default_rng(seed)
        params = {
            "gate": rng.normal(size=(D, E)) * 0.5,
            "wi_0": rng.normal(size=(E, D, F)) / np.sqrt(D),
            "wi_1": rng.normal(size=(E, D, F)) / np.sqrt(D),
            "wo": rng.normal(size=(E, F, D)) / np.sqrt(F),
        }
        x = rng.normal(size=(B, L, D))
        _, probs, _ = reference(params, x)
        if _margin(probs) >= MARGIN:
            f32 = {n: jnp.asarray(v, jnp.float32) for n, v in params.items()}
            return params, f32, jnp.asarray(x, jnp.float32)
    raise AssertionError("no seed below 100 gives a routing margin of 1e-3")


def _apply(config, params, x):
    return moe.MoeBlock(config).apply({"params": params}, x)


def _loss(config, cotangent, params, x):
    y, _ = _apply(config, params, x)
    return jnp.sum(y * cotangent)


# ------------------------------------------------------------------ one device


@pytest.mark.parametrize("matmul", ["blocks", "ragged_dot"])
def test_block_equals_float64_reference(case, matmul):
    params64, params, x = case
    y, stats = jax.jit(functools.partial(_apply, _config(f"moe_matmul={matmul}")))(params, x)
    want, probs, ids = reference(params64, x)
    assert _margin(probs) >= MARGIN
    assert_close_per_leaf(want, np.asarray(y), RTOL, f"moe_matmul={matmul}")
    counts = np.bincount(ids.reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(stats[0]), counts)  # exact small integers
    assert_close_per_leaf(probs.sum(axis=0), np.asarray(stats[1]), RTOL, "probability sums")


def test_norm_topk_prob_only_when_asked(case):
    """Without `norm_topk_prob` (Qwen3-MoE's flag off) the routing weights are the raw top-k
    probabilities; with it (and always in Mixtral's format) they are divided by their sum."""
    params64, params, x = case
    raw = _config("decoder_block=qwen3_moe", "norm_topk_prob=false")
    y_raw, _ = jax.jit(functools.partial(_apply, raw))(params, x)
    assert_close_per_leaf(reference(params64, x, normalize=False)[0], np.asarray(y_raw), RTOL)
    normed = _config("decoder_block=qwen3_moe", "norm_topk_prob=true")
    y_norm, _ = jax.jit(functools.partial(_apply, normed))(params, x)
    assert_close_per_leaf(reference(params64, x)[0], np.asarray(y_norm), RTOL)


def test_gradients_match_central_differences(case):
    """d(sum(y * c))/d(each parameter leaf and x) along a random direction, against the float64
    reference's central difference."""
    params64, params, x = case
    rng = np.random.default_rng(1)
    c = rng.normal(size=(B, L, D))
    grads = jax.jit(jax.grad(functools.partial(_loss, _config(), jnp.asarray(c, jnp.float32)),
                             argnums=(0, 1)))(params, x)  # fmt: skip
    eps = 1e-5
    x64 = np.asarray(x, np.float64)
    for name in [*params64, "x"]:
        target = x64 if name == "x" else params64[name]
        v = rng.normal(size=target.shape)
        g = np.asarray(grads[1] if name == "x" else grads[0][name], np.float64)

        def at(sign, name=name, v=v):
            p = dict(params64)
            xx = x64
            if name == "x":
                xx = x64 + sign * eps * v
            else:
                p[name] = params64[name] + sign * eps * v
            out, probs, _ = reference(p, xx)
            assert _margin(probs) >= MARGIN / 2  # the step does not change the routing
            return float(np.sum(out * c))

        numeric = (at(1) - at(-1)) / (2 * eps)
        analytic = float(np.sum(g * v))
        bound = RTOL * float(np.sum(np.abs(g * v))) + 1e-9
        assert abs(analytic - numeric) <= bound, (name, analytic, numeric, bound)


def test_expert_ffn_blocks_edge_cases():
    """Empty groups, a group larger than a block, rows past the groups (zero), any block size:
    equal to each row through its own expert."""
    rng = np.random.default_rng(2)
    groups, d, f = 5, 4, 6
    sizes = np.array([0, 13, 1, 0, 7])
    rows = 25  # 21 in groups, 4 past them
    x = rng.normal(size=(rows, d)).astype(np.float32)
    wg, wu = (rng.normal(size=(groups, d, f)).astype(np.float32) for _ in range(2))
    wd = rng.normal(size=(groups, f, d)).astype(np.float32)
    group_of_row = np.repeat(np.arange(groups), sizes)
    want = np.zeros((rows, d))
    for r, g in enumerate(group_of_row):
        xr = x[r].astype(np.float64)
        want[r] = (_silu(xr @ wg[g]) * (xr @ wu[g])) @ wd[g]
    for block in (1, 4, 8, 64):
        args = [jnp.asarray(a) for a in (x, sizes, wg, wu, wd)]
        got = moe.expert_ffn(*args, "blocks", block)
        assert_close_per_leaf(want, np.asarray(got), RTOL, f"block={block}")
        assert not np.asarray(got)[21:].any()


def test_load_balance_loss_definition():
    """E * sum_i f_i P_i with f_i = slots to i / T (summing to k) and P_i the mean probability,
    pooled over the layers given; balanced routing gives k, everything on k experts gives E."""
    rng = np.random.default_rng(3)
    layers = [rng.normal(size=(10, E)) for _ in range(3)]
    stats = 0
    for logits in layers:
        _, ids, probs = moe.route(jnp.asarray(logits, jnp.float32), K, True)
        stats = stats + moe.routing_stats(probs, ids)
    got = float(moe.load_balance_loss(stats, 10 * len(layers)))
    pooled = np.concatenate(layers)  # Hugging Face: every layer's logits concatenated
    probs = _softmax(pooled)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :K]
    f = np.bincount(ids.reshape(-1), minlength=E) / len(pooled)
    assert abs(f.sum() - K) < 1e-12
    want = E * np.sum(f * probs.mean(axis=0))
    # float32 terms: each P_i a mean of 30 probabilities, each through a softmax's E-term sum,
    # then the E-term sum of f_i P_i (the f_i are exact counts over 30)
    assert abs(got - want) <= reordered_sum_rtol(30 + E + E, squared=False) * want
    balanced = jnp.stack([jnp.full(E, K * 4.0), jnp.full(E, 4.0)])  # T = 4 E tokens
    assert float(moe.load_balance_loss(balanced, 4 * E)) == pytest.approx(K, rel=1e-6)
    two = jnp.array([1.0, 1.0] + [0.0] * (E - 2))
    skewed = jnp.stack([16.0 * two, 8.0 * two])  # 16 tokens, all on experts 0 and 1
    assert float(moe.load_balance_loss(skewed, 16)) == pytest.approx(E, rel=1e-6)


# ------------------------------------------------------------------ split over devices


LAYOUTS = {
    "data2_expert2": ("ici_data_parallelism=2", "ici_expert_parallelism=2"),
    "expert4": ("ici_expert_parallelism=4",),
    "fsdp2_tensor2_expert2": (
        "ici_fsdp_parallelism=2",
        "ici_tensor_parallelism=2",
        "ici_expert_parallelism=2",
    ),
}


def _split_run(config, params, x, cotangent):
    """(output, stats, gradients, compiled text) of the block under `config`'s mesh and rules,
    parameters laid out by their logical axes."""
    mesh = sharding.make_mesh(config, jax.devices()[: config.num_devices])
    boxed = jax.eval_shape(lambda: moe.MoeBlock(config).init(jax.random.key(0), x))["params"]
    specs = sharding.logical_to_specs(nn.get_partition_spec(boxed))
    placed = jax.device_put(params, sharding.named_shardings(mesh, specs))
    rows = jax.sharding.NamedSharding(mesh, sharding.batch_spec())

    def step(p, xx):
        (y, stats), vjp = jax.vjp(lambda p, xx: _apply(config, p, xx), p, xx)
        return y, stats, vjp((cotangent, jnp.zeros_like(stats)))

    with jax.set_mesh(mesh), sharding.axis_rules():
        jitted = jax.jit(step)
        compiled = jitted.lower(placed, jax.device_put(x, rows)).compile()
        y, stats, grads = compiled(placed, jax.device_put(x, rows))
    return y, stats, grads, compiled.as_text(), placed, mesh


@pytest.fixture(scope="module")
def unsplit(case):
    """(cotangent, output, routing statistics, gradients) of the block on one device, computed
    once for every layout's comparison."""
    _, params, x = case
    c = jnp.asarray(np.random.default_rng(4).normal(size=(B, L, D)), jnp.float32)
    one = _config()
    y1, s1 = jax.jit(functools.partial(_apply, one))(params, x)
    g1 = jax.jit(jax.grad(functools.partial(_loss, one, c), argnums=(0, 1)))(params, x)
    return c, y1, s1, g1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_block_equals_one_device(case, unsplit, layout):
    """Output, routing statistics and gradients at every layout equal the unsplit block's, with
    exactly 2 all-to-alls forward and 2 backward when experts are split, and each expert's weights
    on its own devices."""
    _, params, x = case
    config = _config(*LAYOUTS[layout])
    c, y1, s1, g1 = unsplit
    y, stats, grads, text, placed, mesh = _split_run(config, params, x, c)
    assert_close_per_leaf(np.asarray(y1), np.asarray(y), RTOL, layout)
    np.testing.assert_array_equal(np.asarray(s1[0]), np.asarray(stats[0]))
    assert_close_per_leaf(np.asarray(s1[1]), np.asarray(stats[1]), RTOL, f"{layout} probs")
    assert_close_per_leaf(jax.tree.map(np.asarray, g1), jax.tree.map(np.asarray, grads), RTOL)
    assert hlo_collectives(text).get("all-to-all", (0, 0))[0] == 4
    ep = config.mesh_expert
    for shard in placed["wi_0"].addressable_shards:  # expert e on expert shard e // (E / ep)
        index = mesh.devices.flatten().tolist().index(shard.device)
        coords = np.unravel_index(index, mesh.devices.shape)
        expert_coord = coords[mesh.axis_names.index("expert")]
        experts = range(E)[shard.index[0]]
        assert list(experts) == list(range(expert_coord * E // ep, (expert_coord + 1) * E // ep))


def test_dropless_when_every_token_picks_one_device(case):
    """A router that sends every token to experts 0 and 1 (both on expert shard 0 of 4): every
    slot still reaches its expert (the buffers hold the worst case), output as the reference."""
    params64, _, x = case
    x = np.asarray(x).copy()
    x[..., 0] = np.abs(x[..., 0]) + 1.0  # feature 0 >= 1 on every token
    skew = dict(params64)
    skew["gate"] = params64["gate"].copy()
    skew["gate"][0, :2] += 30.0  # logits of experts 0 and 1 up by >= 30
    want, probs, ids = reference(skew, x)
    x = jnp.asarray(x)
    config = _config("ici_expert_parallelism=4")
    f32 = {n: jnp.asarray(v, jnp.float32) for n, v in skew.items()}
    c = jnp.zeros((B, L, D), jnp.float32)
    y, stats, *_ = _split_run(config, f32, x, c)
    assert np.all(np.isin(ids, [0, 1])) and _margin(probs) >= MARGIN
    assert_close_per_leaf(want, np.asarray(y), RTOL, "all slots on one device")
    assert float(np.asarray(stats[0][:2]).sum()) == B * L * K


@pytest.mark.parametrize(
    "keys, message",
    [
        (["ici_expert_parallelism=3"],
         "num_experts=8 is not divisible by ici_expert_parallelism=3"),
        (["decoder_block=llama", "num_experts=1", "ici_expert_parallelism=2"],
         "ici_expert_parallelism=2 splits the experts of a mixture-of-experts model, but "
         "num_experts=1"),
        (["num_experts=1"], "decoder_block=mixtral is a mixture of experts: set num_experts >= 2"),
        (["decoder_block=llama"], "num_experts=8 needs a mixture-of-experts block"),
        (["num_experts_per_tok=9"], "num_experts_per_tok=9 is more than num_experts=8"),
        (["num_experts=1024", "dtype=bfloat16", "ici_expert_parallelism=2"],
         "512 experts per device exceeds 256, the largest expert id dtype=bfloat16 carries"),
        (["dcn_expert_parallelism=2"], "not supported here: dcn_expert_parallelism"),
        (["capacity_factor=1.25"], "MoE layers are dropless"),
        (["use_dpo=true"], "use_dpo with a mixture of experts (num_experts > 1) is not"),
    ],
)  # fmt: skip
def test_moe_config_errors_are_one_line(keys, message):
    """Each impossible MoE combination is refused at load with one line naming the keys and the
    fix (train.py exits 2 on it, before anything is compiled)."""
    from MaxText.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _config(*keys)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
