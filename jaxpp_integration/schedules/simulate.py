"""Timed simulation of a pipeline schedule: makespan, bubble and live activations per rank.

This module owns the cost model (``Costs``), the timeline record format (``Event``, which the
engine's runtime also produces from measurements) and ``simulate``, which replays a schedule with
the same list-scheduling rules the validator uses (``schedules.list_schedule``): each rank runs its
list in order and an item starts once its rank is free and all its dependencies have finished, plus
``transfer`` when the producer ran on another rank. For a loop with a backward the engine runs
exactly the task instances replayed here, in the same order per rank (``program.py`` uses the
same replay with the default costs; ``tests/test_engine_split_backward.py`` checks it for every
built-in schedule), so a simulated program and a real one are the same task set.

Activation model: an activation of (stage, microbatch) is live on its rank from the end of its
forward until the end of its last backward piece (``bwd``, or ``bwdW`` when the backward is split).
An activation produced and consumed inside one ``FusedTask`` counts as live for that task's
duration. Counts are in stage activations (one microbatch through one stage).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from jaxpp_integration.schedules import (
    FusedTask,
    Item,
    Phase,
    RankId,
    Schedule,
    ScheduleError,
    StageId,
    Task,
    item_tasks,
    list_schedule,
    resolve_stage_to_rank,
    validate_tasks,
)
from jaxpp_integration.schedules.tasks import task_dependencies
from jaxpp_integration.schedules.validation import ScheduledItem

__all__ = ["Costs", "Event", "Simulation", "blocking_replay", "simulate"]

EVENT_KINDS = ("fwd", "bwd", "bwdI", "bwdW", "fused", "other")
TRANSFER_MODES = ("overlapped", "blocking")


@dataclass(frozen=True)
class Costs:
    """Durations of one stage-microbatch task by phase, in any time unit.

    ``per_task`` maps ``(Phase, stage)`` to a duration and overrides the phase default for that
    stage (this is how measured costs are fed in). A FusedTask costs the sum of its tasks.
    ``transfer`` is added between a producer and a consumer on different ranks. Task costs must
    be > 0 so start times order every dependency strictly.
    """

    fwd: float = 1.0
    bwd: float = 2.0
    bwd_i: float = 1.0
    bwd_w: float = 1.0
    transfer: float = 0.0
    per_task: Mapping[tuple[Phase, StageId], float] | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        for name in ("fwd", "bwd", "bwd_i", "bwd_w"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Costs.{name}={getattr(self, name)!r}: task costs must be > 0")
        if not self.transfer >= 0:
            raise ValueError(f"Costs.transfer={self.transfer!r}: must be >= 0")
        if self.per_task is not None:
            for key, value in self.per_task.items():
                if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], Phase)):
                    raise ValueError(
                        f"Costs.per_task key {key!r}: use (Phase, stage), e.g. (Phase.FWD, 0)"
                    )
                if not value > 0:
                    raise ValueError(f"Costs.per_task[{key!r}]={value!r}: costs must be > 0")
            object.__setattr__(self, "per_task", types.MappingProxyType(dict(self.per_task)))

    def __hash__(self) -> int:
        extra = tuple(sorted((k[0].value, k[1], v) for k, v in (self.per_task or {}).items()))
        return hash((self.fwd, self.bwd, self.bwd_i, self.bwd_w, self.transfer, extra))

    def task_cost(self, task: Task) -> float:
        if self.per_task is not None and (task.phase, task.stage) in self.per_task:
            return float(self.per_task[(task.phase, task.stage)])
        return {
            Phase.FWD: self.fwd,
            Phase.BWD: self.bwd,
            Phase.BWD_I: self.bwd_i,
            Phase.BWD_W: self.bwd_w,
        }[task.phase]

    def item_cost(self, item: Item) -> float:
        return sum(self.task_cost(t) for t in item_tasks(item))


@dataclass(frozen=True)
class Event:
    """One interval of work on one rank: ``kind`` in fwd | bwd | bwdI | bwdW | fused | other."""

    rank: RankId
    name: str
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def item_kind(item: Item) -> str:
    return "fused" if isinstance(item, FusedTask) else item.phase.value


@dataclass(frozen=True)
class Simulation:
    """Result of ``simulate``. ``events`` and ``items`` are sorted by (start, rank) — a valid
    dispatch order, since every dependency ends no later than its consumer starts."""

    events: tuple[Event, ...]
    items: tuple[tuple[RankId, Item, float, float], ...]
    makespan: float
    busy_per_rank: tuple[float, ...]
    bubble_per_rank: tuple[float, ...]
    bubble: float
    live_activations_per_rank: tuple[tuple[tuple[float, int], ...], ...]
    peak_live_activations: tuple[int, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.busy_per_rank)


def simulate(
    schedule_or_per_rank: Schedule | Sequence[Sequence[Item]],
    n_microbatches: int,
    costs: Costs = Costs(),
    *,
    num_stages: int | None = None,
    mpmd_dim: int | None = None,
    stage_to_rank: Callable[[StageId], RankId] | Sequence[RankId] | None = None,
    transfers: str = "overlapped",
) -> Simulation:
    """Validate and replay a schedule (a ``Schedule`` or raw per-rank lists) under ``costs``.

    ``transfers`` says what a value crossing ranks costs (``Costs.transfer`` each): "overlapped"
    (sends and receives on streams of their own: the consumer starts ``transfer`` after the
    producer ends, and neither rank is held), or "blocking" (a collective on both ranks' compute
    streams, as the engine's pair programs are: see ``blocking_replay``).

    For raw lists, ``mpmd_dim`` defaults to the number of lists, ``num_stages`` to the highest
    stage id + 1, ``stage_to_rank`` to ``stage % mpmd_dim``, and the backward counts as split
    when any ``bwdI``/``bwdW`` task appears. Raises ``ScheduleError`` (with the rank x step grid)
    for an invalid or deadlocking schedule.
    """
    if isinstance(schedule_or_per_rank, Schedule):
        sched = schedule_or_per_rank
        for name, value in (("num_stages", num_stages), ("mpmd_dim", mpmd_dim)):
            if value is not None and value != getattr(sched, name):
                raise ValueError(f"simulate: {name}={value} contradicts {sched!r}; omit it")
        if stage_to_rank is not None:
            raise ValueError(f"simulate: stage_to_rank comes from {sched!r}; omit it")
        per_rank = sched.tasks(n_microbatches)
        num_stages, mpmd_dim = sched.num_stages, sched.mpmd_dim
        split_backward = sched.split_backward
        placement: Callable[[StageId], RankId] = sched.stage_to_rank
    else:
        per_rank = [list(row) for row in schedule_or_per_rank]
        all_tasks = [t for row in per_rank for item in row for t in _tasks_of(item)]
        if mpmd_dim is None:
            mpmd_dim = len(per_rank)
        if num_stages is None:
            num_stages = max((t.stage for t in all_tasks), default=-1) + 1
        split_backward = any(t.phase in (Phase.BWD_I, Phase.BWD_W) for t in all_tasks)
        placement = resolve_stage_to_rank(stage_to_rank, mpmd_dim)

    validate_tasks(per_rank, num_stages, mpmd_dim, n_microbatches, split_backward, placement)
    if transfers not in TRANSFER_MODES:
        raise ValueError(f"simulate: transfers={transfers!r}; use one of {TRANSFER_MODES}")
    if transfers == "blocking":
        replay = blocking_replay(per_rank, num_stages, split_backward, placement, costs)
    else:
        replay = list_schedule(
            per_rank,
            num_stages,
            split_backward,
            placement,
            duration=costs.item_cost,
            transfer=costs.transfer,
        )
    replay.sort(key=lambda x: (x.start, x.rank, x.step))

    n_ranks = len(per_rank)
    makespan = max((x.end for x in replay), default=0.0)
    busy = [0.0] * n_ranks
    for x in replay:
        busy[x.rank] += x.end - x.start
    bubble_per_rank = tuple((makespan - b) / makespan if makespan else 0.0 for b in busy)
    bubble = (n_ranks * makespan - sum(busy)) / (n_ranks * makespan) if makespan else 0.0

    release = Phase.BWD_W if split_backward else Phase.BWD
    deltas: list[dict[float, int]] = [{} for _ in range(n_ranks)]

    def add(rank: RankId, time: float, delta: int) -> None:
        deltas[rank][time] = deltas[rank].get(time, 0) + delta

    for x in replay:
        inner = item_tasks(x.item)
        released = {(t.stage, t.microbatch) for t in inner if t.phase is release}
        for t in inner:
            if t.phase is Phase.FWD:
                # Produced and consumed inside one fused item: live for the item's duration.
                born = x.start if (t.stage, t.microbatch) in released else x.end
                add(x.rank, born, +1)
            elif t.phase is release:
                add(x.rank, x.end, -1)

    live: list[tuple[tuple[float, int], ...]] = []
    peaks: list[int] = []
    for rank in range(n_ranks):
        count, steps = 0, [(0.0, 0)]
        for time in sorted(deltas[rank]):
            count += deltas[rank][time]
            assert count >= 0, "internal: activation released before it was produced"
            if steps[-1][0] == time:
                steps[-1] = (time, count)
            else:
                steps.append((time, count))
        live.append(tuple(steps))
        peaks.append(max(c for _, c in steps))

    return Simulation(
        events=tuple(Event(x.rank, str(x.item), item_kind(x.item), x.start, x.end) for x in replay),
        items=tuple((x.rank, x.item, x.start, x.end) for x in replay),
        makespan=makespan,
        busy_per_rank=tuple(busy),
        bubble_per_rank=bubble_per_rank,
        bubble=bubble,
        live_activations_per_rank=tuple(live),
        peak_live_activations=tuple(peaks),
    )


def blocking_replay(
    per_rank: Sequence[Sequence[Item]],
    num_stages: int,
    split_backward: bool,
    placement: Callable[[StageId], RankId],
    costs: Costs,
) -> list[ScheduledItem]:
    """The replay when every transfer is a collective both ranks run on their compute streams,
    in the engine's dispatch order (``compiler/program.py``): the items sorted by start time in
    the replay with the default costs (fwd 1, bwd 2, split halves 1) and free transfers, each
    value sent to another rank right after the item that made it. Each rank's stream runs its
    items and transfers in that order; a transfer starts once its producer has finished and
    BOTH ranks have finished what comes before it on their streams, and holds both for
    ``costs.transfer``. A sender therefore waits for a busy receiver, and a receiver for a
    late sender."""
    order = list_schedule(per_rank, num_stages, split_backward, placement, Costs().item_cost)
    order.sort(key=lambda x: (x.start, x.rank, x.step))
    readers: dict[Task, list[RankId]] = {}  # task -> other ranks reading its output, in order
    for row in per_rank:
        for item in row:
            inner = item_tasks(item)
            for task in inner:
                here = placement(task.stage)
                for dep in task_dependencies(task, num_stages, split_backward):
                    there = placement(dep.stage)
                    if dep not in inner and there != here and here not in readers.get(dep, []):
                        readers.setdefault(dep, []).append(here)
    free = [0.0] * len(per_rank)  # when each rank's stream is next free
    done: dict[Task, float] = {}
    arrived: dict[tuple[Task, RankId], float] = {}  # (task, rank): its output there, from then
    out = []
    for x in order:
        inner = item_tasks(x.item)
        start = free[x.rank]
        for task in inner:
            for dep in task_dependencies(task, num_stages, split_backward):
                if dep not in inner:
                    ready = done[dep] if placement(dep.stage) == x.rank else arrived[(dep, x.rank)]
                    start = max(start, ready)
        end = start + costs.item_cost(x.item)
        out.append(ScheduledItem(x.rank, x.step, x.item, start, end))
        free[x.rank] = end
        for task in inner:
            done[task] = end
        for task in inner:
            for dst in readers.get(task, ()):
                begin = max(end, free[x.rank], free[dst])
                free[x.rank] = free[dst] = arrived[(task, dst)] = begin + costs.transfer
    return out


def _tasks_of(item: object) -> tuple[Task, ...]:
    if isinstance(item, Task | FusedTask):
        return item_tasks(item)
    raise ScheduleError(
        f"invalid schedule: {item!r} is not a Task or FusedTask; "
        f"build lists from Task(stage, microbatch, phase)"
    )
