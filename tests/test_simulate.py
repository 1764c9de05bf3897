"""Simulator vs analytic formulas (bubble, peak activations), cost model and event records.

Tolerances: every formula below holds *exactly* in the list-scheduling model with the stated
costs (floating-point comparisons use 1e-12). Where a formula is only exact in a range (ZB-H1
needs m >= p) the test says so.
"""

import pytest

from jaxpp_integration.schedules import (
    DualPipeV,
    Eager1F1B,
    FusedTask,
    GPipe,
    Interleaved1F1B,
    Phase,
    ScheduleError,
    Std1F1B,
    Task,
    ZeroBubble,
    task_dependencies,
)
from jaxpp_integration.schedules.simulate import Costs, Event, simulate

F, B, BI, BW = Phase.FWD, Phase.BWD, Phase.BWD_I, Phase.BWD_W
UNIT = Costs(fwd=1.0, bwd=1.0)  # equal forward and backward
SPLIT_UNIT = Costs(fwd=1.0, bwd_i=1.0, bwd_w=1.0)
EXACT = 1e-12

PM = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 5, 7, 8, 16)]


# ---------------------------------------------------------------------------------------------
# Bubble vs formula
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), PM)
@pytest.mark.parametrize("costs", [UNIT, Costs(fwd=1.0, bwd=2.0)], ids=["f1b1", "f1b2"])
def test_gpipe_and_1f1b_bubble(p, m, costs):
    expected = (p - 1) / (m + p - 1)
    for sched in (GPipe(p), Std1F1B(p), Eager1F1B(p)):
        sim = simulate(sched, m, costs)
        assert sim.bubble == pytest.approx(expected, abs=EXACT), sched
        assert sim.makespan == pytest.approx((m + p - 1) * (costs.fwd + costs.bwd), abs=EXACT)
        # Every rank idles the same (p-1)(F+B) in these schedules.
        for frac in sim.bubble_per_rank:
            assert frac == pytest.approx(expected, abs=EXACT)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("costs", [UNIT, Costs(fwd=1.0, bwd=2.0)], ids=["f1b1", "f1b2"])
def test_interleaved_bubble(p, v, rounds, costs):
    # Per-chunk costs: each of the v*p stages costs (fwd, bwd). Exact for every m that is a
    # multiple of p (the only m Interleaved1F1B accepts): (p-1)/(v m + p-1).
    m = rounds * p
    sim = simulate(Interleaved1F1B(v * p, p), m, costs)
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=EXACT)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("extra", [0, 1, 3, 9, 24])
def test_zero_bubble_h1_bubble(p, extra):
    # ZB-H1 with F = B_I = B_W: (p-1)/(3m+p-1), exact for m >= p.
    m = p + extra
    sim = simulate(ZeroBubble(p), m, SPLIT_UNIT)
    assert sim.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=EXACT)
    one_f_one_b = simulate(Std1F1B(p), m, Costs(fwd=1.0, bwd=2.0))
    assert sim.bubble <= one_f_one_b.bubble


def test_zero_bubble_below_p_microbatches_is_still_no_worse_than_1f1b():
    for p in (3, 4, 8):
        for m in range(1, p):
            zb = simulate(ZeroBubble(p), m, SPLIT_UNIT)
            base = simulate(Std1F1B(p), m, Costs(fwd=1.0, bwd=2.0))
            assert zb.makespan <= base.makespan


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5, 16])
def test_dualpipev_bubble(p, extra):
    # 2p stages of cost F = B_I = B_W = 1, i.e. 6m work per rank. Observed exact laws of this
    # schedule: (p-1)/(6m+p-1) with consecutive F & B pairs; with fused pairs (each pair costs
    # the sum of its parts, no overlap credit) the ramp doubles: (p-1)/(3m+p-1).
    m = 2 * p + extra
    sim = simulate(DualPipeV(p), m, SPLIT_UNIT)
    assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1), abs=EXACT)
    fused = simulate(DualPipeV(p, fuse_overlap=True), m, SPLIT_UNIT)
    assert fused.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=EXACT)
    # Without the backward split it is still better than 1F1B on the same ranks.
    whole = simulate(DualPipeV(p, split_backward=False), m, Costs(fwd=1.0, bwd=2.0))
    assert whole.bubble <= (p - 1) / (m + p - 1) + EXACT


def test_published_reference_points():
    # pipeline_schedules_landscape.md, p=8 with m=16 / m=32.
    def pct(sched, m, costs):
        return round(100 * simulate(sched, m, costs).bubble, 1)

    assert pct(Std1F1B(8), 16, UNIT) == 30.4 and pct(Std1F1B(8), 32, UNIT) == 17.9
    assert pct(Interleaved1F1B(16, 8), 16, UNIT) == 17.9
    assert pct(Interleaved1F1B(32, 8), 32, UNIT) == 5.2
    assert pct(ZeroBubble(8), 16, SPLIT_UNIT) == 12.7
    assert pct(ZeroBubble(8), 32, SPLIT_UNIT) == 6.8
    assert pct(DualPipeV(8, fuse_overlap=True), 32, SPLIT_UNIT) == 6.8
    assert pct(DualPipeV(8), 32, SPLIT_UNIT) <= 3.5  # the ZB1P / ZBV target


# ---------------------------------------------------------------------------------------------
# Peak live activations vs formula
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), PM)
def test_peak_activations_single_chunk(p, m):
    assert simulate(GPipe(p), m, UNIT).peak_live_activations == tuple([m] * p)
    std = simulate(Std1F1B(p), m, UNIT).peak_live_activations
    assert std == tuple(min(m, p - r) for r in range(p))
    if m >= p:
        assert std[0] == p
    eager = simulate(Eager1F1B(p), m, UNIT).peak_live_activations
    assert eager == tuple(min(m, 2 * (p - r) - 1) for r in range(p))
    zb = simulate(ZeroBubble(p), m, SPLIT_UNIT).peak_live_activations
    # ZB-H1 keeps every rank at or below 1F1B's peak (rank 0's min(m, p)).
    assert zb == tuple([min(m, p)] * p)
    assert max(zb) <= max(std)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_peak_activations_interleaved(p, v, rounds):
    # Megatron / Korthikanti et al.: rank r holds its warm-up forwards plus one,
    # min(v m, (v-1) p + 2 (p-1-r) + 1) chunk activations; on rank 0 that is v p + p - 1
    # chunks = (p + (p-1)/v) full-stage activations once m is large enough.
    m = rounds * p
    sim = simulate(Interleaved1F1B(v * p, p), m, UNIT)
    expected = tuple(min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p))
    assert sim.peak_live_activations == expected
    if v * m >= v * p + p - 1:
        assert sim.peak_live_activations[0] / v == pytest.approx(p + (p - 1) / v)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_peak_activations_dualpipev(p):
    # 2p+1 stage activations per rank = (p + 1/2) activations of a full rank (two stages).
    sim = simulate(DualPipeV(p), 4 * p, SPLIT_UNIT)
    assert sim.peak_live_activations == tuple([2 * p + 1] * p)


def test_fused_task_activation_is_live_for_its_duration():
    sim = simulate(Interleaved1F1B(2, 2), 2, UNIT)
    # Rank 1 runs FusedTask(fwd_1__k, bwd_1__k): one live activation during each.
    steps = sim.live_activations_per_rank[1]
    assert max(c for _, c in steps) == 1
    assert steps[0] == (0.0, 0) and steps[-1][1] == 0


def test_live_activation_step_function():
    sim = simulate(Std1F1B(2), 3, UNIT)
    # Rank 1: F0 [1,2) B0 [2,3) F1 [3,4) B1 [4,5) F2 [5,6) B2 [6,7).
    assert sim.live_activations_per_rank[1] == (
        (0.0, 0),
        (2.0, 1),
        (3.0, 0),
        (4.0, 1),
        (5.0, 0),
        (6.0, 1),
        (7.0, 0),
    )
    for steps in sim.live_activations_per_rank:
        times = [t for t, _ in steps]
        assert times == sorted(times) and steps[-1][1] == 0


# ---------------------------------------------------------------------------------------------
# Costs, transfers, events
# ---------------------------------------------------------------------------------------------


def test_transfer_cost_gpipe_exact_and_eager_hides_it():
    for p, m in [(2, 4), (3, 5), (4, 8), (5, 7)]:
        for t in (0.25, 0.5, 1.0):
            costs = Costs(fwd=1.0, bwd=2.0, transfer=t)
            gpipe = simulate(GPipe(p), m, costs).makespan
            # Each of the 2(p-1) stage boundaries on the critical path pays one transfer.
            assert gpipe == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * t, abs=EXACT)
            std = simulate(Std1F1B(p), m, costs).makespan
            eager = simulate(Eager1F1B(p), m, costs).makespan
            assert eager < std  # the extra warm-up forwards hide the latency
            assert eager == pytest.approx(gpipe, abs=EXACT)


def test_transfer_only_between_ranks():
    # DualPipeV's middle stages p-1 and p share a rank: no transfer between them.
    p = 2
    costs = Costs(fwd=1.0, bwd_i=1.0, bwd_w=1.0, transfer=10.0)
    sim = simulate(DualPipeV(p), 2 * p, costs)
    starts = {str(item): start for _, item, start, _ in sim.items}
    assert starts["fwd_2__0"] == starts["fwd_1__0"] + 1.0  # same rank (1): back to back
    assert starts["fwd_1__0"] >= starts["fwd_0__0"] + 1.0 + 10.0  # crosses ranks 0 -> 1


def test_blocking_transfers_by_hand():
    """`transfers="blocking"`: a transfer holds both ranks' streams, at its place in the
    engine's dispatch order. Std1F1B(2), 2 microbatches, fwd 1, bwd 2, transfer 0.5. The dispatch
    order (the free-transfer replay by start, then rank): f0_0 f0_1 f1_0 b1_0 b0_0 f1_1 b1_1 b0_1,
    each value sent right after its producer. By hand: f0_0 [0,1], send [1,1.5]; f0_1 [1.5,2.5],
    send [2.5,3] (rank 1 takes it before f1_0, which comes later in the order); f1_0 [3,4];
    b1_0 [4,6], send [6,6.5]; b0_0 [6.5,8.5]; f1_1 [6.5,7.5]; b1_1 [7.5,9.5], send [9.5,10];
    b0_1 [10,12]. Overlapped (latency only): f1_0 [1.5,2.5], b1_0 [2.5,4.5], f1_1 [4.5,5.5],
    b1_1 [5.5,7.5], b0_0 [5,7], b0_1 [8,10]."""
    costs = Costs(fwd=1.0, bwd=2.0, transfer=0.5)
    blocking = simulate(Std1F1B(2), 2, costs, transfers="blocking")
    starts = {str(item): (start, end) for _, item, start, end in blocking.items}
    assert starts == {
        "fwd_0__0": (0.0, 1.0),
        "fwd_0__1": (1.5, 2.5),
        "fwd_1__0": (3.0, 4.0),
        "bwd_1__0": (4.0, 6.0),
        "bwd_0__0": (6.5, 8.5),
        "fwd_1__1": (6.5, 7.5),
        "bwd_1__1": (7.5, 9.5),
        "bwd_0__1": (10.0, 12.0),
    }
    assert blocking.makespan == 12.0
    assert blocking.bubble == pytest.approx((2 * 12 - 12) / (2 * 12), abs=EXACT)
    assert simulate(Std1F1B(2), 2, costs).makespan == 10.0  # overlapped, the default
    with pytest.raises(ValueError, match="transfers='eager'"):
        simulate(Std1F1B(2), 2, costs, transfers="eager")


@pytest.mark.parametrize("sched", [GPipe(4), Std1F1B(4), Interleaved1F1B(8, 4), ZeroBubble(4)])
def test_blocking_transfers_never_beat_overlapped(sched):
    """Holding both streams can only delay: for every schedule and transfer cost, the blocking
    step is at least as long as the overlapped one, and with free transfers the dispatch order
    alone may cost (a rank waits for its peer's stream to reach the transfer)."""
    for t in (0.0, 0.25, 1.0):
        costs = Costs(fwd=1.0, bwd=2.0, transfer=t)
        over = simulate(sched, 8, costs).makespan
        assert simulate(sched, 8, costs, transfers="blocking").makespan >= over


def test_per_task_costs_override_by_phase_and_stage():
    costs = Costs(fwd=1.0, bwd=2.0, per_task={(Phase.FWD, 1): 5.0, (Phase.BWD, 0): 0.5})
    assert costs.task_cost(Task(1, 0, F)) == 5.0
    assert costs.task_cost(Task(0, 3, F)) == 1.0
    assert costs.task_cost(Task(0, 3, B)) == 0.5
    assert costs.item_cost(FusedTask((Task(1, 0, F), Task(1, 0, B)))) == 7.0
    sim = simulate(GPipe(2), 2, costs)
    assert sim.busy_per_rank == (2 * 1.0 + 2 * 0.5, 2 * 5.0 + 2 * 2.0)
    # The slow stage dominates: 2 x 5 forwards + 2 x 2 backwards after rank 0's first forward,
    # then rank 0's last backward.
    assert sim.makespan == pytest.approx(1.0 + 10.0 + 4.0 + 0.5, abs=EXACT)


def test_fused_task_cost_is_the_sum():
    sim = simulate(Interleaved1F1B(2, 2), 2, Costs(fwd=1.0, bwd=2.0))
    for ev in sim.events:
        if ev.kind == "fused":
            assert ev.duration == pytest.approx(3.0)
            assert ev.name.startswith("FusedTask(fwd_1__")


def test_costs_validation():
    with pytest.raises(ValueError, match="Costs.fwd=0: task costs must be > 0"):
        Costs(fwd=0)
    with pytest.raises(ValueError, match="Costs.transfer=-1: must be >= 0"):
        Costs(transfer=-1)
    with pytest.raises(ValueError, match=r"use \(Phase, stage\)"):
        Costs(per_task={("fwd", 0): 1.0})
    assert hash(Costs(per_task={(F, 0): 2.0})) == hash(Costs(per_task={(F, 0): 2.0}))


@pytest.mark.parametrize(
    "sched, m",
    [
        (GPipe(3), 4),
        (Std1F1B(4), 6),
        (Interleaved1F1B(8, 4), 8),
        (ZeroBubble(3), 5),
        (DualPipeV(3), 7),
        (DualPipeV(2, fuse_overlap=True), 5),
    ],
)
def test_events_are_a_valid_dispatch_order(sched, m):
    costs = Costs(fwd=1.0, bwd=2.0, bwd_i=1.2, bwd_w=0.7, transfer=0.3)
    sim = simulate(sched, m, costs)
    assert len(sim.events) == len(sim.items) == sum(len(row) for row in sched.tasks(m))
    keys = [(ev.start, ev.rank) for ev in sim.events]
    assert keys == sorted(keys)
    position = {}
    for i, (rank, item, start, end) in enumerate(sim.items):
        ev = sim.events[i]
        assert (ev.rank, ev.name, ev.start, ev.end) == (rank, str(item), start, end)
        assert ev.kind == ("fused" if isinstance(item, FusedTask) else item.phase.value)
        assert ev.kind in {"fwd", "bwd", "bwdI", "bwdW", "fused"}
        inner = item.tasks if isinstance(item, FusedTask) else (item,)
        for task in inner:
            position[task] = (i, start, end)
    for task, (i, start, _) in position.items():
        for dep in task_dependencies(task, sched.num_stages, sched.split_backward):
            j, _, dep_end = position[dep]
            assert j <= i and dep_end <= start + EXACT or j == i
    # Per rank, events run in list order without overlap.
    for rank in range(sched.mpmd_dim):
        mine = [ev for ev in sim.events if ev.rank == rank]
        assert [ev.name for ev in mine] == [str(x) for x in sched.tasks(m)[rank]]
        for a, b in zip(mine, mine[1:], strict=False):
            assert a.end <= b.start + EXACT
    assert sim.makespan == max(ev.end for ev in sim.events)
    assert sim.num_ranks == sched.mpmd_dim


def test_busy_and_bubble_accounting():
    sim = simulate(Std1F1B(3), 4, Costs(fwd=1.0, bwd=2.0))
    assert sim.busy_per_rank == (12.0, 12.0, 12.0)
    idle = sum(sim.makespan - b for b in sim.busy_per_rank)
    assert sim.bubble == pytest.approx(idle / (3 * sim.makespan))
    assert sim.bubble_per_rank == tuple((sim.makespan - 12.0) / sim.makespan for _ in range(3))


def test_raw_per_rank_lists():
    rows = ZeroBubble(3).tasks(4)
    sim = simulate(rows, 4, SPLIT_UNIT)
    assert sim.makespan == simulate(ZeroBubble(3), 4, SPLIT_UNIT).makespan
    v_rows = DualPipeV(2).tasks(4)
    with pytest.raises(ScheduleError, match="stage_to_rank"):
        simulate(v_rows, 4, SPLIT_UNIT)  # default placement s % 2 is wrong for a V
    sim = simulate(v_rows, 4, SPLIT_UNIT, stage_to_rank=[0, 1, 1, 0])
    assert sim.makespan == simulate(DualPipeV(2), 4, SPLIT_UNIT).makespan


def test_simulate_rejects_conflicting_arguments():
    with pytest.raises(ValueError, match="mpmd_dim=2 contradicts Std1F1B"):
        simulate(Std1F1B(4), 4, mpmd_dim=2)


def test_deadlock_raises_with_the_grid():
    rows = [
        [Task(0, 0, F), Task(0, 0, B), Task(0, 1, F), Task(0, 1, B)],
        [Task(1, 0, F), Task(1, 1, F), Task(1, 0, B), Task(1, 1, B)],
    ]
    with pytest.raises(ScheduleError) as info:
        simulate(rows, 2, UNIT)
    msg = str(info.value)
    assert msg.startswith("invalid schedule: deadlock, no rank can make progress")
    assert "rank 0 |  fwd_0__0 >bwd_0__0< fwd_0__1  bwd_0__1" in msg
    assert "rank 1 |  fwd_1__0 >fwd_1__1< bwd_1__0  bwd_1__1" in msg


def test_event_record_format():
    ev = Event(rank=1, name="fwd_1__0", kind="fwd", start=1.0, end=2.5)
    assert ev.duration == 1.5
    with pytest.raises(AttributeError):
        ev.start = 0.0
