"""The schedule validator: each kind of error a task list can have, its one-line reason and the
grid it prints with the offending task marked."""

import pytest

from jaxpp_integration.schedules import (
    FusedTask,
    GPipe,
    Interleaved1F1B,
    Phase,
    ScheduleError,
    Std1F1B,
    Task,
    ZeroBubble,
    format_grid,
    validate_tasks,
)

F, B, BI, BW = Phase.FWD, Phase.BWD, Phase.BWD_I, Phase.BWD_W


def check(rows, num_stages, mpmd_dim, m, split=False, stage_to_rank=None):
    with pytest.raises(ScheduleError) as info:
        validate_tasks(rows, num_stages, mpmd_dim, m, split, stage_to_rank)
    return str(info.value)


def grid_lines(message):
    return message.splitlines()[1:]


def test_same_rank_dependency_order():
    rows = Std1F1B(3).tasks(3)
    rows[1].remove(Task(1, 0, B))
    rows[1].insert(0, Task(1, 0, B))
    msg = check(rows, 3, 3, 3)
    first = msg.splitlines()[0]
    assert first == (
        "invalid schedule: bwd_1__0 on rank 1 (step 0) runs before fwd_1__0 (step 1) which it "
        "needs; reorder rank 1's list"
    )
    lines = grid_lines(msg)
    assert lines[0].split() == ["|"] + [w for i in range(6) for w in ("step", str(i))]
    assert lines[2].startswith("rank 1 | >bwd_1__0< fwd_1__0 ")
    assert lines[1].startswith("rank 0 |  fwd_0__0  fwd_0__1 ")
    assert len(lines) == 5  # header, 3 ranks, legend
    assert ">bwd_1__0<" in msg and msg.count(">") == 2  # one marked cell plus the legend


def test_backward_needs_the_next_stage_backward_on_the_same_rank():
    # Two stages on one rank: bwd_0 listed before bwd_1 of the same microbatch.
    rows = [[Task(0, 0, F), Task(1, 0, F), Task(0, 0, B), Task(1, 0, B)]]
    msg = check(rows, 2, 1, 1)
    assert msg.splitlines()[0] == (
        "invalid schedule: bwd_0__0 on rank 0 (step 2) runs before bwd_1__0 (step 3) which it "
        "needs; reorder rank 0's list"
    )
    assert "rank 0 |  fwd_0__0  fwd_1__0 >bwd_0__0< bwd_1__0" in msg


def test_fused_task_inner_order_matters():
    rows = [[Task(0, 0, F), Task(0, 0, B)], [FusedTask((Task(1, 0, B), Task(1, 0, F)))]]
    msg = check(rows, 2, 2, 1)
    assert "bwd_1__0 on rank 1 (step 0) runs before fwd_1__0 (step 0) which it needs" in msg
    assert ">bwd_1__0+fwd_1__0<" in msg


def test_microbatch_order_of_backward():
    rows = Std1F1B(3).tasks(3)
    rows[2] = [
        Task(2, 1, F),
        Task(2, 1, B),
        Task(2, 0, F),
        Task(2, 0, B),
        Task(2, 2, F),
        Task(2, 2, B),
    ]
    msg = check(rows, 3, 3, 3)
    assert msg.splitlines()[0] == (
        "invalid schedule: bwd_2__1 on rank 2 (step 1) runs before bwd_2__0 (step 3); a stage's "
        "backward must run in microbatch order (gradients are accumulated in that order); "
        "reorder rank 2's list"
    )
    assert ">bwd_2__1<" in msg


def test_microbatch_order_of_weight_gradients():
    rows = ZeroBubble(2).tasks(2)
    rows[1] = [Task(1, 0, F), Task(1, 0, BI), Task(1, 1, F), Task(1, 1, BI)]
    rows[1] += [Task(1, 1, BW), Task(1, 0, BW)]
    msg = check(rows, 2, 2, 2, split=True)
    assert "bwdW_1__1 on rank 1 (step 4) runs before bwdW_1__0 (step 5)" in msg


def test_deadlock_is_reported_with_the_wait_cycle():
    rows = [
        [Task(0, 0, F), Task(0, 0, B), Task(0, 1, F), Task(0, 1, B)],
        [Task(1, 0, F), Task(1, 1, F), Task(1, 0, B), Task(1, 1, B)],
    ]
    msg = check(rows, 2, 2, 2)
    assert msg.splitlines()[0] == (
        "invalid schedule: deadlock, no rank can make progress: bwd_0__0 on rank 0 (step 1) "
        "waits for bwd_1__0 (rank 1, step 2); fwd_1__1 on rank 1 (step 1) waits for fwd_0__1 "
        "(rank 0, step 2); reorder these ranks' lists so each dependency is scheduled before "
        "the task waiting for it"
    )
    assert "rank 0 |  fwd_0__0 >bwd_0__0< fwd_0__1  bwd_0__1" in msg
    assert "rank 1 |  fwd_1__0 >fwd_1__1< bwd_1__0  bwd_1__1" in msg


def test_deadlock_in_an_interleaved_schedule():
    rows = Interleaved1F1B(8, 4).tasks(4)
    # Rank 3 wants bwd_3__0 before its fused stage-7 tasks: the backward chain
    # 3 <- 4 (rank 0) <- 5 (rank 1) <- 6 (rank 2) <- 7 (rank 3) closes a cycle.
    rows[3] = rows[3][:4] + rows[3][8:9] + rows[3][4:8] + rows[3][9:]
    msg = check(rows, 8, 4, 4)
    first = msg.splitlines()[0]
    assert first.startswith(
        "invalid schedule: deadlock, no rank can make progress: bwd_4__0 on rank 0 (step 8) "
        "waits for bwd_5__0 (rank 1, step 8); "
    )
    assert "bwd_3__0 on rank 3 (step 4) waits for bwd_4__0 (rank 0, step 8)" in first
    assert ">bwd_4__0<" in msg and ">bwd_3__0<" in msg


def test_missing_task():
    rows = Interleaved1F1B(8, 4).tasks(4)
    rows[3].pop(5)  # FusedTask(fwd_7__1, bwd_7__1)
    msg = check(rows, 8, 4, 4)
    assert msg.splitlines()[0] == "invalid schedule: fwd_7__1 is missing; add it to rank 3's list"
    assert msg.splitlines()[-1].endswith("<- missing fwd_7__1")
    assert "fwd_7__0+bwd_7__0" in msg


def test_duplicate_task():
    rows = GPipe(2).tasks(2)
    rows[0].insert(2, Task(0, 1, F))
    msg = check(rows, 2, 2, 2)
    assert msg.splitlines()[0] == (
        "invalid schedule: fwd_0__1 appears twice, on rank 0 (step 1) and rank 0 (step 2); "
        "remove one"
    )
    assert ">fwd_0__1<>fwd_0__1<" in msg.replace(" ", "")


def test_task_on_the_wrong_rank():
    rows = Std1F1B(2).tasks(2)
    rows[0].insert(0, Task(1, 0, F))
    rows[1].remove(Task(1, 0, F))
    msg = check(rows, 2, 2, 2)
    assert msg.splitlines()[0] == (
        "invalid schedule: fwd_1__0 on rank 0 (step 0) but stage_to_rank(1) = 1; "
        "move it to rank 1's list"
    )
    assert "rank 0 | >fwd_1__0<" in msg


def test_stage_on_two_ranks():
    # Placement says both stages live on rank 0, but stage 1's backward sits on rank 1.
    rows = [[Task(0, 0, F), Task(1, 0, F)], [Task(1, 0, B), Task(0, 0, B)]]
    msg = check(rows, 2, 2, 1, stage_to_rank=[0, 0])
    assert msg.splitlines()[0] == (
        "invalid schedule: stage 1 appears on ranks 0 and 1 (bwd_1__0 on rank 1 (step 0)); "
        "a stage lives on one rank, move it to rank 0"
    )
    assert "rank 1 | >bwd_1__0<" in msg


def test_more_stages_than_expected():
    rows = GPipe(2).tasks(1)
    rows[1].append(Task(2, 0, F))
    msg = check(rows, 2, 2, 1)
    assert msg.splitlines()[0] == (
        "invalid schedule: fwd_2__0 on rank 1 (step 2) names stage 2 but the schedule has 2 "
        "stages (0..1); remove it or raise num_stages"
    )
    assert ">fwd_2__0<" in msg


def test_microbatch_out_of_range_and_wrong_phase_and_rank_count():
    rows = GPipe(2).tasks(2)
    assert "names microbatch 2 but there are 2 microbatches" in check(
        [r + [Task(i, 2, F)] for i, r in enumerate(rows)], 2, 2, 2
    )
    msg = check(GPipe(2).tasks(2), 2, 2, 2, split=True)
    assert "has phase bwd but this schedule splits the backward (allowed: fwd, bwdI, bwdW)" in msg
    msg = check(ZeroBubble(2).tasks(2), 2, 2, 2, split=False)
    assert "has phase bwdI but this schedule does not split the backward" in msg
    msg = check(GPipe(2).tasks(2), 2, 3, 2)
    assert msg == (
        "invalid schedule: got 2 rank lists but mpmd_dim=3; return exactly one task list per rank"
    )
    assert "is not a Task or FusedTask" in check([["fwd_0__0"]], 1, 1, 1)


def test_format_grid_alignment():
    rows = Interleaved1F1B(4, 4).tasks(4)
    text = format_grid(rows, marked=[(3, 1)])
    lines = text.splitlines()
    assert len(lines) == 5
    # Columns line up: every row's cells start at the header's column offsets.
    starts = [i for i, ch in enumerate(lines[0]) if lines[0][i : i + 5] == " step"]
    for line in lines[1:4]:
        for col in starts[1 : len(line.split()) - 2]:
            assert line[col] == " "
    assert ">fwd_3__1+bwd_3__1<" in lines[4]
