"""SPMD inside stages, live-memory accounting, and the engine's error messages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compare import (
    assert_bitwise,
    assert_close_per_leaf,
    assert_on_group,
    host,
    reordered_sum_rtol,
)
from engine_models import clipping_sgd, make_step, mpmd_mesh, run_both, tied_mlp_setup
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpp_integration as jaxpp
from jaxpp_integration.schedules import Phase, ScheduleError, Task


def test_fsdp_inside_stages_equals_jit():
    """(stage=2, fsdp=2): params sharded P("fsdp") inside each group; reference is jax.jit with
    the same sharding on a 2-device fsdp mesh. Losses are bitwise at every step; every leaf is
    held to 1e-6 of its own scale at every step, not bitwise: the stage programs and the
    after-loop clip-and-momentum update are fused differently from jit's whole step. Where
    depends on the host's XLA:CPU code generation: on one CI host the first step's gradients
    and parameters were bitwise and only the momentum differed (~2 ulps, 1e-7 of the leaf); on
    an AVX2 host the layer gradients differ from step 0 (1.4e-7 of the leaf, with
    gradient_reduction "step" and "microbatch" alike). Bound, each step from the same state:
    sums over the step's 4 x 4 x 6 tokens in another order, squared in the clipping norm
    (`reordered_sum_rtol`, tests/compare.py)."""
    schedule = jaxpp.Std1F1B(2)
    params, batch, loss_fn = tied_mlp_setup(2, 4, width=16)
    opt = clipping_sgd()
    opt_state = opt.init(params)
    step = make_step(loss_fn, opt, schedule)
    spec = lambda leaf: P("fsdp") if leaf.ndim >= 1 and leaf.shape[0] % 2 == 0 else P()
    specs = (jax.tree.map(spec, params), jax.tree.map(spec, opt_state), P())
    ref_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    to_ref = lambda tree, sp: jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(ref_mesh, s)), tree, sp
    )
    mesh = mpmd_mesh(2, inner=2)
    pp = jaxpp.mpmd_jit_with_loop(
        step, mpmd_mesh=mesh, in_specs=specs, out_specs=(specs[0], specs[1], P(), specs[0])
    )
    compiled = pp.compile(params, opt_state, batch)
    p = (params, opt_state)
    for k in range(3):  # each step from the same input state (tests/compare.py)
        r_out = jax.jit(step)(to_ref(host(p[0]), specs[0]), to_ref(host(p[1]), specs[1]), batch)
        p_out = compiled(*p, batch)
        assert_bitwise(r_out[2], p_out[2], f"loss of step {k}")
        assert_close_per_leaf(r_out, p_out, rtol=reordered_sum_rtol(4 * 4 * 6), what=f"step {k}: ")
        p = p_out[:2]
    w = p_out[0]["layers"][0]
    assert w.sharding.spec == P("fsdp")
    assert_on_group(w, mesh, (0,))  # both devices of group 0
    rows = sorted(s.index[0].indices(16)[:2] for s in w.first_array.addressable_shards)
    assert rows == [(0, 8), (8, 16)], rows  # split over fsdp, not replicated


def _activation_profile(schedule, n_mb):
    params, batch, loss_fn = tied_mlp_setup(
        schedule.num_stages, n_mb, width=32, mb_size=8, tied=False
    )
    opt = optax.sgd(0.1)
    step = make_step(loss_fn, opt, schedule)
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(schedule.mpmd_dim)).compile(
        params, opt.init(params), batch
    )
    compiled(params, opt.init(params), batch)
    report = compiled.report()
    first = next(t for t in report.tasks if t.name == "fwd_0__0")
    read_later = {s for t in report.tasks if t is not first for s in t.reads}
    nbytes = {e.value: e.bytes for e in report.events}
    # what one microbatch leaves on rank 0 for its backward (sends to rank 1 are freed at once)
    kept = sum(nbytes[s] for s in first.writes if s in read_later)
    sent = sum(nbytes[s] for s in first.writes if s not in read_later)
    return compiled.last_memory.peak_activation_bytes[0], kept, sent


@pytest.mark.parametrize("p,m", [(4, 8), (2, 6)])
def test_memory_1f1b_holds_p_gpipe_holds_m(p, m):
    """Rank 0 keeps `kept` bytes per microbatch until its backward; outgoing activations
    (`sent`, smaller than `kept`) live only until their transfer is issued. So the number of
    microbatches held at the peak is floor(peak / kept): p under 1F1B, m under GPipe."""
    peak_1f1b, kept, sent = _activation_profile(jaxpp.Std1F1B(p), m)
    peak_gpipe, kept_g, sent_g = _activation_profile(jaxpp.GPipe(p), m)
    assert (kept, sent) == (kept_g, sent_g) and kept > 0 and sent > 0
    assert sent < kept
    assert peak_1f1b // kept == p
    assert peak_gpipe // kept == m


# ------------------------------------------------------------------------------------ errors


def _compile(loss_fn, params, batch, schedule, groups):
    step = make_step(loss_fn, optax.sgd(0.1), schedule)
    return jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(groups)).compile(
        params, optax.sgd(0.1).init(params), batch
    )


def test_error_more_stages_than_schedule():
    params, batch, loss_fn = tied_mlp_setup(6, 4)  # 5 markers
    with pytest.raises(ValueError, match=r"5 stage markers but the schedule expects 4 stages"):
        _compile(loss_fn, params, batch, jaxpp.Std1F1B(4), 4)


def test_error_fewer_markers_than_stages():
    params, batch, loss_fn = tied_mlp_setup(2, 4)  # 1 marker
    with pytest.raises(ValueError, match=r"1 stage markers, fewer than the 4 stages"):
        _compile(loss_fn, params, batch, jaxpp.Std1F1B(4), 4)


def test_error_batch_not_divisible():
    with pytest.raises(ValueError, match=r"batch dimension 10 is not divisible by 4 microbatches"):
        jaxpp.split_microbatches(jnp.zeros((10, 3)), 4)


def test_error_invalid_user_schedule_shows_grid():
    bad = [
        [Task(0, 0, Phase.FWD), Task(0, 0, Phase.BWD)],
        [Task(1, 0, Phase.BWD), Task(1, 0, Phase.FWD)],
    ]
    with pytest.raises(ScheduleError) as e:
        jaxpp.UserSchedule(bad, num_stages=2, mpmd_dim=2)
    msg = str(e.value)
    assert msg.splitlines()[0].startswith("invalid schedule: bwd_1__0 on rank 1")
    assert ">bwd_1__0<" in msg and "rank 0 |" in msg


def test_error_unplaceable_equation_names_source_line():
    params, batch, loss_fn = tied_mlp_setup(2, 4)

    def noisy_loss(p, b):
        loss = loss_fn(p, b)
        jax.debug.print("loss {}", loss)
        return loss

    with pytest.raises(
        ValueError, match=r"cannot place debug_print at .*test_engine_features.py:\d+"
    ):
        _compile(noisy_loss, params, batch, jaxpp.Std1F1B(2), 2)


def test_error_pytree_mismatch():
    params, batch, loss_fn = tied_mlp_setup(2, 4)
    compiled = _compile(loss_fn, params, batch, jaxpp.Std1F1B(2), 2)
    opt_state = optax.sgd(0.1).init(params)
    with pytest.raises(TypeError, match=r"arguments do not match the compiled pytree"):
        compiled({"embed": params["embed"]}, opt_state, batch)
    with pytest.raises(TypeError, match=r"compiled for int32\[4, 4, 6\]"):
        compiled(params, opt_state, (batch[0][:, :, :3], batch[1]))


def test_marker_is_noop_outside_pipelining():
    x = jnp.arange(3.0)
    assert jaxpp.pipeline_enter_stage(x) is x
    jaxpr = jax.make_jaxpr(lambda y: jaxpp.pipeline_enter_stage(y) * 2)(x)
    assert "pipeline_marker" not in str(jaxpr)
    xs = jnp.arange(6.0).reshape(2, 3) - 1.0
    assert_bitwise(xs, jax.vmap(jaxpp.pipeline_enter_stage)(xs))
    assert_bitwise(jnp.ones(3), jax.grad(lambda y: jnp.sum(jaxpp.pipeline_enter_stage(y)))(x))


def test_mpmd_to_spmd_reshard_spreads_each_value_bitwise():
    """Each `MpmdArray` becomes one global array on the full 4x2 mesh: split over the groups
    along the first dimension that divides evenly (on top of its in-group sharding), else
    replicated; values equal the source group's bitwise (signed zeros and NaNs included)."""
    mesh = jaxpp.MpmdMesh(
        jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "fsdp")), "stage"
    )
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 6)).astype(np.float32)
    a[0, :3] = [-0.0, np.nan, np.inf]
    cases = {  # value, spec within a group, holding groups, expected spec on the full mesh
        "split_sharded": (a, P("fsdp"), (1,), P(("fsdp", "stage"))),
        "split_second_dim": (rng.standard_normal((3, 4)).astype(np.float32), P(), (2,), None),
        "replicated": (rng.standard_normal((3, 5)).astype(np.float32), P(), (3,), P()),
        "scalar_on_two": (np.array(7, np.int32), P(), (0, 3), P()),
        "odd_sharded": (
            rng.standard_normal((6, 4)).astype(np.float32),
            P(None, "fsdp"),
            (2,),
            P(None, "fsdp"),
        ),
    }
    tree = {
        k: jaxpp.MpmdArray(mesh, {r: jax.device_put(v, mesh.sharding(r, spec)) for r in groups})
        for k, (v, spec, groups, _) in cases.items()
    }
    out = jaxpp.mpmd_to_spmd_reshard(tree)
    for k, (v, _, _, want_spec) in cases.items():
        y = out[k]
        assert y.sharding.mesh == mesh.jax_mesh, k
        if want_spec is not None:
            assert y.sharding.spec == want_spec, (k, y.sharding.spec)
        assert_bitwise(np.asarray(v), np.asarray(y), k)
    assert out["split_second_dim"].sharding.spec == P(None, "stage")
    assert out["split_sharded"].addressable_shards[0].data.shape == (1, 6)  # 8 rows / (2 x 4)


def test_optimizer_state_stays_on_its_stage_group():
    """A step shaped like the trainer's: the loss is a sum, each microbatch also returns a token
    count made by the last stage, the gradients are divided by that count, clipped by global
    norm and applied with AdamW. Each stage's params and Adam moments must stay on its own group
    (only scalars cross groups), and everything stays bitwise equal to jax.jit."""
    schedule = jaxpp.Std1F1B(4)
    params, batch, loss_fn = tied_mlp_setup(4, 4, width=16, tied=False)
    opt = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2, weight_decay=0.1))

    def sums(p, mb):
        loss = loss_fn(p, mb)
        return loss * mb[1].size, jnp.sum(mb[1] > 0).astype(jnp.float32)

    def step(params, opt_state, batch):
        (loss_sum, count), grads = jaxpp.treduce(
            lambda mb: jax.value_and_grad(sums, has_aux=True)(params, mb),
            batch,
            schedule=schedule,
            operation=jaxpp.Add,
        )
        grads = jax.tree.map(lambda g: g / jnp.maximum(count, 1.0), grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_sum / count

    r_out, p_out, losses, _ = run_both(step, params, opt.init(params), batch, mpmd_mesh(4))
    for k, (a, b) in enumerate(losses):
        assert_bitwise(a, b, f"loss of step {k}")
    assert_bitwise(r_out, p_out)
    new_params, adam = p_out[0], p_out[1][1][0]
    mesh = mpmd_mesh(4)
    for stage in range(4):
        for tree in (new_params, adam.mu, adam.nu):
            assert_on_group(tree["layers"][stage], mesh, (stage,))
    for tree in (new_params, adam.mu, adam.nu):
        assert_on_group(tree["embed"], mesh, (0,))
        assert_on_group(tree["head"], mesh, (3,))


def test_a_chain_of_thousands_of_equations_partitions():
    """A stage whose output is 1,500 equations deep (as an unrolled 64-layer model's is): the
    partitioner's walks over the equations are iterative (a recursive one hit Python's recursion
    limit at `num_decoder_layers=64 scan_layers=false pipeline_parallelism=4`). The step equals
    `jax.jit`'s loss bitwise."""
    params, batch, base_loss = tied_mlp_setup(2, 2)

    def loss_fn(p, b):
        tok, tgt = b
        h = p["embed"][tok]
        for _ in range(1500):
            h = h * 1.0001
        h = jaxpp.pipeline_enter_stage(jnp.tanh(h @ p["layers"][0]) + h)
        logits = jnp.tanh(h @ p["layers"][1]) @ p["embed"].T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))

    opt = clipping_sgd()
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(2))
    opt_state = opt.init(params)
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2)).compile(
        params, opt_state, batch
    )
    assert_bitwise(
        jax.jit(step)(params, opt_state, batch)[2], compiled(params, opt_state, batch)[2]
    )
