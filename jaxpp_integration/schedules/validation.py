"""One validator and one list-scheduling replay for every schedule, and the rank x step grid
that every schedule error prints (with the offending task marked)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxpp_integration.schedules.tasks import (
    FusedTask,
    Item,
    PerRank,
    Phase,
    RankId,
    ScheduleError,
    StageId,
    Task,
    accumulation_predecessor,
    item_tasks,
    task_dependencies,
)

# --------------------------------------------------------------------------------------------
# Grid rendering (used by every error message)
# --------------------------------------------------------------------------------------------


def _cell_text(item: object) -> str:
    if isinstance(item, FusedTask):
        return "+".join(str(t) for t in item.tasks)
    return str(item)


def format_grid(
    per_rank: PerRank,
    marked: Sequence[tuple[RankId, int]] = (),
    notes: dict[RankId, str] | None = None,
) -> str:
    """The rank x step grid: one row per rank, one fixed-width column per step.

    Cells in ``marked`` (rank, step) read ``>task<``; a FusedTask is shown as
    ``fwd_3__0+bwd_3__0``; ``notes`` appends ``<- text`` after a rank's row.
    """
    marked_set = set(marked)
    notes = notes or {}
    texts = [[_cell_text(item) for item in row] for row in per_rank]
    n_steps = max([len(row) for row in texts] + [0])
    widths = [
        max([len(row[i]) for row in texts if i < len(row)] + [len(f"step {i}")]) + 2
        for i in range(n_steps)
    ]
    label_w = len(f"rank {max(len(per_rank) - 1, 0)}")
    header = " " * label_w + " | " + "".join(f" step {i}".ljust(w) for i, w in enumerate(widths))
    lines = [header.rstrip()]
    for rank, row in enumerate(texts):
        cells = "".join(
            (f">{text}<" if (rank, step) in marked_set else f" {text} ").ljust(widths[step])
            for step, text in enumerate(row)
        )
        line = (f"rank {rank}".ljust(label_w) + " | " + cells).rstrip()
        if rank in notes:
            line += "   <- " + notes[rank]
        lines.append(line)
    return "\n".join(lines)


def _fail(
    reason: str,
    per_rank: PerRank,
    marked: Sequence[tuple[RankId, int]] = (),
    notes: dict[RankId, str] | None = None,
) -> ScheduleError:
    return ScheduleError(
        f"invalid schedule: {reason}\n{format_grid(per_rank, marked, notes)}"
        + ("\n(marked: >task<)" if marked else "")
    )


# --------------------------------------------------------------------------------------------
# List-scheduling replay (shared by the validator's deadlock check and simulate.py)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledItem:
    """Where and when one item ran in a replay: ``per_rank[rank][step]`` over [start, end)."""

    rank: RankId
    step: int
    item: Item
    start: float
    end: float


def list_schedule(
    per_rank: PerRank,
    num_stages: int,
    split_backward: bool,
    stage_to_rank: Callable[[StageId], RankId],
    duration: Callable[[Item], float] = lambda item: 1.0,
    transfer: float = 0.0,
) -> list[ScheduledItem]:
    """Replay per-rank lists: each rank runs its list in order; an item starts when its rank is
    free and every dependency outside the item has finished (plus ``transfer`` if it ran on
    another rank). Returns items in completion-discovery order (a topological order).

    Raises ``ScheduleError`` (with the grid) when no rank can make progress. Assumes the
    static checks of ``validate_tasks`` hold (every dependency is somewhere in the lists).
    """
    n_ranks = len(per_rank)
    step_of = [0] * n_ranks
    rank_free = [0.0] * n_ranks
    finished: dict[Task, float] = {}
    out: list[ScheduledItem] = []
    remaining = sum(len(row) for row in per_rank)
    while remaining:
        progressed = False
        for rank in range(n_ranks):
            row = per_rank[rank]
            while step_of[rank] < len(row):
                item = row[step_of[rank]]
                inner = item_tasks(item)
                ready = rank_free[rank]
                blocked = False
                for i, task in enumerate(inner):
                    for dep in task_dependencies(task, num_stages, split_backward):
                        if dep in inner[:i]:
                            continue
                        end = finished.get(dep)
                        if end is None:
                            blocked = True
                            break
                        if stage_to_rank(dep.stage) != rank:
                            end += transfer
                        ready = max(ready, end)
                    if blocked:
                        break
                if blocked:
                    break
                end = ready + duration(item)
                for task in inner:
                    finished[task] = end
                out.append(ScheduledItem(rank, step_of[rank], item, ready, end))
                rank_free[rank] = end
                step_of[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise _deadlock_error(per_rank, step_of, finished, num_stages, split_backward)
    return out


def _deadlock_error(
    per_rank: PerRank,
    step_of: list[int],
    finished: dict[Task, float],
    num_stages: int,
    split_backward: bool,
) -> ScheduleError:
    """Describe the wait-for cycle among blocked ranks."""
    where: dict[Task, tuple[RankId, int]] = {}
    for rank, row in enumerate(per_rank):
        for step, item in enumerate(row):
            for task in item_tasks(item):
                where[task] = (rank, step)
    waits: dict[RankId, tuple[Task, Task]] = {}  # rank -> (blocked task, missing dependency)
    for rank, row in enumerate(per_rank):
        if step_of[rank] >= len(row):
            continue
        inner = item_tasks(row[step_of[rank]])
        for i, task in enumerate(inner):
            missing = [
                d
                for d in task_dependencies(task, num_stages, split_backward)
                if d not in finished and d not in inner[:i]
            ]
            if missing:
                waits[rank] = (task, missing[0])
                break
    # Follow rank -> rank holding the missing dependency until a rank repeats.
    chain: list[RankId] = []
    rank: RankId | None = min(waits)
    while rank is not None and rank not in chain and rank in waits:
        chain.append(rank)
        rank = where.get(waits[rank][1], (None, 0))[0]
    cycle = chain[chain.index(rank) :] if rank in chain else chain
    parts = []
    for r in cycle:
        task, dep = waits[r]
        held = (
            "which no rank runs" if dep not in where else "(rank {}, step {})".format(*where[dep])
        )
        parts.append(f"{task} on rank {r} (step {step_of[r]}) waits for {dep} {held}")
    reason = (
        "deadlock, no rank can make progress: "
        + "; ".join(parts)
        + "; reorder these ranks' lists so each dependency is scheduled before the task "
        "waiting for it"
    )
    return _fail(reason, per_rank, marked=[(r, step_of[r]) for r in cycle])


# --------------------------------------------------------------------------------------------
# Validator
# --------------------------------------------------------------------------------------------


def resolve_stage_to_rank(
    stage_to_rank: Callable[[StageId], RankId] | Sequence[RankId] | None, mpmd_dim: int
) -> Callable[[StageId], RankId]:
    """A placement function from a callable, a sequence indexed by stage, or None (loop
    placement ``stage % mpmd_dim``)."""
    if stage_to_rank is None:
        return lambda stage: stage % mpmd_dim
    if callable(stage_to_rank):
        return stage_to_rank
    table = tuple(stage_to_rank)
    return lambda stage: table[stage]


def validate_tasks(
    per_rank: PerRank,
    num_stages: int,
    mpmd_dim: int,
    n_microbatches: int,
    split_backward: bool,
    stage_to_rank: Callable[[StageId], RankId] | Sequence[RankId] | None = None,
) -> None:
    """Raise ``ScheduleError`` unless ``per_rank`` is a complete, runnable schedule.

    Checks, in order: one list per rank; item types and phases; stage and microbatch ranges;
    each stage on exactly the rank ``stage_to_rank`` names; no duplicate and no missing task;
    dependencies on the same rank listed first; backward in microbatch order per stage; and no
    deadlock across ranks (list-scheduling replay). ``stage_to_rank`` defaults to
    ``stage % mpmd_dim``; it may be a callable or a sequence indexed by stage.
    """
    placement = resolve_stage_to_rank(stage_to_rank, mpmd_dim)
    if len(per_rank) != mpmd_dim:
        raise ScheduleError(
            f"invalid schedule: got {len(per_rank)} rank lists but mpmd_dim={mpmd_dim}; "
            f"return exactly one task list per rank"
        )
    if n_microbatches < 1:
        raise ScheduleError(f"invalid schedule: n_microbatches={n_microbatches}; use 1 or more")
    bwd_phases = (Phase.BWD_I, Phase.BWD_W) if split_backward else (Phase.BWD,)
    allowed = (Phase.FWD, *bwd_phases)
    allowed_txt = ", ".join(p.value for p in allowed)

    seen: dict[Task, tuple[RankId, int]] = {}
    stage_ranks: dict[StageId, RankId] = {}
    for rank, row in enumerate(per_rank):
        for step, item in enumerate(row):
            here = [(rank, step)]
            if not isinstance(item, Task | FusedTask):
                raise _fail(
                    f"rank {rank} step {step} holds {item!r}, which is not a Task or FusedTask; "
                    f"build lists from Task(stage, microbatch, phase)",
                    per_rank,
                    here,
                )
            for task in item_tasks(item):
                at = f"{task} on rank {rank} (step {step})"
                if task.phase not in allowed:
                    kind = "splits" if split_backward else "does not split"
                    raise _fail(
                        f"{at} has phase {task.phase.value} but this schedule {kind} the "
                        f"backward (allowed: {allowed_txt}); use only those phases or change "
                        f"split_backward",
                        per_rank,
                        here,
                    )
                if not 0 <= task.stage < num_stages:
                    raise _fail(
                        f"{at} names stage {task.stage} but the schedule has {num_stages} "
                        f"stages (0..{num_stages - 1}); remove it or raise num_stages",
                        per_rank,
                        here,
                    )
                if not 0 <= task.microbatch < n_microbatches:
                    raise _fail(
                        f"{at} names microbatch {task.microbatch} but there are "
                        f"{n_microbatches} microbatches (0..{n_microbatches - 1}); remove it",
                        per_rank,
                        here,
                    )
                other = stage_ranks.setdefault(task.stage, rank)
                if other != rank:
                    raise _fail(
                        f"stage {task.stage} appears on ranks {other} and {rank} ({at}); "
                        f"a stage lives on one rank, move it to rank {placement(task.stage)}",
                        per_rank,
                        here,
                    )
                if placement(task.stage) != rank:
                    raise _fail(
                        f"{at} but stage_to_rank({task.stage}) = {placement(task.stage)}; "
                        f"move it to rank {placement(task.stage)}'s list",
                        per_rank,
                        here,
                    )
                if task in seen:
                    r0, s0 = seen[task]
                    raise _fail(
                        f"{task} appears twice, on rank {r0} (step {s0}) and rank {rank} "
                        f"(step {step}); remove one",
                        per_rank,
                        [(r0, s0), (rank, step)],
                    )
                seen[task] = (rank, step)

    for mb in range(n_microbatches):
        for stage in range(num_stages):
            for phase in allowed:
                task = Task(stage, mb, phase)
                if task not in seen:
                    rank = placement(stage)
                    raise _fail(
                        f"{task} is missing; add it to rank {rank}'s list",
                        per_rank,
                        notes={rank: f"missing {task}"},
                    )

    for rank, row in enumerate(per_rank):
        for step, item in enumerate(row):
            inner = item_tasks(item)
            for i, task in enumerate(inner):
                at = f"{task} on rank {rank} (step {step})"
                for dep in task_dependencies(task, num_stages, split_backward):
                    dep_rank, dep_step = seen[dep]
                    if dep_rank != rank:
                        continue
                    if dep_step > step or (dep_step == step and dep not in inner[:i]):
                        raise _fail(
                            f"{at} runs before {dep} (step {dep_step}) which it needs; "
                            f"reorder rank {rank}'s list",
                            per_rank,
                            [(rank, step)],
                        )
                prev = accumulation_predecessor(task)
                if prev is not None:
                    prev_step = seen[prev][1]
                    if prev_step > step or (prev_step == step and prev not in inner[:i]):
                        raise _fail(
                            f"{at} runs before {prev} (step {prev_step}); a stage's backward "
                            f"must run in microbatch order (gradients are accumulated in that "
                            f"order); reorder rank {rank}'s list",
                            per_rank,
                            [(rank, step)],
                        )

    list_schedule(per_rank, num_stages, split_backward, placement)
