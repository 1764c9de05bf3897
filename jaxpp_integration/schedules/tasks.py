"""The task vocabulary of pipeline schedules: `Phase`, `Task` (`fwd_3__0`), `FusedTask`, and the
dependency rules between tasks that every schedule must honour::

    FWD(s, mb)   after FWD(s-1, mb)
    BWD(s, mb)   after FWD(s, mb) and BWD(s+1, mb)        (BWD_I(s+1, mb) when split)
    BWD_I(s, mb) like BWD
    BWD_W(s, mb) after BWD_I(s, mb)

plus, on each stage, BWD (or BWD_W) of microbatch mb after that of mb-1: gradients are accumulated
in microbatch order, so a pipelined step is bitwise equal to the reference loop.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

StageId: TypeAlias = int
RankId: TypeAlias = int
MicrobatchId: TypeAlias = int

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


def accumulation_predecessor(task: Task) -> Task | None:
    """The task that must precede ``task`` on its stage so gradients add up in microbatch order."""
    if task.phase in (Phase.BWD, Phase.BWD_W) and task.microbatch > 0:
        return Task(task.stage, task.microbatch - 1, task.phase)
    return None
