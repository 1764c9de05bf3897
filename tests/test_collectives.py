"""Collectives per step, counted in the compiled HLO of every task times its instances.

`gradient_reduction="step"` (default) keeps gradients, loss sums and token counts unreduced over
the data axes during the loop and reduces them once per step; "microbatch" reduces them in every
task instance and is bitwise equal to `jax.jit`. The step variant sums the same numbers in
another order (per device first, then across devices), so it is compared per leaf at 1e-6 of
each leaf's scale, not bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compare import assert_bitwise, assert_close_per_leaf
from engine_models import clipping_sgd, make_step, tied_mlp_setup, transformer_setup
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Run
from jaxpp_integration.tools.collectives import (
    hlo_collectives,
    program_collectives,
    task_collectives,
)


def mlp_setup(num_stages, n_mb, width=16, mb_size=8, seed=0):
    """The issue's measurement model: tanh layers, one marker between stages, mean-squared loss."""
    keys = jax.random.split(jax.random.PRNGKey(seed), num_stages + 2)
    params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:num_stages]]
    x = jax.random.normal(keys[-2], (n_mb, mb_size, width))
    y = jax.random.normal(keys[-1], (n_mb, mb_size, width))

    def loss_fn(p, batch):
        h, t = batch
        for i, w in enumerate(p):
            h = jnp.tanh(h @ w)
            if i < num_stages - 1:
                h = jaxpp.pipeline_enter_stage(h)
        return jnp.mean((h - t) ** 2)

    return params, (x, y), loss_fn


def data_mesh(num_groups, data=2):
    devices = np.array(jax.devices()[: num_groups * data]).reshape(num_groups, data)
    return jaxpp.MpmdMesh(jax.sharding.Mesh(devices, ("stage", "data")), "stage")


def _run(setup, n_mb, mode, optimizer, schedule=None, steps=2):
    params, batch, loss_fn = setup(2, n_mb)
    schedule = schedule or jaxpp.Std1F1B(2)
    opt_state = optimizer.init(params)
    step = make_step(loss_fn, optimizer, schedule)
    pp = jaxpp.mpmd_jit_with_loop(
        step,
        mpmd_mesh=data_mesh(2),
        in_specs=(P(), P(), P(None, "data")),
        gradient_reduction=mode,
    )
    compiled = pp.compile(params, opt_state, batch)
    # the reference: jax.jit with the batch sharded the same way over 2 devices
    ref_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    ref_batch = jax.device_put(batch, NamedSharding(ref_mesh, P(None, "data")))
    r = p = (params, opt_state)
    for _ in range(steps):
        r_out = jax.jit(step)(*r, ref_batch)
        p_out = compiled(*p, batch)
        r, p = r_out[:2], p_out[:2]
    return r_out, p_out, compiled


@pytest.mark.parametrize("n_mb", [4, 8])
def test_step_reduction_launches_independent_of_m(n_mb):
    """2-stage MLP on (stage=2, data=2), Std1F1B, batch P(None, "data"): with "microbatch" each
    microbatch all-reduces its loss sum (fwd_1) and each stage's gradient (bwd_1, bwd_0): 12 at
    m=4, 24 at m=8, and results are bitwise; with "step" the loop tasks hold no all-reduce and
    one `reduce_r` task per stage all-reduces once: 2 per step at any m, with the bytes of one
    microbatch's reductions."""
    opt = optax.sgd(0.1)
    r_mb, p_mb, c_mb = _run(mlp_setup, n_mb, "microbatch", opt)
    assert_bitwise(r_mb, p_mb)
    per_step = program_collectives(c_mb)["all-reduce"]["launches"]
    assert per_step == 3 * n_mb

    r_st, p_st, c_st = _run(mlp_setup, n_mb, "step", opt)
    assert_close_per_leaf(r_st, p_st, rtol=1e-6)
    counts = program_collectives(c_st)
    assert counts["all-reduce"]["launches"] == 2
    assert task_collectives(c_st, "fwd_", "all-reduce") == 0
    assert task_collectives(c_st, "bwd_", "all-reduce") == 0
    assert task_collectives(c_st, "reduce_", "all-reduce") == 2
    # the gradient bytes reduced per step are those of one reduction, not m of them
    assert counts["all-reduce"]["bytes"] * n_mb == program_collectives(c_mb)["all-reduce"]["bytes"]


def test_step_reduction_tied_embedding_clipping_zero_bubble():
    """Embedding lookup (its gradient is a scatter-add over rows), tied logits, hard global-norm
    clipping, ZeroBubble's split backward: "step" equals jax.jit within 1e-6 per leaf (sums in
    another order). The loop tasks all-reduce only the tied weight's last-stage contribution,
    which stage 0 reads every microbatch (sent reduced, as before, not at D times its size):
    m + 2 all-reduces per step instead of 2m."""
    schedule = jaxpp.ZeroBubble(2)
    r, p, c = _run(tied_mlp_setup, 4, "step", clipping_sgd(), schedule=schedule, steps=2)
    assert_close_per_leaf(r, p, rtol=1e-6)
    by_task = program_collectives(c)["by_task"]
    assert by_task["reduce_0"] == {"all-reduce": 1} and by_task["reduce_1"] == {"all-reduce": 1}
    in_loop = {k: v for k, v in by_task.items() if k.startswith(("fwd", "bwd")) and v}
    [(task, counts)] = in_loop.items()  # only the task making the tied contribution reduces
    assert task.startswith("bwd") and task.endswith("_1") and counts == {"all-reduce": 1}, task
    assert program_collectives(c)["all-reduce"]["launches"] == 4 + 2


@pytest.mark.slow
def test_step_reduction_through_remat_and_nested_jit():
    """The seed transformer block (attention, LayerNorm, `nn.remat` over `nn.jit`): gradients made
    inside the nested calls are deferred too (no all-reduce in the backward tasks). The attention
    key bias's gradient is mathematically zero (softmax ignores a shift), so its value is
    rounding noise (~1e-10) that no per-leaf scale can bound: an absolute floor of 1e-8 (1e-6 of
    the gradients' scale) covers it."""

    def setup(num_stages, n_mb):
        return transformer_setup(2, num_stages, n_mb, mb_size=4)

    r, p, c = _run(setup, 2, "step", optax.sgd(0.1), steps=1)
    assert_close_per_leaf(r, p, rtol=1e-6, floor=1e-8)
    assert task_collectives(c, "bwd_", "all-reduce") == 0


def test_gradient_reduction_is_checked():
    with pytest.raises(ValueError, match="gradient_reduction='sometimes' is not one of step"):
        jaxpp.mpmd_jit_with_loop(
            lambda x: x, mpmd_mesh=data_mesh(2), gradient_reduction="sometimes"
        )


def test_hlo_collectives_reads_sync_and_async_ops():
    """The counter on hand-written HLO lines: a tuple all-reduce, an async all-gather (start
    counted once, its result half), a reduce-scatter."""
    text = "\n".join(
        [
            "  %ar = (f32[16,16]{1,0}, f32[4]{0}) all-reduce(%a, %b), replica_groups={{0,1}}",
            "  %ags = (f32[8]{0}, f32[16]{0}) all-gather-start(%c), dimensions={0}",
            "  %agd = f32[16]{0} all-gather-done(%ags)",
            "  %rs = bf16[8,4]{1,0} reduce-scatter(%d), dimensions={0}",
        ]
    )
    got = hlo_collectives(text)
    assert got == {"all-reduce": (1, 1040), "all-gather": (1, 64), "reduce-scatter": (1, 64)}


def _fsdp_run(n_mb, ag_once):
    params, batch, loss_fn = mlp_setup(2, n_mb, width=32)
    optimizer = optax.sgd(0.1)
    step = make_step(loss_fn, optimizer, jaxpp.Std1F1B(2))
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = jaxpp.MpmdMesh(jax.sharding.Mesh(devices, ("stage", "fsdp")), "stage")
    pp = jaxpp.mpmd_jit_with_loop(
        step,
        mpmd_mesh=mesh,
        in_specs=(P("fsdp"), P(), P(None, "fsdp")),
        pipeline_fsdp_ag_once=ag_once,
    )
    compiled = pp.compile(params, optimizer.init(params), batch)
    ref_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    ref_params = jax.device_put(params, NamedSharding(ref_mesh, P("fsdp")))
    ref_batch = jax.device_put(batch, NamedSharding(ref_mesh, P(None, "fsdp")))
    ref = jax.jit(step)(ref_params, optimizer.init(params), ref_batch)
    got = compiled(params, optimizer.init(params), batch)
    return ref, got, compiled


@pytest.mark.parametrize("n_mb", [4, 8])
def test_fsdp_weights_gathered_once_per_step(n_mb):
    """(stage=2, fsdp=2), weights P("fsdp"), batch rows P(None, "fsdp"): by default every loop
    task instance that reads a weight all-gathers it (a multiple of m per step); with
    `pipeline_fsdp_ag_once` one `gather_r` task per stage gathers it once per step and no loop
    task gathers (the count does not depend on m). The gathered copies stay alive through the
    loop: the group's peak live bytes grow by at least the gathered half of its weights.
    The deferred gradient sum comes out split over fsdp like its weight. Results agree with
    the sharded jax.jit within 1e-6 per leaf (sums in another order)."""
    ref, base, c_base = _fsdp_run(n_mb, False)
    ref, once, c_once = _fsdp_run(n_mb, True)
    assert_close_per_leaf(ref, base, rtol=1e-6)
    assert_close_per_leaf(ref, once, rtol=1e-6)
    loop = lambda c: sum(task_collectives(c, p, "all-gather") for p in ("fwd_", "bwd_"))  # noqa: E731
    assert loop(c_base) >= n_mb and loop(c_base) % n_mb == 0
    assert loop(c_once) == 0
    assert task_collectives(c_once, "gather_", "all-gather") == 2  # one per stage's weight
    # the once-per-step sum comes out split like the weight it updates (a reduce-scatter on
    # GPU; XLA:CPU writes it as all-reduce + slice), so the optimizer reads only its shard
    for c in (c_base, c_once):
        reduced = [
            c.slot_sharding[s].spec
            for ins in c.program.instrs
            if isinstance(ins, Run) and ins.code.name.startswith("reduce_")
            for s, aval in zip(ins.outs, [c.program.slot_aval[o] for o in ins.outs])
            if aval.ndim == 2
        ]
        assert reduced == [P("fsdp"), P("fsdp")], reduced
    weight_bytes = 32 * 32 * 4
    for group in range(2):
        grown = c_once.last_memory.peak_bytes[group] - c_base.last_memory.peak_bytes[group]
        assert grown >= weight_bytes // 2, (group, grown)
