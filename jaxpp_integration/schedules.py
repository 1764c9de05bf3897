"""Pipeline schedules as data, plus the one validator and dependency replay they all share.

This module owns:

* the task vocabulary: ``Phase``, ``Task`` (``fwd_3__0``), ``FusedTask``;
* the dependency rules between tasks (``task_dependencies``) and the list-scheduling replay
  (``list_schedule``) that both the validator and ``simulate.py`` run;
* the validator ``validate_tasks``, which rejects a bad schedule with a one-line reason and the
  whole rank x step grid with the offending task marked;
* the built-in schedules (``GPipe``, ``Std1F1B``, ``Eager1F1B``, ``Interleaved1F1B``,
  ``ZeroBubble``, ``DualPipeV``), ``UserSchedule`` and ``schedule_from_name``.

A schedule is an immutable, hashable value (the engine uses it as a jit static argument). Its only
job is ``tasks(n_microbatches)``: one list of ``Task`` / ``FusedTask`` per rank, in the order that
rank runs them. Placement is ``stage_to_rank``. Nothing here knows about JAX.

Naming: ``stage`` is a pipeline stage id (0 = first layer block), ``rank`` is an MPMD group id
(0..mpmd_dim-1) and ``mb`` is a microbatch id (0..n_microbatches-1); the three are never mixed.

Dependency rules (the contract every schedule must honour)::

    FWD(s, mb)   after FWD(s-1, mb)
    BWD(s, mb)   after FWD(s, mb) and BWD(s+1, mb)        (BWD_I(s+1, mb) when split)
    BWD_I(s, mb) like BWD
    BWD_W(s, mb) after BWD_I(s, mb)

plus, on each stage, BWD (or BWD_W) of microbatch mb after that of mb-1: gradients are accumulated
in microbatch order, so a pipelined step is bitwise equal to the reference loop.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

StageId: TypeAlias = int
RankId: TypeAlias = int
MicrobatchId: TypeAlias = int

__all__ = [
    "DualPipeV",
    "Eager1F1B",
    "FusedTask",
    "GPipe",
    "Interleaved1F1B",
    "Item",
    "MicrobatchId",
    "Phase",
    "RankId",
    "Schedule",
    "ScheduleError",
    "ScheduledItem",
    "StageId",
    "SCHEDULE_NAMES",
    "Std1F1B",
    "Task",
    "UserSchedule",
    "ZeroBubble",
    "format_grid",
    "item_tasks",
    "list_schedule",
    "resolve_stage_to_rank",
    "schedule_from_name",
    "task_dependencies",
    "validate_tasks",
]


# --------------------------------------------------------------------------------------------
# Task vocabulary
# --------------------------------------------------------------------------------------------


class Phase(enum.Enum):
    FWD = "fwd"
    BWD = "bwd"  # full backward (input and weight gradients)
    BWD_I = "bwdI"  # backward w.r.t. the stage input only (critical path)
    BWD_W = "bwdW"  # backward w.r.t. the stage weights (deferrable)


@dataclass(frozen=True)
class Task:
    """One phase of one stage on one microbatch, e.g. ``fwd_3__0``."""

    stage: StageId
    microbatch: MicrobatchId
    phase: Phase

    def __str__(self) -> str:
        return f"{self.phase.value}_{self.stage}__{self.microbatch}"

    __repr__ = __str__


@dataclass(frozen=True)
class FusedTask:
    """Tasks of one rank run back to back as one unit (the engine compiles them together).

    Inner tasks run in tuple order, so a later one may consume an earlier one's result
    (``FusedTask(fwd_3__0, bwd_3__0)``).
    """

    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if not self.tasks or not all(isinstance(t, Task) for t in self.tasks):
            raise ScheduleError(f"FusedTask needs one or more Task values, got {self.tasks!r}")

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def __str__(self) -> str:
        return f"FusedTask({', '.join(str(t) for t in self.tasks)})"

    __repr__ = __str__


Item: TypeAlias = Task | FusedTask
PerRank: TypeAlias = Sequence[Sequence[Item]]


class ScheduleError(ValueError):
    """A schedule is malformed, inconsistent with its placement, or cannot run."""


def item_tasks(item: Item) -> tuple[Task, ...]:
    """The tasks an item runs, in order."""
    return item.tasks if isinstance(item, FusedTask) else (item,)


def task_dependencies(task: Task, num_stages: int, split_backward: bool) -> tuple[Task, ...]:
    """Tasks whose results ``task`` consumes (data dependencies only, see module docstring)."""
    s, mb = task.stage, task.microbatch
    if task.phase is Phase.FWD:
        return (Task(s - 1, mb, Phase.FWD),) if s > 0 else ()
    if task.phase is Phase.BWD_W:
        return (Task(s, mb, Phase.BWD_I),)
    deps = [Task(s, mb, Phase.FWD)]
    if s < num_stages - 1:
        deps.append(Task(s + 1, mb, Phase.BWD_I if split_backward else Phase.BWD))
    return tuple(deps)


def _accumulation_predecessor(task: Task) -> Task | None:
    """The task that must precede ``task`` on its stage so gradients add up in microbatch order."""
    if task.phase in (Phase.BWD, Phase.BWD_W) and task.microbatch > 0:
        return Task(task.stage, task.microbatch - 1, task.phase)
    return None


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
                prev = _accumulation_predecessor(task)
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


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


class Schedule(abc.ABC):
    """A pipeline schedule: placement of stages on ranks and one task list per rank.

    Subclasses are frozen dataclasses (hashable, usable as jit static arguments) and must set
    ``num_stages``, ``mpmd_dim`` and ``split_backward`` and implement ``tasks``.
    """

    num_stages: int
    mpmd_dim: int
    split_backward: ClassVar[bool] = False

    @abc.abstractmethod
    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        """One list per rank (index = rank) of the items that rank runs, in order."""

    def stage_to_rank(self, stage: StageId) -> RankId:
        """Rank that holds ``stage`` (default: loop placement, ``stage % mpmd_dim``)."""
        self._check_stage(stage)
        return stage % self.mpmd_dim

    def rank_stages(self, rank: RankId) -> tuple[StageId, ...]:
        """Stages held by ``rank``, ascending."""
        if not 0 <= rank < self.mpmd_dim:
            raise ValueError(f"rank {rank} out of range for mpmd_dim={self.mpmd_dim}")
        return tuple(s for s in range(self.num_stages) if self.stage_to_rank(s) == rank)

    def validate(self, n_microbatches: int) -> None:
        """Build ``tasks(n_microbatches)`` and run the validator on it."""
        validate_tasks(
            self.tasks(n_microbatches),
            self.num_stages,
            self.mpmd_dim,
            n_microbatches,
            self.split_backward,
            self.stage_to_rank,
        )

    def _check_stage(self, stage: StageId) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range for num_stages={self.num_stages}")

    def _check_microbatches(self, n_microbatches: int) -> None:
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ScheduleError(
                f"{self!r}.tasks(n_microbatches={n_microbatches!r}): need an int >= 1"
            )


def _check_mpmd_dim(name: str, mpmd_dim: object) -> None:
    if not isinstance(mpmd_dim, int) or isinstance(mpmd_dim, bool) or mpmd_dim < 1:
        raise ScheduleError(f"{name}(mpmd_dim={mpmd_dim!r}): mpmd_dim must be an int >= 1")


def _one_f_one_b(
    rank: RankId,
    mpmd_dim: int,
    n_chunks: int,
    n_microbatches: int,
    warmup: int,
    fuse_last_stage: bool = False,
) -> list[Item]:
    """Warm-up forwards, then alternate one forward / one backward, then the remaining backwards.

    With ``n_chunks`` > 1 stages are looped (stage = chunk * mpmd_dim + rank) and microbatches
    go through each chunk in groups of ``mpmd_dim`` (Megatron's depth-first order): the k-th
    forward uses chunk (k // p) % v and microbatch (k // (p v)) p + k % p; backwards visit the
    chunks in reverse. For one chunk the k-th forward/backward is simply microbatch k.
    ``fuse_last_stage`` emits an adjacent fwd/bwd of the same last-stage microbatch as one
    FusedTask.
    """
    p, v = mpmd_dim, n_chunks
    total = v * n_microbatches
    warmup = min(warmup, total)
    last_stage = p * v - 1

    def op(k: int, phase: Phase) -> Task:
        chunk = (k // p) % v
        if phase is not Phase.FWD:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p if v > 1 else k
        return Task(chunk * p + rank, mb, phase)

    out: list[Item] = [op(k, Phase.FWD) for k in range(warmup)]
    for i in range(total - warmup):
        fwd, bwd = op(warmup + i, Phase.FWD), op(i, Phase.BWD)
        if (
            fuse_last_stage
            and fwd.stage == last_stage
            and (bwd.stage, bwd.microbatch)
            == (
                fwd.stage,
                fwd.microbatch,
            )
        ):
            out.append(FusedTask((fwd, bwd)))
        else:
            out += [fwd, bwd]
    out += [op(i, Phase.BWD) for i in range(total - warmup, total)]
    return out


@dataclass(frozen=True)
class GPipe(Schedule):
    """Fill-drain: every rank runs all forwards (mb 0..m-1), then all backwards (mb 0..m-1).

    Bubble (p-1)/(m+p-1); rank 0 holds all m activations.
    """

    mpmd_dim: int

    def __post_init__(self) -> None:
        _check_mpmd_dim("GPipe", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        m = n_microbatches
        return [
            [Task(r, mb, Phase.FWD) for mb in range(m)]
            + [Task(r, mb, Phase.BWD) for mb in range(m)]
            for r in range(self.mpmd_dim)
        ]


@dataclass(frozen=True)
class Std1F1B(Schedule):
    """1F1B (PipeDream-flush / Megatron): rank r runs min(m, p-1-r) warm-up forwards, then one
    forward / one backward, then the remaining backwards. Bubble (p-1)/(m+p-1) like GPipe, but
    rank r holds at most min(m, p-r) activations.
    """

    mpmd_dim: int

    def __post_init__(self) -> None:
        _check_mpmd_dim("Std1F1B", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p = self.mpmd_dim
        return [_one_f_one_b(r, p, 1, n_microbatches, p - 1 - r) for r in range(p)]


@dataclass(frozen=True)
class Eager1F1B(Schedule):
    """1F1B with min(m, 2(p-r)-1) warm-up forwards on rank r (rank 0 of 4 runs 7): more
    activations in flight (up to 2(p-r)) buys slack to hide transfer latency.
    """

    mpmd_dim: int

    def __post_init__(self) -> None:
        _check_mpmd_dim("Eager1F1B", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p = self.mpmd_dim
        return [_one_f_one_b(r, p, 1, n_microbatches, 2 * (p - r) - 1) for r in range(p)]


@dataclass(frozen=True)
class Interleaved1F1B(Schedule):
    """Megatron's interleaved (virtual-stage) 1F1B.

    Each rank holds v = num_stages / mpmd_dim stages, stage s on rank s % mpmd_dim. Rank r runs
    min(v m, (v-1) p + 2 (p-1-r)) warm-up forwards, then one forward / one backward, then the
    remaining backwards; microbatches enter each chunk in groups of p (see ``_one_f_one_b``).
    Needs m % p == 0. Bubble (p-1)/(v m + p-1) with equal per-chunk costs; rank r holds at most
    min(v m, (v-1) p + 2 (p-1-r) + 1) chunk activations, i.e. (p + (p-1)/v) full-stage
    activations on rank 0 (Korthikanti et al. / Megatron).

    With ``fuse_steady_state`` (default) the last stage's forward and backward of the same
    microbatch, adjacent in the steady state, are one ``FusedTask(fwd, bwd)``.
    """

    num_stages: int
    mpmd_dim: int
    fuse_steady_state: bool = True

    def __post_init__(self) -> None:
        _check_mpmd_dim("Interleaved1F1B", self.mpmd_dim)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ScheduleError(
                f"Interleaved1F1B(num_stages={self.num_stages!r}): need an int >= 1"
            )
        if self.num_stages % self.mpmd_dim:
            nearest = self.mpmd_dim * max(1, self.num_stages // self.mpmd_dim)
            raise ScheduleError(
                f"Interleaved1F1B(num_stages={self.num_stages}, mpmd_dim={self.mpmd_dim}): "
                f"num_stages must be a multiple of mpmd_dim (each rank holds the same number "
                f"of stages); use e.g. num_stages={nearest}"
            )

    @property
    def virtual_stages(self) -> int:
        """Stages (model chunks) per rank."""
        return self.num_stages // self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p, v, m = self.mpmd_dim, self.virtual_stages, n_microbatches
        if m % p:
            raise ScheduleError(
                f"{self!r}.tasks({m}): the number of microbatches must be a multiple of "
                f"mpmd_dim={p}; use {p * max(1, round(m / p))}"
            )
        return [
            _one_f_one_b(r, p, v, m, (v - 1) * p + 2 * (p - 1 - r), self.fuse_steady_state)
            for r in range(p)
        ]

    def __repr__(self) -> str:
        extra = "" if self.fuse_steady_state else ", fuse_steady_state=False"
        return f"Interleaved1F1B(num_stages={self.num_stages}, mpmd_dim={self.mpmd_dim}{extra})"


@dataclass(frozen=True)
class ZeroBubble(Schedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24): 1F1B with the backward split
    into BWD_I (input gradient, on the critical path) and BWD_W (weight gradient, deferrable).

    Rank r runs min(m, p-1-r) warm-up forwards; then, for k = 0..m-1, the next forward (while any
    remain), BWD_I of microbatch k and, once k >= r, the oldest pending BWD_W; its last r BWD_W
    close the list. Deferring r weight gradients on rank r lets the input-gradient chain run
    ahead, so with F = B_I = B_W the bubble is (p-1)/(3m+p-1) (one third of 1F1B's idle time)
    for every m >= p. Every rank holds at most min(m, p) activations, the peak of 1F1B (its
    rank 0); later ranks hold more than their 1F1B counterparts, which is what buys the bubble.
    """

    mpmd_dim: int
    split_backward: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_mpmd_dim("ZeroBubble", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p, m = self.mpmd_dim, n_microbatches
        out = []
        for rank in range(p):
            warmup = min(m, p - 1 - rank)
            row: list[Item] = [Task(rank, mb, Phase.FWD) for mb in range(warmup)]
            n_weight = 0
            for mb in range(m):
                if warmup + mb < m:
                    row.append(Task(rank, warmup + mb, Phase.FWD))
                row.append(Task(rank, mb, Phase.BWD_I))
                if mb >= rank:
                    row.append(Task(rank, n_weight, Phase.BWD_W))
                    n_weight += 1
            row += [Task(rank, mb, Phase.BWD_W) for mb in range(n_weight, m)]
            out.append(row)
        return out


@dataclass(frozen=True)
class DualPipeV(Schedule):
    """DeepSeek's DualPipeV ("cut-in-half" DualPipe): 2p stages folded into a V on p ranks.

    Rank r holds stages r and 2p-1-r (chunk 0 going down, chunk 1 coming back), so the first and
    last stage share rank 0 and the two middle stages share rank p-1. Needs m >= 2p. Per rank
    the list follows DualPipeV's eight phases: 2(p-1-r) chunk-0 forwards; r+1 pairs (F0, F1);
    p-1-r rounds (B1, W, F1); m-2p+r+1 steady rounds (F0 & B1, F1 & B0); p-1-r rounds
    (B1, F1 & B0); r+1 rounds (B1, B0); p-1-r rounds (W, B0); the remaining W.
    Each chunk runs its forwards and its backwards in microbatch order.

    Simplifications, all documented choices:

    * ``split_backward=True`` (default) splits backwards as DualPipeV does: a backward marked for
      zero-bubble emits only BWD_I and queues its BWD_W (first in, first out) for the W slots;
      every other backward is BWD_I immediately followed by BWD_W. With
      ``split_backward=False`` each backward is one BWD and the W slots disappear.
    * DualPipeV overlaps the steady-state "F & B" pairs (forward of one chunk with backward of the
      other) to hide MoE all-to-all communication. Here the pairs are consecutive tasks by
      default; ``fuse_overlap=True`` emits each pair as one ``FusedTask`` (the engine compiles it
      as one program, which lets XLA overlap them) except the last rank's first pair, which
      DualPipeV also leaves unfused.

    With F = B_I = B_W per stage and no transfer cost the simulated bubble is 3.5% at p=8, m=32
    (6.8% with ``fuse_overlap``, where a pair costs the sum of its parts); peak activations are
    2p+1 stage activations per rank, i.e. (p + 1/2) full-rank activations.
    """

    mpmd_dim: int
    split_backward: bool = True
    fuse_overlap: bool = False

    def __post_init__(self) -> None:
        _check_mpmd_dim("DualPipeV", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return 2 * self.mpmd_dim

    def stage_to_rank(self, stage: StageId) -> RankId:
        self._check_stage(stage)
        return stage if stage < self.mpmd_dim else 2 * self.mpmd_dim - 1 - stage

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p, m = self.mpmd_dim, n_microbatches
        if m < 2 * p:
            raise ScheduleError(
                f"{self!r}.tasks({m}): DualPipeV needs at least 2 * mpmd_dim = {2 * p} "
                f"microbatches; use n_microbatches >= {2 * p}"
            )
        return [self._rank_tasks(rank, m) for rank in range(p)]

    def _rank_tasks(self, rank: RankId, m: int) -> list[Item]:
        p = self.mpmd_dim
        stages = (rank, 2 * p - 1 - rank)  # chunk 0 (down), chunk 1 (up)
        next_fwd, next_bwd = [0, 0], [0, 0]
        pending_w: list[Task] = []
        row: list[Item] = []

        def fwd(chunk: int) -> list[Task]:
            task = Task(stages[chunk], next_fwd[chunk], Phase.FWD)
            next_fwd[chunk] += 1
            return [task]

        def bwd(chunk: int, defer_w: bool = False) -> list[Task]:
            stage, mb = stages[chunk], next_bwd[chunk]
            next_bwd[chunk] += 1
            if not self.split_backward:
                return [Task(stage, mb, Phase.BWD)]
            if defer_w:
                pending_w.append(Task(stage, mb, Phase.BWD_W))
                return [Task(stage, mb, Phase.BWD_I)]
            return [Task(stage, mb, Phase.BWD_I), Task(stage, mb, Phase.BWD_W)]

        def weight() -> list[Task]:
            return [pending_w.pop(0)] if self.split_backward else []

        def overlapped(first: list[Task], second: list[Task], fuse: bool = True) -> None:
            if self.fuse_overlap and fuse:
                row.append(FusedTask((*first, *second)))
            else:
                row.extend(first + second)

        for _ in range(2 * (p - 1 - rank)):
            row += fwd(0)
        for _ in range(rank + 1):
            row += fwd(0) + fwd(1)
        for _ in range(p - 1 - rank):
            row += bwd(1, defer_w=True) + weight() + fwd(1)
        for i in range(m - 2 * p + rank + 1):
            overlapped(fwd(0), bwd(1), fuse=not (i == 0 and rank == p - 1))
            overlapped(fwd(1), bwd(0))
        for _ in range(p - 1 - rank):
            row += bwd(1)
            overlapped(fwd(1), bwd(0))
        defer = False
        for i in range(rank + 1):
            # Deferral starts half-way through this phase (on odd ranks before B1, on even
            # ranks between B1 and B0), as in DualPipeV.
            if i == (rank + 1) // 2 and rank % 2 == 1:
                defer = True
            row += bwd(1, defer)
            if i == (rank + 1) // 2 and rank % 2 == 0:
                defer = True
            row += bwd(0, defer)
        for _ in range(p - 1 - rank):
            row += weight() + bwd(0, defer_w=True)
        while pending_w:
            row += weight()
        assert next_fwd == [m, m] and next_bwd == [m, m], "internal: DualPipeV lost a task"
        return row

    def __repr__(self) -> str:
        extra = "" if self.split_backward else ", split_backward=False"
        extra += ", fuse_overlap=True" if self.fuse_overlap else ""
        return f"DualPipeV(mpmd_dim={self.mpmd_dim}{extra})"


class UserSchedule(Schedule):
    """A schedule given as data: per-rank task lists for one fixed number of microbatches, or a
    callable ``n_microbatches -> per-rank lists``.

    ``stage_to_rank`` is a callable or a sequence indexed by stage (default
    ``stage % mpmd_dim``). ``split_backward`` defaults to whether the lists use bwdI/bwdW (for a
    callable: False). Fixed lists are validated at construction; ``validate(n)`` checks a
    callable's output. Instances are immutable and hashable (a callable by identity).
    """

    def __init__(
        self,
        per_rank_tasks: Sequence[Sequence[Item]] | Callable[[int], Sequence[Sequence[Item]]],
        num_stages: int,
        mpmd_dim: int,
        stage_to_rank: Callable[[StageId], RankId] | Sequence[RankId] | None = None,
        *,
        split_backward: bool | None = None,
    ) -> None:
        _check_mpmd_dim("UserSchedule", mpmd_dim)
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ScheduleError(f"UserSchedule(num_stages={num_stages!r}): need an int >= 1")
        fn = resolve_stage_to_rank(stage_to_rank, mpmd_dim)
        try:
            placement = tuple(int(fn(s)) for s in range(num_stages))
        except (IndexError, TypeError) as e:
            raise ScheduleError(
                f"UserSchedule: stage_to_rank must give a rank for each of the {num_stages} "
                f"stages ({e})"
            ) from None
        bad = [(s, r) for s, r in enumerate(placement) if not 0 <= r < mpmd_dim]
        if bad:
            s, r = bad[0]
            raise ScheduleError(
                f"UserSchedule: stage_to_rank({s}) = {r} is not a rank of mpmd_dim={mpmd_dim}"
            )
        fixed: tuple[tuple[Item, ...], ...] | None = None
        n_fixed = None
        if callable(per_rank_tasks):
            split = bool(split_backward)
        else:
            fixed = tuple(tuple(row) for row in per_rank_tasks)
            all_tasks = [
                t for row in fixed for item in row if isinstance(item, Task | FusedTask)
                for t in item_tasks(item)
            ]  # fmt: skip
            n_fixed = max((t.microbatch for t in all_tasks), default=-1) + 1
            split = (
                any(t.phase in (Phase.BWD_I, Phase.BWD_W) for t in all_tasks)
                if split_backward is None
                else split_backward
            )
        object.__setattr__(self, "_source", fixed if fixed is not None else per_rank_tasks)
        object.__setattr__(self, "_n_fixed", n_fixed)
        object.__setattr__(self, "_placement", placement)
        object.__setattr__(self, "num_stages", num_stages)
        object.__setattr__(self, "mpmd_dim", mpmd_dim)
        object.__setattr__(self, "split_backward", split)
        if fixed is not None:
            self.validate(max(n_fixed, 1))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"UserSchedule is immutable; cannot set {name}")

    def _key(self) -> tuple:
        return (self._source, self.num_stages, self.mpmd_dim, self._placement, self.split_backward)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UserSchedule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        src = f"m={self._n_fixed}" if self._n_fixed is not None else f"fn={self._source!r}"
        return (
            f"UserSchedule({src}, num_stages={self.num_stages}, mpmd_dim={self.mpmd_dim}, "
            f"stage_to_rank={self._placement})"
        )

    def stage_to_rank(self, stage: StageId) -> RankId:
        self._check_stage(stage)
        return self._placement[stage]

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        if self._n_fixed is None:
            return [list(row) for row in self._source(n_microbatches)]
        if n_microbatches != self._n_fixed:
            raise ScheduleError(
                f"{self!r} lists tasks for {self._n_fixed} microbatches but "
                f"{n_microbatches} were asked for; use n_microbatches={self._n_fixed} or build "
                f"the UserSchedule from a callable n -> per-rank lists"
            )
        return [list(row) for row in self._source]


SCHEDULE_NAMES = ("gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zero_bubble", "dualpipev")


def schedule_from_name(name: str, num_stages: int, mpmd_dim: int) -> Schedule:
    """Build a built-in schedule from its config name (``pipeline_schedule``)."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in SCHEDULE_NAMES:
        raise ScheduleError(
            f"unknown pipeline schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}"
        )
    if key == "interleaved_1f1b":
        return Interleaved1F1B(num_stages, mpmd_dim)
    if key == "dualpipev":
        if num_stages != 2 * mpmd_dim:
            raise ScheduleError(
                f"schedule 'dualpipev' places 2 stages per rank, so num_stages ({num_stages}) "
                f"must be 2 * mpmd_dim ({2 * mpmd_dim})"
            )
        return DualPipeV(mpmd_dim)
    if num_stages != mpmd_dim:
        raise ScheduleError(
            f"schedule {key!r} runs one stage per rank, so num_stages ({num_stages}) must equal "
            f"mpmd_dim ({mpmd_dim}); use 'interleaved_1f1b' for several stages per rank"
        )
    cls = {"gpipe": GPipe, "1f1b": Std1F1B, "eager_1f1b": Eager1F1B, "zero_bubble": ZeroBubble}
    return cls[key](mpmd_dim)
