"""Schedules as data: task strings, the seed tutorial's task lists (golden), the shape of every
built-in schedule and its validation; the validator's error messages are in
tests/test_schedule_validator.py."""

import pytest

from jaxpp_integration.schedules import (
    SCHEDULE_NAMES,
    DualPipeV,
    Eager1F1B,
    FusedTask,
    GPipe,
    Interleaved1F1B,
    Phase,
    Schedule,
    ScheduleError,
    Std1F1B,
    Task,
    UserSchedule,
    ZeroBubble,
    schedule_from_name,
)

F, B, BI, BW = Phase.FWD, Phase.BWD, Phase.BWD_I, Phase.BWD_W


def names(row):
    return [str(item) for item in row]


def fused(stage, mb):
    return f"FusedTask(fwd_{stage}__{mb}, bwd_{stage}__{mb})"


# ---------------------------------------------------------------------------------------------
# Task vocabulary
# ---------------------------------------------------------------------------------------------


def test_task_strings():
    assert str(Task(3, 0, F)) == "fwd_3__0"
    assert str(Task(3, 0, B)) == "bwd_3__0"
    assert str(Task(3, 0, BI)) == "bwdI_3__0"
    assert str(Task(3, 0, BW)) == "bwdW_3__0"
    assert repr(Task(12, 7, F)) == "fwd_12__7"
    pair = FusedTask((Task(3, 0, F), Task(3, 0, B)))
    assert str(pair) == "FusedTask(fwd_3__0, bwd_3__0)"
    assert list(pair) == [Task(3, 0, F), Task(3, 0, B)]
    assert len(pair) == 2


def test_tasks_are_hashable_values():
    assert Task(1, 2, F) == Task(1, 2, F)
    assert len({Task(1, 2, F), Task(1, 2, F), Task(1, 2, B)}) == 2
    assert FusedTask([Task(0, 0, F)]) == FusedTask((Task(0, 0, F),))  # list normalised
    with pytest.raises(AttributeError):
        Task(1, 2, F).stage = 3
    with pytest.raises(ScheduleError, match="one or more Task"):
        FusedTask(())


# ---------------------------------------------------------------------------------------------
# Golden task lists (seed tutorial, plus the ranks it does not print)
# ---------------------------------------------------------------------------------------------


def test_seed_interleaved_4_stages_rank_2():
    got = names(Interleaved1F1B(num_stages=4, mpmd_dim=4).tasks(4)[2])
    assert got == "fwd_2__0 fwd_2__1 fwd_2__2 bwd_2__0 fwd_2__3 bwd_2__1 bwd_2__2 bwd_2__3".split()


def test_seed_interleaved_4_stages_rank_3_is_fused():
    got = names(Interleaved1F1B(num_stages=4, mpmd_dim=4).tasks(4)[3])
    assert got == [fused(3, k) for k in range(4)]


def test_seed_interleaved_8_stages_rank_0():
    got = names(Interleaved1F1B(num_stages=8, mpmd_dim=4).tasks(4)[0])
    expected = (
        [f"fwd_0__{k}" for k in range(4)]
        + [f"fwd_4__{k}" for k in range(4)]
        + [f"bwd_4__{k}" for k in range(4)]
        + [f"bwd_0__{k}" for k in range(4)]
    )
    assert got == expected


def test_seed_interleaved_8_stages_rank_3():
    got = names(Interleaved1F1B(num_stages=8, mpmd_dim=4).tasks(4)[3])
    expected = (
        [f"fwd_3__{k}" for k in range(4)]
        + [fused(7, k) for k in range(4)]
        + [f"bwd_3__{k}" for k in range(4)]
    )
    assert got == expected


def test_interleaved_other_ranks_golden():
    four = Interleaved1F1B(4, 4).tasks(4)
    for rank in (0, 1):
        assert names(four[rank]) == [f"fwd_{rank}__{k}" for k in range(4)] + [
            f"bwd_{rank}__{k}" for k in range(4)
        ]
    eight = Interleaved1F1B(8, 4).tasks(4)
    assert names(eight[1]) == (
        [f"fwd_1__{k}" for k in range(4)]
        + [f"fwd_5__{k}" for k in range(4)]
        + [f"bwd_5__{k}" for k in range(4)]
        + [f"bwd_1__{k}" for k in range(4)]
    )
    assert names(eight[2]) == (
        [f"fwd_2__{k}" for k in range(4)]
        + "fwd_6__0 fwd_6__1 fwd_6__2 bwd_6__0 fwd_6__3 bwd_6__1 bwd_6__2 bwd_6__3".split()
        + [f"bwd_2__{k}" for k in range(4)]
    )


def test_interleaved_fuse_steady_state_default_fuses_only_the_last_stage():
    # JaxPP's flag: False (the default) fuses the last stage's fwd/bwd pair and nothing else.
    assert Interleaved1F1B(8, 4) == Interleaved1F1B(8, 4, fuse_steady_state=False)
    rows = Interleaved1F1B(8, 4).tasks(8)
    fused_items = [(rank, item) for rank, row in enumerate(rows) for item in row]
    fused_items = [(rank, item) for rank, item in fused_items if isinstance(item, FusedTask)]
    assert {rank for rank, _ in fused_items} == {3}
    assert [str(item) for _, item in fused_items] == [fused(7, k) for k in range(8)]


def test_interleaved_fuse_steady_state_true_fuses_every_steady_state_pair():
    four = Interleaved1F1B(4, 4, fuse_steady_state=True).tasks(4)
    # Rank 2: 2 warm-up forwards, 2 steady-state pairs (fwd of mb k+2 with bwd of mb k), cool-down.
    assert names(four[2]) == [
        "fwd_2__0",
        "fwd_2__1",
        "FusedTask(fwd_2__2, bwd_2__0)",
        "FusedTask(fwd_2__3, bwd_2__1)",
        "bwd_2__2",
        "bwd_2__3",
    ]
    assert names(four[3]) == [fused(3, k) for k in range(4)]
    assert names(four[0]) == [f"fwd_0__{k}" for k in range(4)] + [f"bwd_0__{k}" for k in range(4)]
    eight = Interleaved1F1B(8, 4, fuse_steady_state=True).tasks(8)
    assert names(eight[2]) == (
        [f"fwd_2__{k}" for k in range(4)]
        + ["fwd_6__0", "fwd_6__1"]
        + [
            "FusedTask(fwd_6__2, bwd_6__0)",
            "FusedTask(fwd_6__3, bwd_6__1)",
            "FusedTask(fwd_2__4, bwd_6__2)",
            "FusedTask(fwd_2__5, bwd_6__3)",
            "FusedTask(fwd_2__6, bwd_2__0)",
            "FusedTask(fwd_2__7, bwd_2__1)",
            "FusedTask(fwd_6__4, bwd_2__2)",
            "FusedTask(fwd_6__5, bwd_2__3)",
            "FusedTask(fwd_6__6, bwd_6__4)",
            "FusedTask(fwd_6__7, bwd_6__5)",
        ]
        + ["bwd_6__6", "bwd_6__7", "bwd_2__4", "bwd_2__5", "bwd_2__6", "bwd_2__7"]
    )
    # Every rank: the same tasks in the same order as the default, only grouped differently.
    default = Interleaved1F1B(8, 4).tasks(8)
    for rank in range(4):
        assert list(iter_items(eight[rank])) == list(iter_items(default[rank]))
        pairs = [item for item in eight[rank] if isinstance(item, FusedTask)]
        singles = [item for item in eight[rank] if not isinstance(item, FusedTask)]
        assert all([t.phase for t in pair] == [F, B] for pair in pairs)
        # warm-up + cool-down: (v-1) p + 2 (p-1-r) each
        assert len(singles) == 2 * (4 + 2 * (3 - rank))
    assert repr(Interleaved1F1B(4, 4, fuse_steady_state=True)).endswith("fuse_steady_state=True)")


def test_interleaved_two_rounds_rank_0():
    # m = 2p: microbatches enter each chunk in groups of p (Megatron's depth-first order).
    row = Interleaved1F1B(4, 2).tasks(4)[0]
    assert (
        names(row)
        == (
            "fwd_0__0 fwd_0__1 fwd_2__0 fwd_2__1 fwd_0__2 "
            "bwd_2__0 fwd_0__3 bwd_2__1 fwd_2__2 bwd_0__0 fwd_2__3 bwd_0__1 "
            "bwd_2__2 bwd_2__3 bwd_0__2 bwd_0__3"
        ).split()
    )


# ---------------------------------------------------------------------------------------------
# Shape of the single-chunk schedules
# ---------------------------------------------------------------------------------------------


def forwards_before_first_backward(row):
    """Forward tasks (fused ones included) before the first backward task."""
    count = 0
    for task in iter_items(row):
        if task.phase is not F:
            return count
        count += 1
    return count


def iter_items(row):
    for item in row:
        yield from (item.tasks if isinstance(item, FusedTask) else (item,))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16])
def test_warmup_counts(p, m):
    for rank in range(p):
        gpipe, std, eager = GPipe(p).tasks(m), Std1F1B(p).tasks(m), Eager1F1B(p).tasks(m)
        assert forwards_before_first_backward(gpipe[rank]) == m
        # 1F1B: p-1-r warm-up forwards, then the steady state starts with one more forward.
        assert forwards_before_first_backward(std[rank]) == min(m, p - rank)
        # JaxPP's Eager1F1B: 2(p-r)-1 forwards before the first backward.
        assert forwards_before_first_backward(eager[rank]) == min(m, 2 * (p - rank) - 1)


def test_eager_rank_0_of_4_runs_7_forwards_and_the_last_rank_1_like_std1f1b():
    rows = Eager1F1B(4).tasks(16)
    assert names(rows[0][:9]) == [f"fwd_0__{k}" for k in range(7)] + ["bwd_0__0", "fwd_0__7"]
    assert names(rows[2][:4]) == ["fwd_2__0", "fwd_2__1", "fwd_2__2", "bwd_2__0"]
    # The last rank: as Std1F1B, but each pair fused as in JaxPP (Eager1F1B is its
    # Interleaved1F1B with one chunk, whose default fuses the last stage's pairs).
    assert names(rows[3]) == [fused(3, k) for k in range(16)]
    std_last = Std1F1B(4).tasks(16)[3]
    assert list(iter_items(rows[3])) == list(iter_items(std_last))


def test_gpipe_and_1f1b_order():
    assert (
        names(GPipe(2).tasks(3)[1])
        == "fwd_1__0 fwd_1__1 fwd_1__2 bwd_1__0 bwd_1__1 bwd_1__2".split()
    )
    assert names(Std1F1B(3).tasks(4)[0]) == (
        "fwd_0__0 fwd_0__1 fwd_0__2 bwd_0__0 fwd_0__3 bwd_0__1 bwd_0__2 bwd_0__3".split()
    )


def test_zero_bubble_phases_and_order():
    sched = ZeroBubble(3)
    assert sched.split_backward is True
    assert Std1F1B(3).split_backward is False
    rows = sched.tasks(4)
    for row in rows:
        assert {t.phase for t in iter_items(row)} == {F, BI, BW}
    # Rank 2 (last) defers its first two weight gradients.
    assert (
        names(rows[2])
        == (
            "fwd_2__0 bwdI_2__0 fwd_2__1 bwdI_2__1 fwd_2__2 bwdI_2__2 bwdW_2__0 "
            "fwd_2__3 bwdI_2__3 bwdW_2__1 bwdW_2__2 bwdW_2__3"
        ).split()
    )
    assert names(rows[0])[:4] == "fwd_0__0 fwd_0__1 fwd_0__2 bwdI_0__0".split()


def test_dualpipev_placement_and_requirements():
    sched = DualPipeV(4)
    assert sched.num_stages == 8
    assert [sched.stage_to_rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sched.rank_stages(0) == (0, 7)
    assert sched.rank_stages(3) == (3, 4)
    with pytest.raises(ScheduleError, match="at least 2 \\* mpmd_dim = 8 microbatches"):
        sched.tasks(7)
    assert repr(sched) == "DualPipeV(mpmd_dim=4)"
    assert repr(DualPipeV(2, split_backward=False)) == "DualPipeV(mpmd_dim=2, split_backward=False)"
    no_split = DualPipeV(2, split_backward=False).tasks(4)
    assert {t.phase for row in no_split for t in iter_items(row)} == {F, B}
    pairs = DualPipeV(2, fuse_overlap=True).tasks(6)
    assert any(isinstance(item, FusedTask) for row in pairs for item in row)


def test_placement_and_rank_stages():
    sched = Interleaved1F1B(12, 4)
    assert sched.virtual_stages == 3
    assert sched.rank_stages(1) == (1, 5, 9)
    assert sched.stage_to_rank(10) == 2
    with pytest.raises(ValueError, match="stage 12 out of range"):
        sched.stage_to_rank(12)
    assert Std1F1B(4).rank_stages(2) == (2,)


def test_reprs_and_hashing():
    assert repr(Std1F1B(mpmd_dim=4)) == "Std1F1B(mpmd_dim=4)"
    assert repr(Interleaved1F1B(num_stages=8, mpmd_dim=4)) == (
        "Interleaved1F1B(num_stages=8, mpmd_dim=4)"
    )
    assert repr(GPipe(2)) == "GPipe(mpmd_dim=2)"
    assert repr(ZeroBubble(2)) == "ZeroBubble(mpmd_dim=2)"
    assert Std1F1B(4) == Std1F1B(4) and hash(Std1F1B(4)) == hash(Std1F1B(4))
    assert Std1F1B(4) != GPipe(4)
    assert len({Interleaved1F1B(8, 4), Interleaved1F1B(8, 4), DualPipeV(4)}) == 2
    with pytest.raises(AttributeError):
        Std1F1B(4).mpmd_dim = 2


def test_constructor_errors():
    with pytest.raises(ScheduleError, match="num_stages must be a multiple of mpmd_dim"):
        Interleaved1F1B(num_stages=6, mpmd_dim=4)
    with pytest.raises(ScheduleError, match="must be a multiple of mpmd_dim=4; use 8"):
        Interleaved1F1B(8, 4).tasks(6)
    with pytest.raises(ScheduleError, match="mpmd_dim must be an int >= 1"):
        Std1F1B(0)
    with pytest.raises(ScheduleError, match="need an int >= 1"):
        Std1F1B(2).tasks(0)


# ---------------------------------------------------------------------------------------------
# Every built-in schedule passes the validator
# ---------------------------------------------------------------------------------------------

TABLE = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 5, 7, 8, 16)]


@pytest.mark.parametrize(("p", "m"), TABLE)
def test_single_chunk_schedules_validate(p, m):
    for sched in (GPipe(p), Std1F1B(p), Eager1F1B(p), ZeroBubble(p)):
        sched.validate(m)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_validates(p, v, rounds):
    for fuse in (True, False):
        Interleaved1F1B(v * p, p, fuse_steady_state=fuse).validate(rounds * p)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("extra", [0, 1, 3, 2 * 8])
def test_dualpipev_validates(p, extra):
    m = 2 * p + extra
    for split in (True, False):
        for fuse in (True, False):
            DualPipeV(p, split_backward=split, fuse_overlap=fuse).validate(m)


COMPLETE = [
    (GPipe(3), 5),
    (Std1F1B(4), 6),
    (Eager1F1B(4), 9),
    (Interleaved1F1B(12, 4), 8),
    (Interleaved1F1B(8, 4, fuse_steady_state=True), 8),
    (ZeroBubble(5), 9),
    (DualPipeV(3), 7),
    (DualPipeV(3, fuse_overlap=True), 8),
    (DualPipeV(2, split_backward=False), 5),
]


@pytest.mark.parametrize(("sched", "m"), COMPLETE, ids=[repr(s) for s, _ in COMPLETE])
def test_every_schedule_runs_each_stage_microbatch_phase_exactly_once(sched, m):
    phases = (F, BI, BW) if sched.split_backward else (F, B)
    all_tasks = [t for row in sched.tasks(m) for t in iter_items(row)]
    assert len(all_tasks) == sched.num_stages * m * len(phases)
    stages = range(sched.num_stages)
    expected = {Task(s, mb, ph) for s in stages for mb in range(m) for ph in phases}
    assert set(all_tasks) == expected
    # ... each on the rank its stage lives on
    for rank, row in enumerate(sched.tasks(m)):
        assert {t.stage for t in iter_items(row)} == set(sched.rank_stages(rank))


# ---------------------------------------------------------------------------------------------
# schedule_from_name
# ---------------------------------------------------------------------------------------------


def test_schedule_from_name():
    assert schedule_from_name("gpipe", 4, 4) == GPipe(4)
    assert schedule_from_name("1f1b", 4, 4) == Std1F1B(4)
    assert schedule_from_name("eager_1f1b", 4, 4) == Eager1F1B(4)
    assert schedule_from_name("interleaved_1f1b", 8, 4) == Interleaved1F1B(8, 4)
    assert schedule_from_name("zero_bubble", 2, 2) == ZeroBubble(2)
    assert schedule_from_name("dualpipev", 8, 4) == DualPipeV(4)
    assert set(SCHEDULE_NAMES) == {
        "gpipe",
        "1f1b",
        "eager_1f1b",
        "interleaved_1f1b",
        "zero_bubble",
        "dualpipev",
    }
    for name in SCHEDULE_NAMES:
        stages = 8 if name == "dualpipev" else 4
        assert isinstance(schedule_from_name(name, stages, 4), Schedule)


def test_schedule_from_name_errors():
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'pipedream'; valid names: "):
        schedule_from_name("pipedream", 4, 4)
    with pytest.raises(ScheduleError, match="gpipe, 1f1b, eager_1f1b, interleaved_1f1b"):
        schedule_from_name("pipedream", 4, 4)
    with pytest.raises(ScheduleError, match=r"num_stages \(8\) must equal mpmd_dim \(4\)"):
        schedule_from_name("1f1b", 8, 4)
    with pytest.raises(ScheduleError, match=r"num_stages \(4\) must be 2 \* mpmd_dim \(8\)"):
        schedule_from_name("dualpipev", 4, 4)


# ---------------------------------------------------------------------------------------------
# UserSchedule
# ---------------------------------------------------------------------------------------------


def test_user_schedule_from_lists():
    rows = Std1F1B(3).tasks(4)
    sched = UserSchedule(rows, num_stages=3, mpmd_dim=3)
    assert sched.tasks(4) == rows
    assert sched.split_backward is False
    sched.validate(4)
    assert sched == UserSchedule(rows, 3, 3) and hash(sched) == hash(UserSchedule(rows, 3, 3))
    with pytest.raises(ScheduleError, match="lists tasks for 4 microbatches but 8 were asked"):
        sched.tasks(8)
    with pytest.raises(AttributeError, match="immutable"):
        sched.mpmd_dim = 2


def test_user_schedule_split_backward_is_inferred():
    sched = UserSchedule(ZeroBubble(2).tasks(3), 2, 2)
    assert sched.split_backward is True


def test_user_schedule_from_callable_and_placement():
    v_shape = DualPipeV(2)
    sched = UserSchedule(v_shape.tasks, 4, 2, stage_to_rank=[0, 1, 1, 0], split_backward=True)
    assert sched.tasks(5) == v_shape.tasks(5)
    sched.validate(5)
    assert sched.rank_stages(1) == (1, 2)
    looped = UserSchedule(v_shape.tasks, 4, 2, split_backward=True)  # default s % 2: wrong here
    with pytest.raises(ScheduleError, match="but stage_to_rank\\(3\\) = 1; move it to rank 1"):
        looped.validate(4)


def test_user_schedule_rejects_a_broken_list_at_construction():
    rows = Std1F1B(2).tasks(2)
    rows[1] = rows[1][::-1]
    with pytest.raises(ScheduleError, match="invalid schedule: bwd_1__1 on rank 1 \\(step 0\\)"):
        UserSchedule(rows, 2, 2)


def test_user_schedule_bad_placement():
    with pytest.raises(ScheduleError, match="stage_to_rank\\(1\\) = 5 is not a rank"):
        UserSchedule(lambda n: [], 2, 2, stage_to_rank=[0, 5])
