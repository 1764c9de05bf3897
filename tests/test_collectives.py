"""Collectives per step, counted in the compiled HLO of every task times its instances (a
collective in a `while` body once per trip).

`gradient_reduction="step"` keeps gradients, loss sums and token counts unreduced over the data
axes during the loop and reduces them once per step; "auto" (the default) does the same over
axes the weights are replicated on (these tests: data only; fsdp in
tests/test_collectives_auto.py); "microbatch" reduces them in every task instance and is bitwise
equal to `jax.jit`. The deferred variants sum the same numbers in another order (per device
first, then across devices), so they are compared step by step, per leaf, within
`reordered_sum_rtol` of the sums' terms (tests/compare.py: the batch rows or tokens of a step),
not bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compare import assert_bitwise, assert_close_per_leaf, host, reordered_sum_rtol
from engine_models import clipping_sgd, make_step, normal_from, tied_mlp_setup, transformer_setup
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Run
from jaxpp_integration.tools.collectives import (
    collective_ops,
    group_axes,
    hlo_collectives,
    program_collectives,
    replica_groups,
    task_collectives,
)


def mlp_setup(num_stages, n_mb, width=16, mb_size=8, seed=0):
    """The issue's measurement model: tanh layers, one marker between stages, mean-squared loss."""
    normal = normal_from(seed)
    params = [normal(width, width) / np.float32(np.sqrt(width)) for _ in range(num_stages)]
    x, y = normal(n_mb, mb_size, width), normal(n_mb, mb_size, width)
    params, x, y = jax.tree.map(jnp.asarray, (params, x, y))

    def loss_fn(p, batch):
        h, t = batch
        for i, w in enumerate(p):
            h = jnp.tanh(h @ w)
            if i < num_stages - 1:
                h = jaxpp.pipeline_enter_stage(h)
        return jnp.mean((h - t) ** 2)

    return params, (x, y), loss_fn


def scanned_mlp_setup(num_stages, n_mb, layers=3, width=16, mb_size=8, seed=0):
    """Each stage a `lax.scan` over its stacked [layers, width, width] weights (the trainer's
    default layout): per-layer weight gradients are made inside the backward scan's body."""
    normal = normal_from(seed)
    params = [normal(layers, width, width) / np.float32(np.sqrt(width)) for _ in range(num_stages)]
    x, y = normal(n_mb, mb_size, width), normal(n_mb, mb_size, width)
    params, x, y = jax.tree.map(jnp.asarray, (params, x, y))

    def loss_fn(p, batch):
        h, t = batch
        for i, w in enumerate(p):
            h, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), h, w)
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
    mode_kwargs = {} if mode is None else {"gradient_reduction": mode}  # None: the default
    pp = jaxpp.mpmd_jit_with_loop(
        step,
        mpmd_mesh=data_mesh(2),
        in_specs=(P(), P(), P(None, "data")),
        **mode_kwargs,
    )
    compiled = pp.compile(params, opt_state, batch)
    # the reference: jax.jit with the batch sharded the same way over 2 devices
    ref_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    ref_batch = jax.device_put(batch, NamedSharding(ref_mesh, P(None, "data")))
    p = (params, opt_state)
    for _ in range(steps):  # each step from the same input state (tests/compare.py)
        r_out = jax.jit(step)(*host(p), ref_batch)
        p_out = compiled(*p, batch)
        p = p_out[:2]
    return r_out, p_out, compiled


@pytest.mark.parametrize("n_mb", [4, 8])
@pytest.mark.parametrize("mode", ["step", None])
def test_step_reduction_launches_independent_of_m(n_mb, mode):
    """2-stage MLP on (stage=2, data=2), Std1F1B, batch P(None, "data"): with "microbatch" each
    microbatch all-reduces its loss sum (fwd_1) and each stage's gradient (bwd_1, bwd_0): 12 at
    m=4, 24 at m=8, and results are bitwise; with "step", and with the default ("auto": over
    `data`, where the weights are replicated, it defers), the loop tasks hold no all-reduce and
    one `reduce_r` task per stage all-reduces once: 2 per step at any m, with the bytes of one
    microbatch's reductions."""
    opt = optax.sgd(0.1)
    r_mb, p_mb, c_mb = _run(mlp_setup, n_mb, "microbatch", opt)
    assert_bitwise(r_mb, p_mb)
    per_step = program_collectives(c_mb)["all-reduce"]["launches"]
    assert per_step == 3 * n_mb

    r_st, p_st, c_st = _run(mlp_setup, n_mb, mode, opt)
    # sums over the step's 8 x m rows; SGD's state holds no squares
    assert_close_per_leaf(r_st, p_st, rtol=reordered_sum_rtol(8 * n_mb, squared=False))
    counts = program_collectives(c_st)
    assert counts["all-reduce"]["launches"] == 2
    assert task_collectives(c_st, "fwd_", "all-reduce") == 0
    assert task_collectives(c_st, "bwd_", "all-reduce") == 0
    assert task_collectives(c_st, "reduce_", "all-reduce") == 2
    # the gradient bytes reduced per step are those of one reduction, not m of them
    assert counts["all-reduce"]["bytes"] * n_mb == program_collectives(c_mb)["all-reduce"]["bytes"]


def test_step_reduction_tied_embedding_clipping_zero_bubble():
    """Embedding lookup (its gradient is a scatter-add over rows), tied logits, hard global-norm
    clipping, ZeroBubble's split backward: "step" equals jax.jit per leaf within the bound for
    sums over the step's 4 x 4 x 6 tokens in another order, squared in the clipping norm. The
    loop tasks all-reduce only the tied weight's last-stage contribution, which stage 0 reads
    every microbatch (sent reduced, as before, not at D times its size): m + 2 all-reduces per
    step instead of 2m."""
    schedule = jaxpp.ZeroBubble(2)
    r, p, c = _run(tied_mlp_setup, 4, "step", clipping_sgd(), schedule=schedule, steps=2)
    assert_close_per_leaf(r, p, rtol=reordered_sum_rtol(4 * 4 * 6))
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
    the gradients' scale) covers it. Other leaves: sums over the step's 2 x 4 x 8 tokens, SGD."""

    def setup(num_stages, n_mb):
        return transformer_setup(2, num_stages, n_mb, mb_size=4)

    r, p, c = _run(setup, 2, "step", optax.sgd(0.1), steps=1)
    assert_close_per_leaf(r, p, rtol=reordered_sum_rtol(2 * 4 * 8, squared=False), floor=1e-8)
    assert task_collectives(c, "bwd_", "all-reduce") == 0


def test_gradient_reduction_is_checked():
    with pytest.raises(
        ValueError, match="gradient_reduction='sometimes' is not one of auto, step, microbatch"
    ):
        jaxpp.mpmd_jit_with_loop(
            lambda x: x, mpmd_mesh=data_mesh(2), gradient_reduction="sometimes"
        )


@pytest.mark.parametrize("n_mb", [4, 8])
def test_scanned_stages_defer_inside_the_loop(n_mb):
    """Stages as `lax.scan`s over stacked weights (3 layers each), (stage=2, data=2): with
    "microbatch" every backward instance all-reduces each layer's gradient once per trip of its
    scan, and the last forward the loss: (1 + 2 x 3) x m = 7m per step, bitwise equal to
    jax.jit. With the default the backward scans make per-layer partial sums, so the loop
    tasks hold no all-reduce at all (counted per trip) and one `reduce_r` per stage reduces
    once: 2 per step at any m, with the bytes of one microbatch's reductions."""
    opt = optax.sgd(0.1)
    r_mb, p_mb, c_mb = _run(scanned_mlp_setup, n_mb, "microbatch", opt)
    assert_bitwise(r_mb, p_mb)
    mb = program_collectives(c_mb)
    assert mb["all-reduce"]["launches"] == 7 * n_mb
    assert task_collectives(c_mb, "bwd_", "all-reduce", axes=("data",)) == 6 * n_mb

    r_st, p_st, c_st = _run(scanned_mlp_setup, n_mb, None, opt)
    assert_close_per_leaf(r_st, p_st, rtol=reordered_sum_rtol(8 * n_mb, squared=False))
    st = program_collectives(c_st)
    assert sum(task_collectives(c_st, p, "all-reduce") for p in ("fwd_", "bwd_")) == 0
    assert task_collectives(c_st, "reduce_", "all-reduce", axes=("data",)) == 2
    assert st["all-reduce"]["launches"] == 2
    assert st["all-reduce"]["bytes"] * n_mb == mb["all-reduce"]["bytes"]
    assert c_st.reduction_choice.deferred_axes == ("data",)


def _loop_program(unroll: bool):
    """jax.jit of a 4-trip scan whose body runs a 3-trip fori_loop, each inner trip summing
    rows split over 4 devices (an all-reduce that depends on the previous trip's result)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))

    def f(w, x):
        def layer(c, wi):
            def trip(_, c):
                return c + jnp.sum(jnp.tanh(x * c) @ wi, axis=0)

            return jax.lax.fori_loop(0, 3, trip, c, unroll=unroll), None

        return jax.lax.scan(layer, jnp.zeros(x.shape[1]), w, unroll=unroll)[0]

    w = jnp.ones((4, 16, 16)) / 16
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(("data", "fsdp"))))
    return jax.jit(f).lower(w, x).compile().as_text(), mesh


def test_collective_in_a_while_counts_once_per_trip():
    """An all-reduce inside a 3-trip loop inside a 4-trip loop runs 12 times per call: the
    counter reads each `while`'s known trip count (XLA records it in the HLO) and finds 12, as
    many as the fully unrolled program has all-reduce lines; a text count of the looped
    program finds one."""
    looped, mesh = _loop_program(unroll=False)
    unrolled, _ = _loop_program(unroll=True)
    assert looped.count('"known_trip_count":{"n":"4"}') == 1
    assert looped.count('"known_trip_count":{"n":"3"}') == 1
    assert sum(" all-reduce(" in line for line in looped.splitlines()) == 1
    assert sum(" all-reduce(" in line for line in unrolled.splitlines()) == 12
    assert hlo_collectives(looped)["all-reduce"][0] == 12
    assert hlo_collectives(unrolled)["all-reduce"][0] == 12
    [op] = collective_ops(looped)
    assert op.times == 12 and group_axes(op.groups, mesh) == ("data", "fsdp")


def test_replica_groups_in_every_spelling_map_to_mesh_axes():
    """XLA writes replica groups explicitly, as an iota (with a transpose) or as axes of a mesh
    with a device order; each is read into the same device groups, and each group into the
    mesh axes (data, fsdp, tensor of size 2 each; device i at position i of the mesh) its
    devices differ along."""
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor")
    )
    tensor = ((0, 1), (2, 3), (4, 5), (6, 7))
    data = ((0, 4), (1, 5), (2, 6), (3, 7))
    data_tensor = ((0, 1, 4, 5), (2, 3, 6, 7))
    cases = [
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", tensor, ("tensor",)),
        ("replica_groups=[4,2]<=[8]", tensor, ("tensor",)),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", data, ("data",)),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}",
            ((0, 1, 2, 3), (4, 5, 6, 7)),
            ("fsdp", "tensor"),
        ),
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
            "device_ids=([2,2,2]T(0,2,1)) {'axis_0'}",
            ((0, 1, 4, 5), (2, 3, 6, 7)),
            ("data", "tensor"),
        ),
        (
            "replica_groups=mesh['axis_0'=8] {'axis_0':(2)2}",
            ((0, 2), (1, 3), (4, 6), (5, 7)),
            ("fsdp",),
        ),
    ]
    del data_tensor
    for text, groups, axes in cases:
        line = f"  %ar = f32[4]{{0}} all-reduce(%x), channel_id=1, {text}, to_apply=%add"
        assert replica_groups(line) == groups, text
        assert group_axes(replica_groups(line), mesh) == axes, text
    assert replica_groups("  %ar = f32[4]{0} all-reduce(%x), replica_groups={}") is None
    with pytest.raises(ValueError, match="unknown replica_groups spelling"):
        replica_groups("  %ar = f32[4]{0} all-reduce(%x), replica_groups=somewhere")


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
        gradient_reduction="step",
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
    the sharded jax.jit per leaf within the bound for sums over the step's 8 x m rows in another
    order (one SGD step)."""
    ref, base, c_base = _fsdp_run(n_mb, False)
    ref, once, c_once = _fsdp_run(n_mb, True)
    rtol = reordered_sum_rtol(8 * n_mb, squared=False)
    assert_close_per_leaf(ref, base, rtol=rtol)
    assert_close_per_leaf(ref, once, rtol=rtol)
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
