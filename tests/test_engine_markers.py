"""Where stage markers may sit: only at the top level of the microbatch function.

A marker inside `jax.checkpoint`, `jax.jit`, `lax.scan` or `lax.cond` is in a sub-jaxpr the
partitioner never cuts; it used to be accepted and silently mis-partition (stage ids skipped, a
layer on the wrong group). Now it is an error naming the user's line and the fix. Markers between
such blocks, at the top level, stay legal and pipeline bitwise like `jax.jit`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from compare import assert_bitwise, assert_on_group
from engine_models import make_step, mpmd_mesh, run_both, tied_mlp_setup

import jaxpp_integration as jaxpp

WIDTH = 16


def _layer(h, w):
    return jnp.tanh(h @ w) + h


def _two_stage_loss(stage_boundary):
    """An MLP LM of 2 layers whose stage boundary (layer 0, then a marker) is written by
    `stage_boundary(h, w0)`; the marker's source line is reported relative to this file."""

    def loss_fn(p, batch):
        tok, tgt = batch
        h = p["embed"][tok]
        h = stage_boundary(h, p["layers"][0])
        h = _layer(h, p["layers"][1])
        logp = jax.nn.log_softmax(h @ p["embed"].T)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))

    return loss_fn


def _in_remat(h, w):
    return jax.checkpoint(lambda h: jaxpp.pipeline_enter_stage(_layer(h, w)))(h)


def _in_jit(h, w):
    return jax.jit(lambda h, w: jaxpp.pipeline_enter_stage(_layer(h, w)))(h, w)


def _in_scan(h, w):
    def body(h, _):
        return jaxpp.pipeline_enter_stage(_layer(h, w)), None

    return jax.lax.scan(body, h, None, length=1)[0]


def _in_cond(h, w):
    return jax.lax.cond(
        jnp.sum(h) > 0,
        lambda h: jaxpp.pipeline_enter_stage(_layer(h, w)),
        lambda h: jaxpp.pipeline_enter_stage(_layer(h, -w)),
        h,
    )


@pytest.mark.parametrize(
    "boundary,construct",
    [
        (_in_remat, r"jax\.checkpoint / remat"),
        (_in_jit, r"jax\.jit"),
        (_in_scan, r"lax\.scan"),
        (_in_cond, r"lax\.cond"),
    ],
    ids=["remat", "jit", "scan", "cond"],
)
def test_marker_inside_a_sub_jaxpr_is_an_error(boundary, construct):
    params, batch, _ = tied_mlp_setup(2, 4)
    step = make_step(_two_stage_loss(boundary), optax.sgd(0.1), jaxpp.Std1F1B(2))
    pp = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2))
    with pytest.raises(ValueError) as e:
        pp.compile(params, optax.sgd(0.1).init(params), batch)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    # the user's line (this file, in the function that calls the marker), not the engine's
    line = boundary.__code__.co_firstlineno
    assert any(f"test_engine_markers.py:{n} " in msg for n in range(line, line + 8)), msg
    assert "jaxpp_integration" not in msg, msg
    assert re.search(rf"is inside {construct}\b", msg), msg
    assert "move the marker to the top level of the microbatch function" in msg


def test_marker_inside_nested_constructs_names_each():
    """A marker in a jit inside a scan: both constructs are named, innermost first."""

    def boundary(h, w):
        def body(h, _):
            return jax.jit(lambda h: jaxpp.pipeline_enter_stage(_layer(h, w)))(h), None

        return jax.lax.scan(body, h, None, length=1)[0]

    params, batch, _ = tied_mlp_setup(2, 4)
    step = make_step(_two_stage_loss(boundary), optax.sgd(0.1), jaxpp.Std1F1B(2))
    with pytest.raises(ValueError, match=r"is inside jax\.jit inside lax\.scan"):
        jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2)).compile(
            params, optax.sgd(0.1).init(params), batch
        )


def test_markers_between_scans_and_remats_are_legal():
    """Stages built from `lax.scan` over layers and `jax.checkpoint`, with the markers between
    those blocks at the top level: partitioned at the markers, bitwise equal to jax.jit, each
    stage's weights on its own group."""
    params, batch, _ = tied_mlp_setup(2, 4)
    key = jax.random.PRNGKey(3)
    params["layers"] = [
        jax.random.normal(jax.random.fold_in(key, s), (3, WIDTH, WIDTH)) / 4 for s in range(2)
    ]

    def scanned(h, ws):
        return jax.lax.scan(lambda h, w: (_layer(h, w), None), h, ws)[0]

    def loss_fn(p, batch):
        tok, tgt = batch
        h = jax.checkpoint(scanned)(p["embed"][tok], p["layers"][0])
        h = jaxpp.pipeline_enter_stage(h)
        h = scanned(h, p["layers"][1])
        logp = jax.nn.log_softmax(h @ p["embed"].T)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))

    opt = optax.sgd(0.1)
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(2))
    ref, got, losses, compiled = run_both(step, params, opt.init(params), batch, mpmd_mesh(2))
    assert_bitwise(ref, got)
    for k, (a, b) in enumerate(losses):
        assert_bitwise(a, b, f"loss of step {k}")
    for stage in range(2):
        assert_on_group(got[0]["layers"][stage], compiled.mpmd_mesh, (stage,))
