"""Small models and steps shared by the engine tests (kept out of test files so they read short)."""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpp_integration as jaxpp

D_MODEL = 16
SEQ = 8


class Block(nn.Module):
    """The tutorial seed's block (attention, remat, nested jit, LayerNorm), at toy size."""

    @nn.remat
    @nn.jit
    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D_MODEL)(x)
        x = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(4 * D_MODEL)(x))
        x = x + nn.Dense(x.shape[-1])(h)
        return nn.LayerNorm()(x)


class AnnotatedTransformer(nn.Module):
    """Tutorial convention: a marker after every stage, the last one included."""

    num_layers: int
    num_stages: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = Block(name=f"block_{i}")(x)
            if (i + 1) % (self.num_layers // self.num_stages) == 0:
                x = jaxpp.pipeline_enter_stage(x)
        return x


def normal_from(seed: int):
    """`normal(*shape)`: float32 standard-normal numpy arrays from numpy's generator of `seed`.
    Test data from numpy: JAX's random programs would be compiled once per shape (about a second
    each on XLA:CPU)."""
    rng = np.random.default_rng(seed)
    return lambda *shape: rng.standard_normal(shape, dtype=np.float32)


def transformer_setup(num_layers, num_stages, n_mb, mb_size=2, seed=0):
    model = AnnotatedTransformer(num_layers, num_stages)
    normal = normal_from(seed)
    x, y = (jnp.asarray(normal(n_mb, mb_size, SEQ, D_MODEL)) for _ in range(2))
    params = model.init(jax.random.PRNGKey(seed), x[0])["params"]

    def loss_fn(p, batch):
        xb, yb = batch
        return jnp.mean((model.apply({"params": p}, xb) - yb) ** 2)

    return params, (x, y), loss_fn


def tied_mlp_setup(num_stages, n_mb, vocab=32, width=16, mb_size=4, seed=0, tied=True):
    """An MLP LM whose embedding is used by the first stage (lookup) and the last (logits);
    `tied=False` gives the last stage its own output head instead."""
    normal, scale = normal_from(seed), np.float32(1 / np.sqrt(width))
    params = {
        "embed": normal(vocab, width) * np.float32(0.1),
        "layers": [normal(width, width) * scale for _ in range(num_stages)],
    }
    if not tied:
        params["head"] = normal(vocab, width) * np.float32(0.1)
    params = jax.tree.map(jnp.asarray, params)
    tokens = np.random.default_rng(seed + 1).integers(0, vocab, (n_mb, mb_size, 6), np.int32)
    tokens, targets = jnp.asarray(tokens), jnp.asarray(np.roll(tokens, -1, axis=-1))

    def loss_fn(p, batch):
        tok, tgt = batch
        h = p["embed"][tok]
        for i, w in enumerate(p["layers"]):
            h = jnp.tanh(h @ w) + h
            if i < num_stages - 1:
                h = jaxpp.pipeline_enter_stage(h)  # README convention: markers between stages
        logits = h @ (p["embed"] if tied else p["head"]).T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))

    return params, (tokens, targets), loss_fn


def clipping_sgd():
    """Clips hard (threshold far below the gradient norm) then momentum SGD."""
    return optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.5, momentum=0.9))


def make_step(loss_fn, optimizer, schedule):
    def step(params, opt_state, batch):
        loss, grads = jaxpp.treduce(
            lambda mb: jax.value_and_grad(loss_fn)(params, mb),
            batch,
            schedule=schedule,
            operation=jaxpp.Add,
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


def mpmd_mesh(num_groups, inner=1, names=("stage", "fsdp")):
    devices = np.array(jax.devices()[: num_groups * inner]).reshape(num_groups, inner)
    return jaxpp.MpmdMesh(jax.sharding.Mesh(devices, names), names[0])


def run_both(step, params, opt_state, batch, mesh, steps=3, each_step=None, **mpmd_kwargs):
    """Runs `steps` pipelined steps and, before each, jax.jit of the step from the same input
    state (so that differences do not compound over steps: tests/compare.py); returns the last
    step's outputs of both, each step's pair of losses and the compiled step.
    `each_step(k, ref_out, pipelined_out)`, if given, is called after every step."""
    ref = jax.jit(step)
    pp = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mesh, **mpmd_kwargs)
    compiled = pp.compile(params, opt_state, batch)
    p = (params, opt_state)
    losses = []
    for k in range(steps):
        r_out = ref(*jax.tree.map(np.asarray, p), batch)
        p_out = compiled(*p, batch)
        losses.append((np.asarray(r_out[2]), np.asarray(p_out[2])))
        if each_step is not None:
            each_step(k, r_out, p_out)
        p = p_out[:2]
    return r_out, p_out, losses, compiled


__all__ = ["partial"]
