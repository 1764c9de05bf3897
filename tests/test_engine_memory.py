"""Memory of a real step, three ways that must agree to the byte:

- `last_memory` / `report().memory()`: logical bytes per group, from shapes in program order;
- `compiled(..., measure_device_bytes=True)`: the runtime's tracked device bytes (allocation and
  free events, checked once against the live buffers at each group's peak);
- `runtime.executor.scanning_device_bytes()`: the independent reference, a scan of
  `jax.live_arrays()` (each buffer once) after every instruction.

Plus the in-place update: the after-loop tasks consume the parameters and optimizer state."""

from __future__ import annotations

import gc

import jax
import numpy as np
import optax
import pytest
from engine_models import make_step, mpmd_mesh, tied_mlp_setup

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Fill, Transfer
from jaxpp_integration.runtime.executor import scanning_device_bytes
from jaxpp_integration.schedules import Phase

SCHEDULES = {
    "gpipe": lambda: jaxpp.GPipe(4),
    "1f1b": lambda: jaxpp.Std1F1B(4),
    "eager_1f1b": lambda: jaxpp.Eager1F1B(4),
    "interleaved": lambda: jaxpp.Interleaved1F1B(8, 4),
    "zero_bubble": lambda: jaxpp.ZeroBubble(4),
    "dualpipev": lambda: jaxpp.DualPipeV(4),
}


_COMPILED: dict = {}  # (schedule, n_mb, mb_size, width) -> compiled step (SGD, state donated)


def _compiled(schedule, n_mb=8, optimizer=None, donate=(0, 1), mb_size=8, width=64):
    """(compiled step, mesh, fresh state, batch) of the tied-free MLP on 4 groups. `schedule` is
    a `SCHEDULES` name or a schedule; by name (SGD with momentum, state donated) the compiled
    step is shared by the tests asking for the same one (a fresh state each time: the previous
    one was donated)."""
    named = isinstance(schedule, str)
    if named:
        schedule = SCHEDULES[schedule]()
    stages = schedule.num_stages
    params, batch, loss_fn = tied_mlp_setup(stages, n_mb, width=width, mb_size=mb_size, tied=False)
    opt = optimizer or optax.sgd(0.1, momentum=0.9)
    mesh = mpmd_mesh(4)
    key = (schedule if named else None, n_mb, mb_size, width)
    if named and optimizer is None and donate == (0, 1) and key in _COMPILED:
        return _COMPILED[key], mesh, (params, opt.init(params)), batch
    step = make_step(loss_fn, opt, schedule)
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mesh, donate_argnums=donate).compile(
        params, opt.init(params), batch
    )
    if named and optimizer is None and donate == (0, 1):
        _COMPILED[key] = compiled
    return compiled, mesh, (params, opt.init(params)), batch


_MEASURED: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _release_shared_steps():
    """The shared compiled steps live as long as this module's tests."""
    yield
    _COMPILED.clear()
    _MEASURED.clear()


def _measured_step(name, n_mb=8, mb_size=2, width=16):
    """A second step of `SCHEDULES[name]` (inputs already on their groups), measured both ways;
    once per arguments (the fixture and the test of every schedule share gpipe's and 1f1b's)."""
    key = (name, n_mb, mb_size, width)
    if key not in _MEASURED:
        compiled, mesh, state, batch = _compiled(name, n_mb, mb_size=mb_size, width=width)
        state = compiled(*state, batch)[:2]
        gc.collect()
        with scanning_device_bytes() as scan:
            compiled(*state, batch, measure_device_bytes=True)
        (scanned,) = scan.steps
        device = [mesh.unstack[g].devices.flat[0].id for g in range(4)]
        per_group = [[after.get(device[g], 0) for g in range(4)] for after in scanned]
        _MEASURED[key] = compiled, per_group, scanned, compiled.last_device_bytes
    return _MEASURED[key]


def _settled(instrs):
    """Instruction indices after which the runtime has done exactly that much: a run of
    consecutive transfers (or fills) is one call, so inside it only its last index qualifies."""
    out = []
    for i, ins in enumerate(instrs):
        nxt = instrs[i + 1] if i + 1 < len(instrs) else None
        if not any(isinstance(ins, k) and isinstance(nxt, k) for k in (Transfer, Fill)):
            out.append(i)
    return out


@pytest.fixture(scope="module")
def measured():
    return {name: _measured_step(name)[:3] for name in ("gpipe", "1f1b")}


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_logical_bytes_equal_device_buffers(measured, name):
    """After every instruction (inside a run of transfers, once the run is done), each group's
    logical bytes equal the bytes of the buffers alive on its device, and so do the peaks."""
    compiled, per_group, _ = measured[name]
    report = compiled.last_memory
    instrs = compiled.program.instrs
    assert len(per_group) == len(report.timeline) == len(instrs)
    for i in _settled(instrs):
        assert list(report.timeline[i]) == per_group[i], (i, report.timeline[i], per_group[i])
    assert list(report.peak_bytes) == [max(m[g] for m in per_group) for g in range(4)]
    assert compiled.report().memory().peak_bytes == report.peak_bytes


def test_received_activations_count_as_activations(measured):
    """Over a group's forward phase (from just before the first activation it receives or
    makes to the sends of its last forward) the bytes its device gains are all activations:
    what its forwards keep for their backward and what it received from the previous group.
    The logical activation figure must account for that growth on every group, not only the
    first (which receives nothing). The last two groups are left out: the last stage ends in
    the loss, so its forward task also runs that stage's backward, keeps nothing, and sends
    cotangents (not activations) to the group before it during that group's forward phase.
    GPipe: each group's forward phase is one contiguous window."""
    compiled, per_group, _ = measured["gpipe"]
    report = compiled.last_memory
    tasks = compiled.report().tasks
    transfers = compiled.report().transfers
    run_at = {t.index for t in tasks}
    for g in range(2):
        fwd = [t.index for t in tasks if t.group == g and t.phase is Phase.FWD]
        received = [t.index for t in transfers if t.dst_group == g and t.from_loop]
        start = min(fwd + received) - 1
        # the forward phase ends with the sends of its last forward, before the next task
        end = min(i for i in run_at if i > fwd[-1]) - 1
        fwd_reads = {s for t in tasks if t.index in fwd for s in t.reads}
        window = [t.value for t in transfers if t.dst_group == g and start < t.index <= end]
        assert all(s in fwd_reads for s in window), "a cotangent arrived inside the window"
        grown = per_group[end][g] - per_group[start][g]
        logical = report.activation_timeline[end][g] - report.activation_timeline[start][g]
        assert grown > 0
        assert logical == grown, (g, logical, grown)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_tracked_device_bytes_equal_the_per_instruction_scan(name):
    """The runtime's O(instructions) measurement equals the former scan of every live array
    after every instruction, exactly, on every built-in schedule; its one check against the
    live buffers (at each group's peak) agrees."""
    compiled, _, scanned, tracked = _measured_step(name)
    assert tracked.timeline == scanned
    assert len(tracked.timeline) == len(compiled.program.instrs)
    assert tracked.checked and tracked.mismatches() == []
    assert list(tracked.checked) == [compiled.walk.device_peak_index()]


def test_tracking_sees_a_buffer_the_program_did_not_free():
    """Break the assumption on purpose: references kept to the values the program frees keep
    their buffers alive, which the live buffers show and the tracked figure does not; the
    check at the peak reports the difference instead of trusting the events."""
    compiled, _, state, batch = _compiled("1f1b", n_mb=8, mb_size=2, width=16)
    state = compiled(*state, batch)[:2]
    kept, original = [], dict(compiled.executables)

    def keeping(exe):
        def call(*args):
            out = exe(*args)
            kept.extend(out)
            return out

        return call

    compiled.executables.update({i: keeping(e) for i, e in original.items()})
    try:
        compiled(*state, batch, measure_device_bytes=True)
    finally:
        compiled.executables.update(original)
    ((index, tracked, scanned),) = compiled.last_device_bytes.mismatches()
    assert index == compiled.walk.device_peak_index()
    assert all(scanned[d] >= tracked.get(d, 0) for d in scanned) and scanned != tracked


def _state_bytes_per_group(compiled, sizes):
    """Bytes of the parameter and optimizer-state leaves each group receives, from the leaves'
    own sizes and the groups the report says hold each input."""
    out = [0] * 4
    for nbytes, inp in zip(sizes, compiled.report().inputs):
        for g in inp.groups:
            out[g] += nbytes
    return out


@pytest.fixture(scope="module")
def adam_steps():
    """Adam (the update reads parameters, both moments and the gradient) with the state
    donated, and the same step without `donate_argnums`; short rows, 2 microbatches, so the
    update is where the step peaks when the state is not updated in place."""
    out = {}
    for donate in ((0, 1), ()):
        compiled, mesh, state, batch = _compiled(
            jaxpp.Std1F1B(4), n_mb=2, optimizer=optax.adam(1e-2), donate=donate, mb_size=1
        )
        state = compiled(*state, batch)[:2]
        leaves = jax.tree.leaves(state)
        # sizes only: a numpy view of a CPU buffer would keep XLA from reusing it
        sizes = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves]
        gc.collect()
        with scanning_device_bytes() as scan:
            compiled(*state, batch)
        device = [mesh.unstack[g].devices.flat[0].id for g in range(4)]
        per_group = [[after.get(device[g], 0) for g in range(4)] for after in scan.steps[0]]
        out[donate] = (compiled, per_group, leaves, sizes)
    return out


def test_update_consumes_parameters_and_optimizer_state(adam_steps):
    """Measured on the devices at each group's after-loop task: right after it, the group holds
    the bytes it held before, plus what the task made, minus the whole state it was given
    (parameters and Adam's moments: the update wrote the new state into them); the arrays
    passed in are deleted after the step."""
    compiled, per_group, leaves, sizes = adam_steps[(0, 1)]
    state = _state_bytes_per_group(compiled, sizes)
    report = compiled.report()
    nbytes = {e.value: e.bytes for e in report.events}
    for g in range(4):
        (update,) = [t for t in report.tasks_of(g) if t.program.startswith("after_loop")]
        before, after = per_group[update.index - 1][g], per_group[update.index][g]
        made = sum(nbytes[s] for s in update.writes)
        assert before + made - after == state[g] > 0, (g, before, made, after, state[g])
        assert update.donated_bytes == state[g]
    assert all(a.is_deleted() for x in leaves for a in x.arrays.values())


def test_update_is_no_longer_the_peak(adam_steps):
    """Reference: the same step with the state kept by the caller (no `donate_argnums`): its
    update makes the new state next to the old one (measured: the bytes grow by what it made)
    and that is every group's peak. Updated in place, the update raises nothing: each group's
    peak is reached before it, and lies below the reference's."""
    donated, kept = adam_steps[(0, 1)], adam_steps[()]
    nbytes = {e.value: e.bytes for e in kept[0].report().events}
    for g in range(4):
        (update,) = [t for t in kept[0].report().tasks_of(g) if t.program.startswith("after_loop")]
        made = sum(nbytes[s] for s in update.writes)
        assert update.donated_bytes == 0
        assert kept[1][update.index][g] - kept[1][update.index - 1][g] == made
        peak_kept = max(m[g] for m in kept[1])
        assert kept[1][update.index][g] == peak_kept
        peak_donated = max(m[g] for m in donated[1])
        assert peak_donated == max(m[g] for m in donated[1][: update.index])
        assert peak_donated < peak_kept, (g, peak_donated, peak_kept)
    assert not any(a.is_deleted() for x in kept[2] for a in x.arrays.values())
