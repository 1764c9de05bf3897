"""Cross-process order: every pair of processes sends and receives its values in one order.

Checked for every built-in schedule, 2 and 4 groups, odd and even microbatch counts, and every
way of putting the groups on processes (all set partitions: 2 for 2 groups, 15 for 4); a user
schedule that is runnable on one process but would pair transfers out of order between two
processes is rejected with the rank x step grid.
"""

from __future__ import annotations

import pytest

import jaxpp_integration as jaxpp
from jaxpp_integration.schedules import Phase, Task
from jaxpp_integration.schedules.validation import check_cross_process_order


def process_layouts(n_ranks: int):
    """Every assignment of ranks to processes up to renaming the processes."""

    def grow(prefix, used):
        if len(prefix) == n_ranks:
            yield tuple(prefix)
            return
        for p in range(used + 1):
            yield from grow([*prefix, p], max(used, p + 1))

    yield from grow([], 0)


def built_in(d):
    return [
        jaxpp.GPipe(d),
        jaxpp.Std1F1B(d),
        jaxpp.Eager1F1B(d),
        jaxpp.Interleaved1F1B(2 * d, d),
        jaxpp.ZeroBubble(d),
        jaxpp.DualPipeV(d),
    ]


def test_layout_count():
    assert len(list(process_layouts(2))) == 2 and len(list(process_layouts(4))) == 15  # Bell


@pytest.mark.parametrize("d", [2, 4])
def test_built_in_schedules_pair_transfers_in_order(d):
    checked = 0
    for schedule in built_in(d):
        for m in sorted({2 * d, 2 * d + 1, 8}):
            try:
                per_rank = schedule.tasks(m)
            except jaxpp.ScheduleError:  # e.g. interleaved needs a multiple of d
                continue
            for layout in process_layouts(d):
                check_cross_process_order(
                    per_rank,
                    schedule.num_stages,
                    schedule.split_backward,
                    schedule.stage_to_rank,
                    layout,
                )
                checked += 1
    # layouts x (6 schedules x the microbatch counts, less interleaved at an odd count)
    assert checked == (2 * (6 * 3 - 1) if d == 2 else 15 * (6 * 2 - 1))


def _swapped_forward_schedule():
    """Valid on one process (the validator accepts it), but rank 1 runs microbatch 1's forward
    before microbatch 0's while rank 0 sends microbatch 0's activation first."""
    f, b = Phase.FWD, Phase.BWD
    rank0 = [Task(0, 0, f), Task(0, 1, f), Task(0, 0, b), Task(0, 1, b)]
    rank1 = [Task(1, 1, f), Task(1, 0, f), Task(1, 0, b), Task(1, 1, b)]
    return jaxpp.UserSchedule([rank0, rank1], num_stages=2, mpmd_dim=2)


def test_user_schedule_out_of_order_across_processes_is_rejected():
    schedule = _swapped_forward_schedule()
    schedule.validate(2)  # fine on one process: received values wait in memory
    per_rank = schedule.tasks(2)
    check_cross_process_order(per_rank, 2, False, schedule.stage_to_rank, (0, 0))  # one process
    with pytest.raises(jaxpp.ScheduleError) as e:
        check_cross_process_order(per_rank, 2, False, schedule.stage_to_rank, (0, 1))
    msg = str(e.value)
    assert "fwd_1__1 on rank 1 (process 1, step 0) needs fwd_0__1 from rank 0" in msg
    assert "rank 0 sends fwd_0__0 first (step 0)" in msg
    assert "rank 1 | >fwd_1__1<" in msg and "rank 0 | >fwd_0__0<" in msg
