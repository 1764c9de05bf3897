"""Measured pipeline runs in the simulator's terms: timeline events, and costs for ``simulate``.

Calling a compiled step with ``record_times=True`` leaves the engine's raw records in
``compiled.last_events``: one ``(rank, instance_name, code, t_start, t_end)`` tuple per task
instance, in dispatch order, with wall-clock seconds from ``time.perf_counter``. ``code.phase`` is
a ``schedules.Phase`` for loop tasks and ``None`` for the work before and after the loop (e.g. the
optimizer), ``code.stage`` the stage id. This module turns those records into

* ``simulate.Event`` values (``to_events``), ready for ``timeline.draw_timeline``;
* per-(phase, stage) task costs (``measured_costs``), ready for ``simulate(..., costs)``, so a
  measured step can be replayed under any schedule or microbatch count (what-if analysis);
* one summary (``measure_step``): the events, the costs, the measured loop span and busy time per
  rank, and the makespan and bubble that the simulator predicts from those costs.

What a measured timeline shows, and what it does not. The runtime times a task by blocking until
its outputs are ready before it dispatches the next instruction, so with ``record_times=True``
**task instances run one at a time**, in the program's dispatch order: the picture shows each
task's duration and the host's gaps (transfers, deletes, dispatch) between tasks, never two ranks
working at once. The durations are the useful part; the overlap a normal (unrecorded) step gets
from asynchronous dispatch is what ``simulate`` adds back when fed the measured costs. The
measured loop span is therefore close to the *sum* of task durations, and the simulated makespan
lies between the busiest rank's total and that sum (see ``tests/test_measure.py``).

Units: event times and costs are in milliseconds by default (``unit=1e-3`` seconds), with time 0
at the first recorded task of the step.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpp_integration.schedules import Phase, RankId, Schedule, StageId
from jaxpp_integration.schedules.simulate import Costs, Event, Simulation, simulate

__all__ = [
    "MeasuredStep",
    "loop_records",
    "measure_step",
    "measured_costs",
    "to_events",
]

RawEvent = tuple[RankId, str, Any, float, float]  # (rank, instance name, TaskCode, t0, t1)
STATISTICS = ("median", "mean", "min")
COST_FLOOR = 1e-6  # cost of a (phase, stage) that never ran: simulate needs costs > 0


def _check(raw: Sequence[RawEvent] | None) -> Sequence[RawEvent]:
    if raw is None:
        raise ValueError(
            "no measured events: call the compiled step with record_times=True first, "
            "then pass compiled.last_events"
        )
    for rec in raw:
        if len(rec) != 5 or not rec[4] >= rec[3]:
            raise ValueError(
                f"malformed event {rec!r}: expected (rank, name, code, t_start, t_end) "
                "with t_end >= t_start, as in compiled.last_events"
            )
    return raw


def _phase(rec: RawEvent) -> Phase | None:
    return getattr(rec[2], "phase", None)


def loop_records(raw: Sequence[RawEvent]) -> list[RawEvent]:
    """The records of loop tasks (forward / backward of a stage on a microbatch) only."""
    return [rec for rec in _check(raw) if _phase(rec) is not None]


def to_events(
    raw: Sequence[RawEvent] | None,
    *,
    unit: float = 1e-3,
    loop_only: bool = False,
    origin: float | None = None,
) -> list[Event]:
    """``simulate.Event`` records of a measured step, time in ``unit`` seconds from ``origin``.

    ``kind`` is the task's phase (``fwd``, ``bwd``, ``bwdI``, ``bwdW``) and ``other`` for the
    before/after-loop tasks (dropped with ``loop_only=True``). ``origin`` defaults to the first
    kept record's start. The engine runs a ``FusedTask``'s tasks as separate instances, so fused
    items appear as their parts, not as one ``fused`` box.
    """
    if not unit > 0:
        raise ValueError(f"unit={unit!r}: must be > 0 seconds (1e-3 for milliseconds)")
    recs = loop_records(raw) if loop_only else list(_check(raw))
    if not recs:
        return []
    t0 = min(rec[3] for rec in recs) if origin is None else origin
    out = []
    for rank, name, code, start, end in recs:
        phase = getattr(code, "phase", None)
        kind = phase.value if phase is not None else "other"
        out.append(Event(int(rank), str(name), kind, (start - t0) / unit, (end - t0) / unit))
    out.sort(key=lambda ev: (ev.start, ev.rank))
    return out


def _reduce(values: Sequence[float], statistic: str) -> float:
    if statistic == "median":
        return statistics.median(values)
    if statistic == "mean":
        return statistics.fmean(values)
    return min(values)


def measured_costs(
    raw: Sequence[RawEvent] | None,
    schedule: Schedule | None = None,
    *,
    statistic: str = "median",
    unit: float = 1e-3,
    transfer: float = 0.0,
) -> Costs:
    """``Costs`` whose ``per_task`` holds the measured duration of each (phase, stage).

    Each (phase, stage) ran once per microbatch; ``statistic`` (median | mean | min) reduces those
    instances to one cost. ``mean`` keeps the total: simulating the same schedule then does the
    same amount of work as was measured. ``median`` (the default) resists the outliers a loaded
    machine produces. A (phase, stage) that never ran (the engine skips a task with no work)
    costs ``COST_FLOOR``, as do the phase defaults, so nothing unmeasured is charged a made-up
    duration; with ``schedule`` given, a measured stage that the schedule does not have is an
    error (the events come from another program). ``transfer`` (in ``unit``) is not measured:
    the runtime records tasks only.
    """
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r}: use one of {', '.join(STATISTICS)}")
    durations: dict[tuple[Phase, StageId], list[float]] = {}
    for _, _, code, start, end in loop_records(raw):
        durations.setdefault((code.phase, int(code.stage)), []).append((end - start) / unit)
    if not durations:
        raise ValueError("no loop tasks among the measured events; was the step pipelined?")
    per_task = {key: max(_reduce(vals, statistic), COST_FLOOR) for key, vals in durations.items()}
    if schedule is not None:
        bad = sorted({s for _, s in per_task if not 0 <= s < schedule.num_stages})
        if bad:
            raise ValueError(
                f"measured stage(s) {bad} do not exist in {schedule!r}; "
                "pass the schedule the step was compiled with (compiled.schedule)"
            )
    return Costs(
        fwd=COST_FLOOR,
        bwd=COST_FLOOR,
        bwd_i=COST_FLOOR,
        bwd_w=COST_FLOOR,
        transfer=transfer,
        per_task=per_task,
    )


@dataclass(frozen=True)
class MeasuredStep:
    """One recorded step, next to what the simulator predicts from its measured task costs.

    All times in milliseconds. ``loop_span`` runs from the first loop task's start to the last
    one's end; ``task_sum`` is the total duration of the loop tasks, ``busy_per_rank`` its split
    by rank; ``outside_loop`` is the total of the before/after-loop tasks.
    """

    events: tuple[Event, ...]
    costs: Costs
    n_microbatches: int
    num_ranks: int
    loop_span: float
    task_sum: float
    busy_per_rank: tuple[float, ...]
    outside_loop: float
    simulation: Simulation

    @property
    def simulated_makespan(self) -> float:
        return self.simulation.makespan

    @property
    def simulated_bubble(self) -> float:
        return self.simulation.bubble

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for JSON output."""
        per_task = self.costs.per_task or {}
        return {
            "n_microbatches": self.n_microbatches,
            "num_ranks": self.num_ranks,
            "measured_loop_span_ms": self.loop_span,
            "measured_task_sum_ms": self.task_sum,
            "measured_busy_per_rank_ms": list(self.busy_per_rank),
            "measured_outside_loop_ms": self.outside_loop,
            "simulated_makespan_ms": self.simulation.makespan,
            "simulated_bubble": self.simulation.bubble,
            "simulated_bubble_per_rank": list(self.simulation.bubble_per_rank),
            "costs_ms": {f"{p.value}_{s}": c for (p, s), c in sorted_costs(per_task)},
        }


def sorted_costs(per_task: Mapping[tuple[Phase, StageId], float]):
    order = {p: i for i, p in enumerate(Phase)}
    return sorted(per_task.items(), key=lambda kv: (kv[0][1], order[kv[0][0]]))


def measure_step(
    raw: Sequence[RawEvent] | None,
    schedule: Schedule,
    *,
    statistic: str = "median",
    n_microbatches: int | None = None,
) -> MeasuredStep:
    """Summarise ``compiled.last_events`` of a step compiled with ``schedule``.

    ``n_microbatches`` defaults to the highest microbatch id seen + 1 (loop task instances are
    named ``fwd_{stage}__{mb}``). The simulation replays ``schedule`` with ``measured_costs``.
    """
    loop = loop_records(raw)
    if not loop:
        raise ValueError("no loop tasks among the measured events; was the step pipelined?")
    if n_microbatches is None:
        n_microbatches = 1 + max(int(str(name).rsplit("__", 1)[1]) for _, name, *_ in loop)
    costs = measured_costs(raw, schedule, statistic=statistic)
    ms = 1e3
    busy = [0.0] * schedule.mpmd_dim
    for rank, _, _, start, end in loop:
        busy[rank] += (end - start) * ms
    outside = sum((rec[4] - rec[3]) * ms for rec in _check(raw) if _phase(rec) is None)
    return MeasuredStep(
        events=tuple(to_events(raw)),
        costs=costs,
        n_microbatches=n_microbatches,
        num_ranks=schedule.mpmd_dim,
        loop_span=(max(r[4] for r in loop) - min(r[3] for r in loop)) * ms,
        task_sum=sum(busy),
        busy_per_rank=tuple(busy),
        outside_loop=outside,
        simulation=simulate(schedule, n_microbatches, costs),
    )
