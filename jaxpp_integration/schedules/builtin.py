"""The built-in pipeline schedules: pure functions from (stages, groups, microbatches) to one
task list per rank, and `schedule_from_name`. The `Schedule` base class lives in `base.py`,
`UserSchedule` (a schedule given as data) in `user.py`; both are re-exported here.

The task vocabulary (`Phase`, `Task`, `FusedTask`, the dependency rules) lives in `tasks.py`; the
one validator and list-scheduling replay every schedule shares, with the rank x step error grid,
in `validation.py`. Both are re-exported here, so `jaxpp_integration.schedules` is the one import.

A schedule is an immutable, hashable value (the engine uses it as a jit static argument). Its only
job is ``tasks(n_microbatches)``: one list of ``Task`` / ``FusedTask`` per rank, in the order that
rank runs them. Placement is ``stage_to_rank``. Nothing here knows about JAX.

Naming: ``stage`` is a pipeline stage id (0 = first layer block), ``rank`` is an MPMD group id
(0..mpmd_dim-1) and ``mb`` is a microbatch id (0..n_microbatches-1); the three are never mixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxpp_integration.schedules.base import Schedule, check_mpmd_dim
from jaxpp_integration.schedules.tasks import (  # noqa: F401  (re-exported: the schedule vocabulary)
    FusedTask,
    Item,
    MicrobatchId,
    PerRank,
    Phase,
    RankId,
    ScheduleError,
    StageId,
    Task,
    item_tasks,
    task_dependencies,
)
from jaxpp_integration.schedules.user import UserSchedule
from jaxpp_integration.schedules.validation import (  # noqa: F401  (re-exported)
    ScheduledItem,
    format_grid,
    list_schedule,
    resolve_stage_to_rank,
    validate_tasks,
)

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
    "STAGES_PER_RANK",
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
# Schedules
# --------------------------------------------------------------------------------------------


def _one_f_one_b(
    rank: RankId,
    mpmd_dim: int,
    n_chunks: int,
    n_microbatches: int,
    warmup: int,
    fuse: str = "none",
) -> list[Item]:
    """Warm-up forwards, then alternate one forward / one backward, then the remaining backwards.

    With ``n_chunks`` > 1 stages are looped (stage = chunk * mpmd_dim + rank) and microbatches
    go through each chunk in groups of ``mpmd_dim`` (Megatron's depth-first order): the k-th
    forward uses chunk (k // p) % v and microbatch (k // (p v)) p + k % p; backwards visit the
    chunks in reverse. For one chunk the k-th forward/backward is simply microbatch k.

    ``fuse`` says which steady-state (forward, backward) pairs become one ``FusedTask``, as in
    JaxPP: ``"none"``; ``"last"``, the pairs whose forward is the last stage (on the last rank
    the pair's backward is then that same stage and microbatch); ``"all"``, every pair.
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
        if fuse == "all" or (fuse == "last" and fwd.stage == last_stage):
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
        check_mpmd_dim("GPipe", self.mpmd_dim)

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
        check_mpmd_dim("Std1F1B", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p = self.mpmd_dim
        return [_one_f_one_b(r, p, 1, n_microbatches, p - 1 - r) for r in range(p)]


@dataclass(frozen=True)
class Eager1F1B(Schedule):
    """JaxPP's Eager1F1B: rank r runs min(m, 2(p-r)-1) forwards before its first backward
    (7 on rank 0 of 4, 1 on the last rank, like Std1F1B), then alternates one backward / one
    forward. One more activation in flight per hop from the last rank (up to 2(p-r)-1 on rank r)
    buys slack to hide transfer latency.

    As in JaxPP (where it is ``Interleaved1F1B`` with one chunk per rank), the last rank's
    steady-state forward and backward of the same microbatch are one
    ``FusedTask(fwd_{p-1}__k, bwd_{p-1}__k)``.
    """

    mpmd_dim: int

    def __post_init__(self) -> None:
        check_mpmd_dim("Eager1F1B", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p = self.mpmd_dim
        # 2(p-1-r) warm-up forwards; the steady state opens with one more forward.
        return [_one_f_one_b(r, p, 1, n_microbatches, 2 * (p - 1 - r), "last") for r in range(p)]


@dataclass(frozen=True)
class Interleaved1F1B(Schedule):
    """Megatron's interleaved (virtual-stage) 1F1B.

    Each rank holds v = num_stages / mpmd_dim stages, stage s on rank s % mpmd_dim. Rank r runs
    min(v m, (v-1) p + 2 (p-1-r)) warm-up forwards, then one forward / one backward, then the
    remaining backwards; microbatches enter each chunk in groups of p (see ``_one_f_one_b``).
    Needs m % p == 0. Bubble (p-1)/(v m + p-1) with equal per-chunk costs; rank r holds at most
    min(v m, (v-1) p + 2 (p-1-r) + 1) chunk activations, i.e. (p + (p-1)/v) full-stage
    activations on rank 0 (Korthikanti et al. / Megatron).

    Fusion follows JaxPP's ``fuse_steady_state`` flag. By default (False) only the last
    stage's steady-state pairs are fused: its forward and backward of the same microbatch are one
    ``FusedTask(fwd_{n-1}__k, bwd_{n-1}__k)``. With True every steady-state (forward, backward)
    pair of every rank is one ``FusedTask`` (e.g. ``FusedTask(fwd_2__2, bwd_2__0)``); warm-up
    forwards and cool-down backwards stay single.
    """

    num_stages: int
    mpmd_dim: int
    fuse_steady_state: bool = False

    def __post_init__(self) -> None:
        check_mpmd_dim("Interleaved1F1B", self.mpmd_dim)
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
        if m % self.microbatch_rule()[0]:
            raise ScheduleError(
                f"{self!r}.tasks({m}): the number of microbatches must be a multiple of "
                f"mpmd_dim={p}; use {p * max(1, round(m / p))}"
            )
        fuse = "all" if self.fuse_steady_state else "last"
        return [_one_f_one_b(r, p, v, m, (v - 1) * p + 2 * (p - 1 - r), fuse) for r in range(p)]

    def microbatch_rule(self) -> tuple[int, int]:
        return self.mpmd_dim, 1

    def __repr__(self) -> str:
        extra = ", fuse_steady_state=True" if self.fuse_steady_state else ""
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
    The engine runs every stage's backward, the first and the last included, as these two tasks
    (``partition.py``), so the last stage's weight gradients are deferred as ZB-H1 plans, not
    run inside its forward.
    """

    mpmd_dim: int
    split_backward: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_mpmd_dim("ZeroBubble", self.mpmd_dim)

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
      default; ``fuse_overlap=True`` emits each pair as one ``FusedTask`` except the last rank's
      first pair, which DualPipeV also leaves unfused. The engine runs a FusedTask's parts back to
      back as separate programs (same task instances, same results); the simulator counts a
      pair as one item costing the sum of its parts.
    * The step order is DeepSeek's reference DualPipeV's; JaxPP's ``DualPipeV`` departs from
      it at the tail of the schedule.

    With F = B_I = B_W per stage and no transfer cost the simulated bubble is 3.5% at p=8, m=32
    (6.8% with ``fuse_overlap``, where a pair costs the sum of its parts); peak activations are
    2p+1 stage activations per rank, i.e. (p + 1/2) full-rank activations.
    """

    mpmd_dim: int
    split_backward: bool = True
    fuse_overlap: bool = False

    def __post_init__(self) -> None:
        check_mpmd_dim("DualPipeV", self.mpmd_dim)

    @property
    def num_stages(self) -> int:  # type: ignore[override]
        return 2 * self.mpmd_dim

    def stage_to_rank(self, stage: StageId) -> RankId:
        self._check_stage(stage)
        return stage if stage < self.mpmd_dim else 2 * self.mpmd_dim - 1 - stage

    def microbatch_rule(self) -> tuple[int, int]:
        return 1, 2 * self.mpmd_dim

    def tasks(self, n_microbatches: int) -> list[list[Item]]:
        self._check_microbatches(n_microbatches)
        p, m = self.mpmd_dim, n_microbatches
        if m < self.microbatch_rule()[1]:
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


# Stages each rank holds, by config name (None: any number, the same on every rank).
STAGES_PER_RANK: dict[str, int | None] = {
    "gpipe": 1,
    "1f1b": 1,
    "eager_1f1b": 1,
    "interleaved_1f1b": None,
    "zero_bubble": 1,
    "dualpipev": 2,
}
SCHEDULE_NAMES = tuple(STAGES_PER_RANK)


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
        if num_stages != STAGES_PER_RANK[key] * mpmd_dim:
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
