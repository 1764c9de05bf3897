"""`treduce`'s `Max` and `Concat(axis != 0)` through the engine, against a plain Python loop.

The reference calls the same per-microbatch function once per microbatch (each call under
`jax.jit`, as one program per microbatch) and folds the outputs with numpy: `np.maximum` for
`Max`, `np.stack(..., axis)` for `Concat(axis)`, a running sum for `Add`. The pipelined step must
give those values, and the same bits as `jax.jit` of the whole step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compare import assert_bitwise, assert_close_per_leaf, assert_on_group, reordered_sum_rtol
from engine_models import mpmd_mesh, tied_mlp_setup

import jaxpp_integration as jaxpp

OPS = {"h0": jaxpp.Concat(1), "h0_max": jaxpp.Max, "logit_max": jaxpp.Max, "logp": jaxpp.Concat(2)}


def _with_stats(num_stages):
    """The tied MLP LM's loss, plus per-microbatch statistics made on the first stage (`h0`,
    `h0_max`: after the first layer) and on the last (`logit_max`, `logp`)."""
    params, batch, _ = tied_mlp_setup(num_stages, 4)

    def loss_and_stats(p, mb):
        tok, tgt = mb
        h = p["embed"][tok]
        stats = {}
        for i, w in enumerate(p["layers"]):
            h = jnp.tanh(h @ w) + h
            if i == 0:
                stats["h0"] = jnp.mean(h, axis=1)  # [mb, width]
                stats["h0_max"] = jnp.max(h, axis=(0, 1))  # [width]
            if i < num_stages - 1:
                h = jaxpp.pipeline_enter_stage(h)
        logp = jax.nn.log_softmax(h @ p["embed"].T)
        stats["logit_max"] = jnp.max(logp, axis=(0, 1))  # [vocab]
        token_logp = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        stats["logp"] = token_logp  # [mb, seq]
        return -jnp.mean(token_logp), stats

    return params, batch, loss_and_stats


def _step(loss_and_stats, schedule):
    def step(params, batch):
        per_mb = lambda mb: jax.value_and_grad(loss_and_stats, has_aux=True)(params, mb)
        (loss, stats), grads = jaxpp.treduce(
            per_mb, batch, schedule=schedule, operation=((jaxpp.Add, OPS), jaxpp.Add)
        )
        return loss, stats, grads

    return step


def _python_loop(loss_and_stats, params, batch):
    """Each microbatch on its own, folded with numpy."""
    per_mb = jax.jit(jax.value_and_grad(loss_and_stats, has_aux=True))
    outs = [per_mb(params, (batch[0][i], batch[1][i])) for i in range(len(batch[0]))]
    loss = np.asarray(outs[0][0][0])
    grads = jax.tree.map(np.asarray, outs[0][1])
    for o in outs[1:]:
        loss = loss + np.asarray(o[0][0])
        grads = jax.tree.map(lambda a, b: a + np.asarray(b), grads, o[1])
    stats = [jax.tree.map(np.asarray, o[0][1]) for o in outs]
    folded = {
        "h0": np.stack([s["h0"] for s in stats], axis=1),
        "h0_max": functools.reduce(np.maximum, [s["h0_max"] for s in stats]),
        "logit_max": functools.reduce(np.maximum, [s["logit_max"] for s in stats]),
        "logp": np.stack([s["logp"] for s in stats], axis=2),
    }
    return loss, folded, grads


@pytest.mark.parametrize(
    "schedule",
    [jaxpp.Std1F1B(2), jaxpp.Interleaved1F1B(num_stages=4, mpmd_dim=2)],
    ids=["1f1b", "interleaved"],
)
def test_max_and_concat_on_other_axes(schedule):
    params, batch, loss_and_stats = _with_stats(schedule.num_stages)
    step = _step(loss_and_stats, schedule)
    pp = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2))
    got = pp(params, batch)
    ref_jit = jax.jit(step)(params, batch)
    assert_bitwise(ref_jit, got, "pipelined vs jax.jit: ")

    loss, stats, grads = _python_loop(loss_and_stats, params, batch)
    n, mb, seq = batch[0].shape
    assert got[1]["h0"].shape == (mb, n, params["embed"].shape[1])
    assert got[1]["logp"].shape == (mb, seq, n)
    # Max and Concat only pick and place values: those are the loop's own bits
    assert_bitwise(stats, got[1], "pipelined vs Python loop: ")
    # the sums fold in the same order, but in the loop each microbatch's loss and gradient came
    # out of one program, in the engine out of one per stage (and the tied embedding's two
    # contributions are added in another program): each leaf within the bound for a sum over
    # the step's 4 x 4 x 6 tokens in another order (tests/compare.py)
    rtol = reordered_sum_rtol(4 * 4 * 6, squared=False)
    assert_close_per_leaf((loss, grads), (got[0], got[2]), rtol=rtol, what="sums ")
    # the accumulators live where their values are made: h0 on the first stage's group, the
    # logits' statistics on the last stage's
    mesh = pp.compiled.mpmd_mesh
    last = schedule.stage_to_rank(schedule.num_stages - 1)
    for name, group in [("h0", 0), ("h0_max", 0), ("logit_max", last), ("logp", last)]:
        assert_on_group(got[1][name], mesh, (group,))
