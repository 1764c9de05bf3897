"""The `Schedule` base class every pipeline schedule derives from: stage placement on ranks,
the task lists' validation and the microbatch rule (`builtin.py`'s schedules and `user.py`'s
`UserSchedule`)."""

from __future__ import annotations

import abc
from typing import ClassVar

from jaxpp_integration.schedules.tasks import Item, RankId, ScheduleError, StageId
from jaxpp_integration.schedules.validation import validate_tasks


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

    def microbatch_rule(self) -> tuple[int, int]:
        """(multiple, minimum): ``tasks(n)`` accepts n microbatches when n is a multiple of
        ``multiple`` and at least ``minimum`` (the trainer's config checks the same rule)."""
        return 1, 1

    def _check_stage(self, stage: StageId) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range for num_stages={self.num_stages}")

    def _check_microbatches(self, n_microbatches: int) -> None:
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ScheduleError(
                f"{self!r}.tasks(n_microbatches={n_microbatches!r}): need an int >= 1"
            )


def check_mpmd_dim(name: str, mpmd_dim: object) -> None:
    if not isinstance(mpmd_dim, int) or isinstance(mpmd_dim, bool) or mpmd_dim < 1:
        raise ScheduleError(f"{name}(mpmd_dim={mpmd_dim!r}): mpmd_dim must be an int >= 1")
