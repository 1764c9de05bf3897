"""`last_memory` (logical bytes per group, from shapes in program order) against the device
buffers actually alive on each group's device, measured after every instruction of a real step
(`runtime.measuring_device_bytes`: a scan of `jax.live_arrays()`, deduplicated by buffer)."""

from __future__ import annotations

import gc

import optax
import pytest
from engine_models import make_step, mpmd_mesh, tied_mlp_setup

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Run, Transfer
from jaxpp_integration.runtime.executor import measuring_device_bytes
from jaxpp_integration.schedules import Phase

TOLERANCE = 0.05


def _measured_step(schedule, n_mb):
    params, batch, loss_fn = tied_mlp_setup(4, n_mb, width=64, mb_size=8, tied=False)
    opt = optax.sgd(0.1, momentum=0.9)
    step = make_step(loss_fn, opt, schedule)
    mesh = mpmd_mesh(4)
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(
        params, opt.init(params), batch
    )
    state = compiled(params, opt.init(params), batch)[:2]  # inputs already on their groups
    gc.collect()
    with measuring_device_bytes() as probe:
        compiled(*state, batch)
    (measured,) = probe.steps
    device = [mesh.unstack[g].devices.flat[0].id for g in range(4)]
    per_group = [[after.get(device[g], 0) for g in range(4)] for after in measured]
    return compiled, per_group


@pytest.mark.parametrize("schedule", [jaxpp.GPipe(4), jaxpp.Std1F1B(4)], ids=["gpipe", "1f1b"])
def test_logical_bytes_match_device_buffers(schedule):
    """After every task, each group's logical bytes are within 5% of the bytes of the buffers
    alive on its device (inputs and everything the step made), and so are the peaks."""
    compiled, measured = _measured_step(schedule, n_mb=8)
    report = compiled.last_memory
    assert len(measured) == len(report.timeline) == len(compiled.program.instrs)
    runs = [i for i, ins in enumerate(compiled.program.instrs) if isinstance(ins, Run)]
    for g in range(4):
        for i in runs:
            logical, real = report.timeline[i][g], measured[i][g]
            assert abs(logical - real) <= TOLERANCE * real, (g, i, logical, real)
        peak = max(m[g] for m in measured)
        assert abs(report.peak_bytes[g] - peak) <= TOLERANCE * peak, (g, report.peak_bytes, peak)


def test_received_activations_count_as_activations():
    """GPipe: over a group's forward phase (from just before the first activation it receives
    or makes to the sends of its last forward) the bytes its device gains are all activations:
    what its forwards keep for their backward and what it received from the previous group.
    The logical activation figure must account for that growth on every group, not only the
    first (which receives nothing). The last two groups are left out: the last stage ends in
    the loss, so its forward task also runs that stage's backward, keeps nothing, and sends
    cotangents (not activations) to the group before it during that group's forward phase."""
    compiled, measured = _measured_step(jaxpp.GPipe(4), n_mb=8)
    report = compiled.last_memory
    instrs = compiled.program.instrs
    made_by_loop = {
        s for ins in instrs if isinstance(ins, Run) and ins.code.kind == "loop" for s in ins.outs
    }
    for g in range(2):
        fwd = [
            i
            for i, ins in enumerate(instrs)
            if isinstance(ins, Run) and ins.code.rank == g and ins.code.phase is Phase.FWD
        ]
        received = [
            i
            for i, ins in enumerate(instrs)
            if isinstance(ins, Transfer) and ins.dst_rank == g and ins.src in made_by_loop
        ]
        start = min(fwd + received) - 1
        # the forward phase ends with the sends of its last forward, before the next task
        end = next(i for i in range(fwd[-1] + 1, len(instrs)) if isinstance(instrs[i], Run)) - 1
        fwd_reads = {s for i in fwd for s in instrs[i].ins}
        window = [instrs[i].dst for i in received if start < i <= end]
        assert all(s in fwd_reads for s in window), "a cotangent arrived inside the window"
        grown = measured[end][g] - measured[start][g]
        logical = report.activation_timeline[end][g] - report.activation_timeline[start][g]
        assert grown > 0
        assert abs(logical - grown) <= TOLERANCE * grown, (g, logical, grown)
