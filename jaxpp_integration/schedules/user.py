"""`UserSchedule`: a pipeline schedule given as data (per-rank task lists, or a callable that
makes them for a number of microbatches), validated like the built-in ones."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxpp_integration.schedules.base import Schedule, check_mpmd_dim
from jaxpp_integration.schedules.tasks import (
    FusedTask,
    Item,
    Phase,
    RankId,
    ScheduleError,
    StageId,
    Task,
    item_tasks,
)
from jaxpp_integration.schedules.validation import resolve_stage_to_rank


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
        check_mpmd_dim("UserSchedule", mpmd_dim)
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
