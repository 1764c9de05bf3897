"""A measured pipelined step: its per-task timeline is recorded, converted, drawn, and replayed.

What these tests can assert on a shared 2-core machine, and what they cannot:

* They check structure, not speed: every task instance of the schedule was recorded once, on the
  rank the schedule puts it, with no overlap on a rank; the PNG exists and has many colours.
* The runtime blocks on each task before dispatching the next when ``record_times=True``, so
  measured tasks run one at a time. With ``mean`` costs the simulator does exactly the measured
  amount of work, hence (facts of list scheduling, independent of load):
  busiest rank's total <= simulated makespan <= sum of task durations <= measured loop span.
  The only load-dependent claim is the loose upper factor on the measured span (host gaps between
  tasks — transfers, deletes, dispatch — are of the same order as these tiny tasks and grow when
  other processes compete for the cores); it is a sanity bound, not a performance claim.
* Nothing here asserts that pipelining is faster: with 2 cores shared by 4 emulated devices it
  cannot be, and wall-clock ratios on a loaded machine are noise.
"""

import itertools

import jax
import numpy as np
import optax
import pytest
from engine_models import make_step, mpmd_mesh, tied_mlp_setup
from matplotlib.image import imread

import jaxpp_integration as jaxpp
from jaxpp_integration.schedules import Phase, Task, item_tasks
from jaxpp_integration.schedules.simulate import Costs, simulate
from jaxpp_integration.tools.measure import (
    COST_FLOOR,
    loop_records,
    measure_step,
    measured_costs,
    to_events,
)
from jaxpp_integration.tools.timeline import draw_timeline

N_RANKS, N_MB = 4, 8


@pytest.fixture(scope="module")
def recorded():
    """One real Std1F1B step on 4 emulated groups, recorded after one warm-up step."""
    schedule = jaxpp.Std1F1B(N_RANKS)
    params, batch, loss_fn = tied_mlp_setup(N_RANKS, N_MB, width=32)
    opt = optax.sgd(0.1)
    step = make_step(loss_fn, opt, schedule)
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(N_RANKS)).compile(
        params, opt.init(params), batch
    )
    compiled(params, opt.init(params), batch)  # warm-up: first-call costs stay out of the record
    assert compiled.last_events is None
    out = compiled(params, opt.init(params), batch, record_times=True)
    raw = compiled.last_events
    reference = compiled(params, opt.init(params), batch)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # recording changes timing only
    return schedule, raw


def test_measured_events_cover_the_schedule(recorded):
    schedule, raw = recorded
    events = to_events(raw, loop_only=True)
    expected = {
        (rank, str(t))
        for rank, row in enumerate(schedule.tasks(N_MB))
        for i in row
        for t in item_tasks(i)
    }
    got = [(ev.rank, ev.name) for ev in events]
    assert len(got) == len(set(got)) and set(got) <= expected
    # the engine skips a task with no work (here the last stage's backward, which the partition
    # puts in its forward with the loss): a (phase, stage) is recorded for all microbatches or none
    kept = {name.split("__")[0] for _, name in got}
    assert {(r, n) for r, n in expected if n.split("__")[0] in kept} == set(got)
    assert {f"fwd_{s}" for s in range(N_RANKS)} <= kept and "bwd_0" in kept
    assert {ev.kind for ev in events} == {"fwd", "bwd"}
    assert min(ev.start for ev in events) == 0.0
    all_events = to_events(raw)
    assert {ev.kind for ev in all_events} == {"fwd", "bwd", "other"}  # before/after-loop tasks
    for rank in range(N_RANKS):
        mine = sorted((ev for ev in events if ev.rank == rank), key=lambda ev: ev.start)
        assert all(ev.end >= ev.start for ev in mine)
        assert all(a.end <= b.start for a, b in itertools.pairwise(mine)), f"overlap on rank {rank}"
        # each rank runs its tasks in the schedule's order
        order = [str(t) for i in schedule.tasks(N_MB)[rank] for t in item_tasks(i)]
        order = [name for name in order if name.split("__")[0] in kept]
        assert [ev.name for ev in mine] == order


def test_measured_timeline_png(recorded, tmp_path):
    schedule, raw = recorded
    path = draw_timeline(to_events(raw), N_RANKS, tmp_path / "measured.png", title="measured (ms)")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    pixels = (imread(path)[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 10  # boxes of several kinds, not a blank canvas


def test_measured_costs_replayed_by_the_simulator(recorded):
    schedule, raw = recorded
    step = measure_step(raw, schedule, statistic="mean")
    assert step.n_microbatches == N_MB and step.num_ranks == N_RANKS
    costs = step.costs.per_task
    assert {(Phase.FWD, s) for s in range(N_RANKS)} <= set(costs)
    assert set(costs) <= {(p, s) for p in (Phase.FWD, Phase.BWD) for s in range(N_RANKS)}
    if (Phase.BWD, N_RANKS - 1) not in costs:  # skipped task (see above): charged the floor
        assert step.costs.task_cost(Task(N_RANKS - 1, 0, Phase.BWD)) == COST_FLOOR
    assert all(c > COST_FLOOR for c in costs.values())
    sim = step.simulation
    eps = 1e-9 * step.task_sum + 2 * N_RANKS * N_MB * COST_FLOOR  # rounding + skipped tasks
    # mean costs keep the total work: simulated busy time equals the measured task time
    assert sum(sim.busy_per_rank) == pytest.approx(step.task_sum, abs=eps)
    assert max(step.busy_per_rank) - eps <= sim.makespan <= step.task_sum + eps
    # measured tasks ran one at a time, so their sum fits in the measured loop span
    assert step.task_sum <= step.loop_span + eps
    # sanity factor only (host gaps between tasks are load-dependent; see module docstring)
    assert step.loop_span <= 50 * sim.makespan
    assert 0.0 <= sim.bubble < 1.0
    # the same costs replay any other schedule of the same stages, e.g. GPipe
    gpipe = simulate(jaxpp.GPipe(N_RANKS), N_MB, step.costs)
    assert sum(gpipe.busy_per_rank) == pytest.approx(step.task_sum, abs=eps)
    summary = step.as_dict()
    assert summary["costs_ms"].keys() >= {"fwd_0", "bwd_0", "fwd_3"}


def test_measured_costs_statistics_and_errors(recorded):
    schedule, raw = recorded
    loop = loop_records(raw)
    fwd0 = [(r[4] - r[3]) * 1e3 for r in loop if r[2].phase is Phase.FWD and r[2].stage == 0]
    assert len(fwd0) == N_MB
    assert measured_costs(raw, statistic="min").per_task[(Phase.FWD, 0)] == min(fwd0)
    assert measured_costs(raw).per_task[(Phase.FWD, 0)] == pytest.approx(np.median(fwd0))
    assert measured_costs(raw, unit=1.0).per_task[(Phase.FWD, 0)] == pytest.approx(
        np.median(fwd0) / 1e3
    )
    with pytest.raises(ValueError, match="record_times=True"):
        to_events(None)
    with pytest.raises(ValueError, match="statistic='max'"):
        measured_costs(raw, statistic="max")
    with pytest.raises(ValueError, match=r"stage\(s\) \[2, 3\] do not exist"):
        measured_costs(raw, jaxpp.Std1F1B(2))
    with pytest.raises(ValueError, match="no loop tasks"):
        measured_costs([r for r in raw if r[2].phase is None])


def test_unmeasured_stage_costs_the_floor():
    class Code:
        def __init__(self, stage, phase):
            self.stage, self.phase = stage, phase

    raw = [(0, "fwd_0__0", Code(0, Phase.FWD), 1.0, 1.002)]
    costs = measured_costs(raw)
    assert isinstance(costs, Costs)
    assert costs.per_task == {(Phase.FWD, 0): pytest.approx(2.0)}
    assert costs.fwd == costs.bwd == COST_FLOOR
