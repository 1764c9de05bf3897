"""Pass: unroll the loop per microbatch, order it by the schedule, add transfers and deletes.

Takes the partitioned loop body and the placement, and produces a `Program`: a flat list of
instructions over numbered value slots, each slot living on one rank.

- `Run`: run one task (`before_loop_r`, `fwd_s`/`bwd_s` for a microbatch, `after_loop_r_k`);
- `Transfer`: copy a slot to another rank (inserted right after the producer, so it overlaps);
- `Fill`: a fresh accumulator made on the device (a rank with no other work before the loop);
- `Delete`: free a slot after its last use (`lifetimes.add_deletes`, the next pass).

Loop task instances are ordered by a list-scheduling replay of `schedule.tasks(n)` with costs
fwd=1, bwd=2, which also checks the data dependencies. Accumulators are updated in place
(donated) inside the task that produces each output, in the order the program runs them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal, Var
from jax.sharding import PartitionSpec

from jaxpp_integration.compiler.partition import PartitionedBody
from jaxpp_integration.compiler.placement import Placement, after_segments
from jaxpp_integration.schedules import Phase, Task, item_tasks, list_schedule


@dataclasses.dataclass
class TaskCode:
    """Code for one kind of task on one rank; compiled once, run for every instance."""

    name: str
    rank: int
    kind: str  # "before" | "loop" | "after"
    eqns: list
    invars: list  # top-level or body vars bound to inputs (in order)
    outvars: list
    stage: int | None = None
    phase: Phase | None = None
    # loop tasks only
    mb_slices: tuple = ()  # positions of inputs that are full microbatched arrays to slice
    acc_ops: tuple = ()  # (op, body-output position in outvars order) per accumulator
    acc_inits: tuple = ()  # before tasks: (op, n, aval) per accumulator to create
    mb_axis: int = 0
    out_specs: tuple = ()  # per output: a PartitionSpec the result is constrained to, or None
    pieces: tuple = ()  # loop tasks cut at their layer scans: the programs it runs (blocks.py)


@dataclasses.dataclass(frozen=True)
class Run:
    code: TaskCode
    ins: tuple
    outs: tuple
    microbatch: int | None
    donate: tuple = ()

    @property
    def name(self):
        return self.code.name if self.microbatch is None else f"{self.code.name}__{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    src_rank: int
    dst_rank: int


@dataclasses.dataclass(frozen=True)
class Fill:
    """A fresh buffer of `shape` and `dtype` holding `value` everywhere, on the slot's rank: an
    accumulator's initial value when a rank has no other work before the loop. Made on the
    device by a compiled program (one per run of consecutive fills, `runtime/fills.py`), never
    from a host array."""

    slot: int
    rank: int
    shape: tuple
    dtype: np.dtype
    value: Any


@dataclasses.dataclass(frozen=True)
class Delete:
    slot: int
    rank: int
    donated: bool = False  # already consumed by the task it was donated to: accounting only


@dataclasses.dataclass
class Program:
    instrs: list
    slot_rank: list
    slot_aval: list
    slot_kind: list  # "input" | "const" | "activation" | "acc" | "value"
    inputs: list  # per flat step input: {rank: slot}
    outputs: list  # per flat step output: {rank: slot}
    constants: dict  # slot -> numpy value (index scalars, literals)
    mpmd_dim: int
    slot_spec: dict = dataclasses.field(default_factory=dict)  # slot -> spec a Fill must use
    num_microbatches: int = 0


_INDEX_AVAL = jax.core.ShapedArray((), np.int32)


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What `build_program` turns into a `Program`: the traced step and the earlier passes'
    results. `deferred[j]`: the data axes body output j is a partial sum over ([D, ...] in
    `loop_body`, the rewritten body), summed once after the loop, or the PartitionSpec of such a
    partial (`reduction_plan`); None: reduced as it is made;
    `gather_specs`: loop constants gathered once per step (`pipeline_fsdp_ag_once`) and their
    layouts; `reduce_specs[j]`: the layout the once-per-step sum of output j is reduced to."""

    closed: Any  # the traced step (a ClosedJaxpr)
    placement: Placement
    body: PartitionedBody
    schedule: Any
    n_mb: int  # microbatches
    ops: tuple  # treduce operation per loop output
    axis: int  # the microbatch axis of the loop's inputs
    loop_need: dict  # loop input (top-level var) -> ranks of the loop tasks reading it
    deferred: list | None = None
    loop_body: Any = None
    gather_specs: dict | None = None
    reduce_specs: list | None = None


class _Builder:
    """Builds one `Program`; each section of the step has one method, called in order."""

    def __init__(self, parts: StepParts):
        placement, body, schedule = parts.placement, parts.body, parts.schedule
        self.jaxpr = parts.closed.jaxpr
        self.reduce_specs = parts.reduce_specs or [None] * len(placement.loop_eqn.outvars)
        self.gather_specs = parts.gather_specs or {}  # loop constant -> spec to gather it to
        self.gathered: dict = {}  # (loop constant, rank) -> slot of its gathered copy
        self.placement, self.body, self.schedule = placement, body, schedule
        self.n_mb, self.ops, self.axis = parts.n_mb, parts.ops, parts.axis
        self.loop_need = parts.loop_need
        self.mpmd_dim = schedule.mpmd_dim
        self.slot_rank, self.slot_aval, self.slot_kind = [], [], []
        self.instrs: list = []
        self.constants: dict = {}
        self.where: dict = {}  # (top-level var, rank) -> slot
        self.mb_slot: dict = {}  # (body var, microbatch, rank) -> slot
        self.acc_slot: dict = {}  # body output index -> current accumulator slot
        self.index_slot: dict = {}  # (rank, microbatch) -> int32 constant slot
        loop_eqn = placement.loop_eqn
        n_consts = loop_eqn.params["n_consts"]
        self.loop_eqn = loop_eqn
        self.loop_consts, self.loop_xs = loop_eqn.invars[:n_consts], loop_eqn.invars[n_consts:]
        self.acc_rank = [schedule.stage_to_rank(stage) for stage, _ in body.output_owner]
        self.free_out = {o for e in placement.free_eqns for o in e.outvars}
        # gradient_reduction="step": body outputs kept as partial sums [D, ...] over these axes
        self.deferred = parts.deferred or [None] * len(loop_eqn.outvars)
        self.body_out_avals = (parts.loop_body or loop_eqn.params["body"]).out_avals
        self.slot_spec: dict = {}

    def acc_aval(self, j):
        return self.body_out_avals[j] if self.deferred[j] else self.loop_eqn.outvars[j].aval

    def acc_spec(self, j, unconstrained=False):
        """The layout of accumulator j: a deferred partial sum's [D, ...] split over its axes,
        else the user's `treduce(out_specs=...)` entry (None: left to XLA)."""
        axes = self.deferred[j]
        if isinstance(axes, PartitionSpec):  # a partial scattered over fsdp: its whole layout
            return axes
        if axes is None:
            specs = self.loop_eqn.params.get("acc_specs")
            return specs[j] if specs else None
        rest = [PartitionSpec.UNCONSTRAINED if unconstrained else None] * (
            len(self.body_out_avals[j].shape) - 1
        )
        return PartitionSpec(axes, *rest)

    # ---------------------------------------------------------------- slots

    def new(self, rank, aval, kind):
        self.slot_rank.append(rank)
        self.slot_aval.append(aval)
        self.slot_kind.append(kind)
        return len(self.slot_rank) - 1

    def constant(self, rank, value, aval):
        s = self.new(rank, aval, "const")
        self.constants[s] = value
        return s

    def on_rank(self, v, rank) -> int:
        """The slot of top-level value `v` on `rank`, transferring it there if needed."""
        if isinstance(v, Literal):
            return self.constant(rank, np.asarray(v.val), v.aval)
        if (v, rank) not in self.where:
            src = min(r for (u, r) in self.where if u is v)
            dst = self.new(rank, v.aval, "value")
            self.instrs.append(Transfer(self.where[(v, src)], dst, src, rank))
            self.where[(v, rank)] = dst
        return self.where[(v, rank)]

    def index(self, rank, mb) -> int:
        if (rank, mb) not in self.index_slot:
            self.index_slot[(rank, mb)] = self.constant(rank, np.int32(mb), _INDEX_AVAL)
        return self.index_slot[(rank, mb)]

    # ---------------------------------------------------------------- sections

    def step_inputs(self) -> list:
        inputs = []
        for v in [*self.jaxpr.invars, *self.jaxpr.constvars]:
            slots = {}
            for r in sorted(self.placement.need.get(v, ())):
                slots[r] = self.where[(v, r)] = self.new(r, v.aval, "input")
            inputs.append(slots)
        return inputs

    def before_loop(self) -> None:
        """Free work the loop needs, replicated per rank, plus the accumulator inits. Free work
        only after-loop tasks need is recomputed inside them, so the optimizer compiles as one
        piece, as it does under plain jax.jit; so is a free step output (an optimizer's step
        count) on a rank that has after-loop work. A rank left with no free work gets its
        accumulators as fills: made on the device by a small program (`runtime/fills.py`), no
        before-loop task to compile."""
        body_out_avals = self.body_out_avals
        self.after_ranks = {
            r for e in self.placement.after for r in self.placement.eqn_ranks.get(id(e), ())
        }
        for r in range(self.mpmd_dim):
            targets = {v for v, ranks in self.loop_need.items() if r in ranks}
            targets |= {
                v
                for v, ranks in zip(self.jaxpr.outvars, self.placement.output_ranks)
                if r in ranks and v in self.free_out and r not in self.after_ranks
            }
            eqns = _dce(self.placement.free_eqns, targets)
            produced = [o for e in eqns for o in e.outvars if o in targets]
            accs = [j for j in range(len(body_out_avals)) if self.acc_rank[j] == r]
            if not eqns:
                for j in accs:
                    self.acc_slot[j] = self.new(r, self.acc_aval(j), "acc")
                    out = self.ops[j].out_aval(self.n_mb, body_out_avals[j])
                    fill = self.ops[j].fill_value(out)
                    self.instrs.append(
                        Fill(self.acc_slot[j], r, tuple(out.shape), np.dtype(out.dtype), fill)
                    )
                    if self.acc_spec(j) is not None:
                        self.slot_spec[self.acc_slot[j]] = self.acc_spec(j)
                continue
            reads = _reads(eqns)
            inits = tuple((self.ops[j], self.n_mb, body_out_avals[j]) for j in accs)
            specs = (None,) * len(produced) + tuple(self.acc_spec(j) for j in accs)
            code = TaskCode(
                f"before_loop_{r}",
                r,
                "before",
                eqns,
                reads,
                produced,
                acc_inits=inits,
                out_specs=specs if any(specs) else (),
            )
            outs = []
            for o in produced:
                outs.append(self.new(r, o.aval, "value"))
                self.where[(o, r)] = outs[-1]
            for j in accs:
                self.acc_slot[j] = self.new(r, self.acc_aval(j), "acc")
                outs.append(self.acc_slot[j])
            ins = tuple(self.where[(v, r)] for v in reads) + (self.index(r, 0),)  # pins the rank
            self.instrs.append(Run(code, ins, tuple(outs), None))

    def loop(self) -> None:
        """One task instance per (stage, phase, microbatch), in the schedule's replayed order."""
        body, schedule = self.body, self.schedule
        self.const_index = {v: i for i, v in enumerate(body.const_vars)}
        self.mb_index = {v: i for i, v in enumerate(body.mb_vars)}
        self.consumers: dict = {}  # body var -> ranks of loop tasks reading it
        for (stage, _), task in body.tasks.items():
            for v in task.invars:
                self.consumers.setdefault(v, set()).add(schedule.stage_to_rank(stage))
        self.codes: dict = {}
        self.gather_once()
        replay = list_schedule(
            schedule.tasks(self.n_mb),
            schedule.num_stages,
            schedule.split_backward,
            schedule.stage_to_rank,
            duration=lambda item: sum(
                2.0 if t.phase is Phase.BWD else 1.0 for t in item_tasks(item)
            ),
        )
        replay.sort(key=lambda s: (s.start, s.rank))
        for sched in replay:
            for t in item_tasks(sched.item):
                self.loop_task(t, sched.rank)

    def gather_once(self) -> None:
        """`pipeline_fsdp_ag_once`: one `gather_r` task per rank gathers the sharded loop
        constants (weights) its loop tasks read, once per step; every microbatch reads the
        gathered copy, which stays alive (and counted) until the rank's last loop task."""
        for r in range(self.mpmd_dim):
            wanted = []
            for (stage, _), task in self.body.tasks.items():
                if self.schedule.stage_to_rank(stage) != r:
                    continue
                for v in task.invars:
                    top = self.loop_consts[self.const_index[v]] if v in self.const_index else None
                    if top in self.gather_specs and top not in wanted:
                        wanted.append(top)
            if not wanted:
                continue
            ins = tuple(self.on_rank(v, r) for v in wanted)
            outs = tuple(self.new(r, v.aval, "value") for v in wanted)
            specs = tuple(self.gather_specs[v] for v in wanted)
            code = TaskCode(f"gather_{r}", r, "after", [], wanted, wanted, out_specs=specs)
            self.instrs.append(Run(code, ins, outs, None))
            for v, s in zip(wanted, outs):
                self.gathered[(v, r)] = s

    def loop_task(self, t: Task, rank) -> None:
        task = self.body.tasks[(t.stage, t.phase)]
        if not task.eqns and not task.owned_outputs:
            return
        mb = t.microbatch
        key = (t.stage, t.phase, rank)
        if key not in self.codes:
            specs = (None,) * len(task.outvars) + tuple(
                self.acc_spec(j, unconstrained=True) for j in task.owned_outputs
            )
            self.codes[key] = TaskCode(
                task.name,
                rank,
                "loop",
                task.eqns,
                task.invars,
                task.outvars,
                t.stage,
                t.phase,
                mb_slices=tuple(i for i, v in enumerate(task.invars) if v in self.mb_index),
                acc_ops=tuple((self.ops[j], self.body.outvars[j]) for j in task.owned_outputs),
                mb_axis=self.axis,
                out_specs=specs if any(specs) else (),
                pieces=tuple(task.pieces),
            )
        ins = []
        for v in task.invars:
            if v in self.const_index:
                top = self.loop_consts[self.const_index[v]]
                got = self.gathered.get((top, rank)) if isinstance(top, Var) else None
                ins.append(got if got is not None else self.on_rank(top, rank))
            elif v in self.mb_index:
                ins.append(self.on_rank(self.loop_xs[self.mb_index[v]], rank))
            else:
                ins.append(self.mb_slot[(v, mb, rank)])
        accs = [self.acc_slot[j] for j in task.owned_outputs]
        kind = "activation" if t.phase is Phase.FWD else "value"
        outs = []
        for v in task.outvars:
            outs.append(self.new(rank, v.aval, kind))
            self.mb_slot[(v, mb, rank)] = outs[-1]
        new_accs = [self.new(rank, self.slot_aval[a], "acc") for a in accs]
        donate = tuple(range(len(ins), len(ins) + len(accs)))
        self.instrs.append(
            Run(
                self.codes[key], (*ins, *accs, self.index(rank, mb)), (*outs, *new_accs), mb, donate
            )
        )
        for j, s in zip(task.owned_outputs, new_accs):
            self.acc_slot[j] = s
        for v, s in zip(task.outvars, outs):  # send right away, so the transfer overlaps
            for r in sorted(self.consumers.get(v, ())):
                if r != rank:
                    dst = self.new(r, v.aval, self.received_kind(v, r))
                    self.instrs.append(Transfer(s, dst, rank, r))
                    self.mb_slot[(v, mb, r)] = dst

    def received_kind(self, v, rank) -> str:
        """A loop value received by `rank` is an activation if a forward task there reads it
        (the previous stage's output, kept for the backward too); else (a cotangent, even one
        the last stage's forward task made) a plain value."""
        fwd_readers = {
            self.schedule.stage_to_rank(stage)
            for (stage, phase), task in self.body.tasks.items()
            if phase is Phase.FWD and v in task.invars
        }
        return "activation" if rank in fwd_readers else "value"

    def after_loop(self) -> None:
        """Placed work per (segment, rank), inputs from other ranks transferred in first."""
        self.reduce_deferred()
        for j, v in enumerate(self.loop_eqn.outvars):
            self.where[(v, self.acc_rank[j])] = self.acc_slot[j]
        seg = after_segments(self.placement)
        groups: dict = {}
        for e in self.placement.after:
            for r in self.placement.eqn_ranks.get(id(e), ()):
                groups.setdefault((seg[(id(e), r)], r), []).append(e)
        _recompute_elementwise(groups, self.placement.after)
        step_outs = {v for v in self.jaxpr.outvars if isinstance(v, Var)}
        free_outs_left = {  # free step outputs before_loop left to this rank's after-loop work
            r: {
                v
                for v, ranks in zip(self.jaxpr.outvars, self.placement.output_ranks)
                if r in ranks and v in self.free_out and (v, r) not in self.where
            }
            for r in self.after_ranks
        }
        # what each program reads from outside itself (a recomputed copy of an equation reads
        # its inputs from the program that made them, so those must be exported)
        group_reads = {key: set(_reads(eqns)) for key, eqns in groups.items()}
        for (k, r), eqns in sorted(groups.items()):
            missing = {v for v in _reads(eqns) if v in self.free_out and (v, r) not in self.where}
            missing |= free_outs_left.pop(r, set())  # in the rank's first after-loop task
            eqns = _dce(self.placement.free_eqns, missing) + eqns
            reads = _reads(eqns)
            ins = tuple(self.on_rank(v, r) for v in reads)
            # export only what other tasks or the step's outputs read; the rest stays fused
            read_elsewhere = {
                v for key, other in group_reads.items() if key != (k, r) for v in other
            }
            produced = [o for e in eqns for o in e.outvars if o in read_elsewhere or o in step_outs]
            outs = []
            for o in produced:
                outs.append(self.new(r, o.aval, "value"))
                self.where[(o, r)] = outs[-1]
            code = TaskCode(f"after_loop_{r}_{k}", r, "after", eqns, reads, produced)
            self.instrs.append(Run(code, ins, tuple(outs), None))

    def reduce_deferred(self) -> None:
        """One `reduce_r` task per rank sums the leading axis of its partial accumulators: the
        only data-parallel reduction of those values in the step."""
        for r in range(self.mpmd_dim):
            accs = [j for j, axes in enumerate(self.deferred) if axes and self.acc_rank[j] == r]
            if not accs:
                continue
            avals = [self.slot_aval[self.acc_slot[j]] for j in accs]
            closed = jax.make_jaxpr(lambda *a: [x.sum(0, dtype=x.dtype) for x in a])(
                *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
            )
            jp = closed.jaxpr
            specs = tuple(self.reduce_specs[j] for j in accs)  # fsdp: a reduce-scatter
            code = TaskCode(
                f"reduce_{r}",
                r,
                "after",
                jp.eqns,
                jp.invars,
                jp.outvars,
                out_specs=specs if any(specs) else (),
            )
            ins = tuple(self.acc_slot[j] for j in accs)
            outs = []
            for j in accs:
                outs.append(self.new(r, self.loop_eqn.outvars[j].aval, "value"))
                self.acc_slot[j] = outs[-1]
            self.instrs.append(Run(code, ins, tuple(outs), None))

    def step_outputs(self) -> list:
        return [
            {r: self.on_rank(v, r) for r in sorted(ranks)}
            for v, ranks in zip(self.jaxpr.outvars, self.placement.output_ranks)
        ]


def build_program(parts: StepParts) -> Program:
    b = _Builder(parts)
    inputs = b.step_inputs()
    b.before_loop()
    b.loop()
    b.after_loop()
    outputs = b.step_outputs()
    return Program(
        b.instrs,
        b.slot_rank,
        b.slot_aval,
        b.slot_kind,
        inputs,
        outputs,
        b.constants,
        b.mpmd_dim,
        b.slot_spec,
        num_microbatches=parts.n_mb,
    )


# Cheap elementwise primitives worth recomputing rather than passing between after-loop programs.
_ELEMENTWISE = frozenset(
    ["add", "sub", "mul", "div", "neg", "max", "min", "convert_element_type", "select_n"]
)


def _recompute_elementwise(groups: dict, order: list) -> None:
    """Copies into each after-loop program the elementwise equations of earlier programs on the
    same rank whose results it reads (transitively), so it recomputes them from their inputs.

    `jax.jit` sees the whole step as one program and XLA folds such chains (a gradient divided by
    a token count in one program, by the global norm in the next, becomes one multiply by a
    combined scalar); recomputing gives each program the same chain, so results stay bitwise, and
    the intermediate no longer has to be kept between programs."""
    position = {id(e): i for i, e in enumerate(order)}
    made: dict = {}  # (rank, var) -> (segment, eqn)
    for (k, r), eqns in groups.items():
        for e in eqns:
            for o in e.outvars:
                made[(r, o)] = (k, e)
    for (k, r), eqns in groups.items():
        have = {id(e) for e in eqns}
        todo = list(eqns)
        while todo:
            e = todo.pop()
            for v in e.invars:
                if not isinstance(v, Var):
                    continue
                k2, src = made.get((r, v), (k, None))
                if (
                    src is not None
                    and k2 < k
                    and id(src) not in have
                    and src.primitive.name in _ELEMENTWISE
                    and not src.effects
                ):
                    have.add(id(src))
                    eqns.append(src)
                    todo.append(src)
        eqns.sort(key=lambda e: position[id(e)])


def _dce(eqns, targets):
    """The equations (in order) needed to compute `targets`."""
    need = set(targets)
    keep = []
    for e in reversed(eqns):
        if any(o in need for o in e.outvars):
            keep.append(e)
            need.update(v for v in e.invars if isinstance(v, Var))
    return keep[::-1]


def _reads(eqns):
    """Vars the equations read but do not define, in first-use order."""
    local = {o for e in eqns for o in e.outvars}
    out = []
    for e in eqns:
        for v in e.invars:
            if isinstance(v, Var) and v not in local and v not in out:
                out.append(v)
    return out
