"""The seed documents' scenarios, at toy sizes: the tutorial notebook and the README pattern."""

from __future__ import annotations

import collections
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from compare import host, reordered_sum_rtol
from engine_models import AnnotatedTransformer
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpp_integration as jaxpp
import jaxpp_integration.api

NUM_MB, BATCH, SEQ, D = 4, 8, 8, 16
NUM_LAYERS, NUM_STAGES = 8, 4


def _init_state(model, x):
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))


def _loss_fn(state, params, x, targets):
    x, targets = jax.lax.with_sharding_constraint((x, targets), P("fsdp"))
    return jnp.mean((state.apply_fn({"params": params}, x) - targets) ** 2)


def _spmd_step(state, xs, targets):
    grad_fn = jax.value_and_grad(partial(_loss_fn, state))

    def scan_fn(carry, inp):
        loss, grads = grad_fn(state.params, *inp)
        return jax.tree.map(jnp.add, carry, (loss, grads)), ()

    split = lambda a: a.reshape(NUM_MB, -1, *a.shape[1:])
    (loss, grads), _ = jax.lax.scan(
        scan_fn, jax.tree.map(jnp.zeros_like, (0.0, state.params)), (split(xs), split(targets))
    )
    return state.apply_gradients(grads=grads), loss


def _pp_step(state, xs, targets, schedule):
    grad_fn = jax.value_and_grad(partial(_loss_fn, state))
    split = lambda a: a.reshape(NUM_MB, -1, *a.shape[1:])
    loss, grads = jaxpp.api.treduce(
        lambda inp: grad_fn(state.params, *inp),
        (split(xs), split(targets)),
        schedule=schedule,
        operation=jaxpp.api.Add,
    )
    return state.apply_gradients(grads=grads), loss


def _fsdp_shardings(mesh, state):
    def spec(leaf):  # the seed shards every array's first axis; ours skips the indivisible ones
        shape = getattr(leaf, "shape", ())
        return P("fsdp") if len(shape) > 0 and shape[0] % 4 == 0 else P()

    return (
        jax.tree.map(lambda leaf: NamedSharding(mesh, spec(leaf)), state),
        NamedSharding(mesh, P("fsdp")),
        NamedSharding(mesh, P("fsdp")),
    )


def test_tutorial_scenario():
    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, SEQ, D))
    # SPMD baseline: data parallel + ZeRO-3 over 4 devices, microbatches by lax.scan
    spmd_mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    base_state = _init_state(AnnotatedTransformer(NUM_LAYERS, NUM_STAGES), x)
    in_sh = _fsdp_shardings(spmd_mesh, base_state)
    with jax.set_mesh(spmd_mesh):
        compiled = jax.jit(_spmd_step, in_shardings=in_sh).lower(base_state, x, x).compile()
    xs = jax.device_put((x, x), in_sh[1:])

    def baseline_loss(state):
        """The SPMD step's loss from the pipelined step's input state (the baseline's own model
        apply and optimizer objects: equal hyperparameters, another instance)."""
        state = host(state).replace(apply_fn=base_state.apply_fn, tx=base_state.tx)
        state = jax.device_put(state, in_sh[0])
        return float(np.asarray(compiled(state, *xs)[1]))

    # each step's loss from the same state: a mean of BATCH x SEQ x D squares summed in another
    # order (per microbatch in each program), `reordered_sum_rtol` (tests/compare.py)
    rtol = reordered_sum_rtol(BATCH * SEQ * D, squared=False)

    # pipelined: 4 groups of 1 device, Interleaved1F1B with 4 and then 8 stages
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("stage", "fsdp"))
    mpmd_mesh = jaxpp.api.MpmdMesh(mesh, "stage")
    assert len(mpmd_mesh.unstack) == 4
    assert mpmd_mesh.unstack[2].devices.tolist() == [[jax.devices()[2]]]
    assert mpmd_mesh.unstack[2].axis_names == ("stage", "fsdp")
    for num_stages in (NUM_STAGES, NUM_LAYERS):
        state = _init_state(AnnotatedTransformer(NUM_LAYERS, num_stages), x)
        specs = jax.tree.map(lambda s: s.spec, _fsdp_shardings(mesh, state))
        schedule = jaxpp.api.Interleaved1F1B(num_stages=num_stages, mpmd_dim=NUM_STAGES)
        pp_step = jaxpp.api.mpmd_jit_with_loop(
            partial(_pp_step, schedule=schedule),
            in_specs=specs,
            out_specs=(specs[0], P()),
            mpmd_mesh=mpmd_mesh,
        ).compile(state, x, x)
        new_state = state
        for _ in range(4):
            want = baseline_loss(new_state)
            new_state, loss = pp_step(new_state, x, x)
            np.testing.assert_allclose(float(np.asarray(loss)), want, rtol=rtol)

        step = new_state.step
        assert step.mpmd_idxs == (0, 1, 2, 3)
        assert int(step) == 4
        assert repr(step).startswith("MpmdArray(shape=(), dtype=int32, mpmd_idxs=(0, 1, 2, 3)")
        parts = step._partially_addressable_arrays
        assert isinstance(parts, collections.OrderedDict) and list(parts) == [0, 1, 2, 3]
        assert [a.sharding.mesh.devices.tolist() for a in parts.values()] == [
            [[d]] for d in jax.devices()[:4]
        ]
        # block i lives on the group of its stage
        layers_per_stage = NUM_LAYERS // num_stages
        for i in range(NUM_LAYERS):
            kernel = new_state.params[f"block_{i}"]["Dense_0"]["kernel"]
            assert kernel.mpmd_idxs == ((i // layers_per_stage) % NUM_STAGES,)
            assert kernel.sharding.spec == P("fsdp")
        text = str(pp_step.closed_jaxpr)
        assert "task_name=fwd_0" in text and "transfer[" in text and "delete[" in text


def test_readme_pattern_no_specs_has_aux_default_operation():
    devices = np.array(jax.devices()[:8]).reshape(2, 1, 4)
    jax_mesh = jax.sharding.Mesh(devices, ("mpmd", "data", "model"))
    mpmd_mesh = jaxpp.MpmdMesh(jax_mesh, "mpmd")
    assert mpmd_mesh.lowering_mesh().shape == collections.OrderedDict(
        [("mpmd", 1), ("data", 1), ("model", 4)]
    )
    num_mubatches = 4
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    pars = {f"w{i}": jax.random.normal(k, (D, D)) / 4 for i, k in enumerate(keys[:2])}
    batch = jax.random.normal(keys[2], (num_mubatches, 2, D))
    optimizer = optax.adam(1e-3)

    def apply(p, x):
        x = jnp.tanh(x @ p["w0"])
        x = jaxpp.pipeline_enter_stage(x)  # markers only between stages
        return jnp.tanh(x @ p["w1"])

    def loss_fn(p, b):
        res = apply(p, b)
        return jnp.mean((res - b) ** 2) / num_mubatches, (res, 4)

    def train_step(opt_state, p, b):
        mubatch_grad = partial(jax.value_and_grad(loss_fn, has_aux=True), p)
        (losses, (pred, fours)), grad = jaxpp.treduce(
            mubatch_grad, b, schedule=jaxpp.Std1F1B(mpmd_mesh.mpmd_dim)
        )
        updates, opt_state = optimizer.update(grad, opt_state, p)
        return opt_state, optax.apply_updates(p, updates), losses, pred, fours

    opt_state = optimizer.init(pars)
    ref = jax.jit(train_step)(opt_state, pars, batch)
    out = jaxpp.mpmd_jit_with_loop(train_step, mpmd_mesh=mpmd_mesh)(opt_state, pars, batch)
    assert out[2].shape == (num_mubatches,) and out[3].shape == batch.shape
    np.testing.assert_array_equal(np.asarray(out[4]), np.full(num_mubatches, 4))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert out[2].mpmd_idxs == (1,)  # the stacked loss lives on the last group
