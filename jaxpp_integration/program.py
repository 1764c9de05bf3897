"""Pass: unroll the loop per microbatch, order it by the schedule, add transfers and deletes.

Takes the partitioned loop body and the placement, and produces a `Program`: a flat list of
instructions over numbered value slots, each slot living on one rank.

- `Run`: run one task (`before_loop_r`, `fwd_s`/`bwd_s` for a microbatch, `after_loop_r_k`);
- `Transfer`: copy a slot to another rank (inserted right after the producer, so it overlaps);
- `Delete`: free a slot after its last use (never a step input unless donated, never an output).

Loop task instances are ordered by a list-scheduling replay of `schedule.tasks(n)` with costs
fwd=1, bwd=2, which also checks the data dependencies. Accumulators are updated in place
(donated) inside the task that produces each output, in the order the program runs them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.extend.core import Literal, Var

from jaxpp_integration.partition import PartitionedBody
from jaxpp_integration.placement import Placement, after_segments
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


class _Builder:
    def __init__(self, mpmd_dim):
        self.mpmd_dim = mpmd_dim
        self.slot_rank, self.slot_aval, self.slot_kind = [], [], []
        self.instrs = []
        self.constants = {}

    def new(self, rank, aval, kind):
        self.slot_rank.append(rank)
        self.slot_aval.append(aval)
        self.slot_kind.append(kind)
        return len(self.slot_rank) - 1

    def constant(self, rank, value, aval):
        s = self.new(rank, aval, "const")
        self.constants[s] = value
        return s


def build_program(
    closed, placement: Placement, body: PartitionedBody, schedule, n_mb, ops, axis, loop_need: dict
):
    jaxpr = closed.jaxpr
    b = _Builder(schedule.mpmd_dim)
    where: dict = {}  # (var, rank) -> slot, for top-level values
    top_inputs = [*jaxpr.invars, *jaxpr.constvars]
    inputs = []
    for v in top_inputs:
        slots = {}
        for r in sorted(placement.need.get(v, ())):
            slots[r] = where[(v, r)] = b.new(r, v.aval, "input")
        inputs.append(slots)

    loop_eqn = placement.loop_eqn
    n_consts = loop_eqn.params["n_consts"]
    loop_consts = loop_eqn.invars[:n_consts]
    loop_xs = loop_eqn.invars[n_consts:]
    rank_of_stage = schedule.stage_to_rank
    acc_rank = [rank_of_stage(stage) for stage, _ in body.output_owner]

    # ---- before the loop: free work the loop (or a free step output) needs, replicated per
    # rank, plus accumulator inits. Free work that only after-loop tasks need is recomputed
    # inside them, so the optimizer compiles as one piece, as it does under plain jax.jit.
    free_out = {o for e in placement.free_eqns for o in e.outvars}
    acc_slot: dict = {}
    for r in range(b.mpmd_dim):
        targets = {v for v, ranks in loop_need.items() if r in ranks}
        targets |= {
            v
            for v, ranks in zip(jaxpr.outvars, placement.output_ranks)
            if r in ranks and v in free_out
        }
        eqns = _dce(placement.free_eqns, targets)
        produced = [o for e in eqns for o in e.outvars if o in targets]
        reads = _reads(eqns, extra=())
        inits = tuple(
            (ops[j], n_mb, aval)
            for j, aval in enumerate(loop_eqn.params["body"].out_avals)
            if acc_rank[j] == r
        )
        if not eqns and not inits:
            continue
        code = TaskCode(f"before_loop_{r}", r, "before", eqns, reads, produced, acc_inits=inits)
        outs = []
        for o in produced:
            outs.append(b.new(r, o.aval, "value"))
            where[(o, r)] = outs[-1]
        for j in range(len(loop_eqn.params["body"].out_avals)):
            if acc_rank[j] == r:
                out_aval = loop_eqn.outvars[j].aval
                acc_slot[j] = b.new(r, out_aval, "acc")
                outs.append(acc_slot[j])
        anchor = b.constant(r, np.int32(0), jax.core.ShapedArray((), np.int32))  # pins the rank
        b.instrs.append(
            Run(code, tuple(where[(v, r)] for v in reads) + (anchor,), tuple(outs), None)
        )

    # ---- the loop, one task instance per (stage, phase, microbatch) in schedule order
    body_const_index = {v: i for i, v in enumerate(body.const_vars)}
    body_mb_index = {v: i for i, v in enumerate(body.mb_vars)}
    consumers: dict = {}  # body var -> ranks of loop tasks reading it
    for key, task in body.tasks.items():
        for v in task.invars:
            consumers.setdefault(v, set()).add(rank_of_stage(key[0]))
    loop_codes: dict = {}
    mb_slot: dict = {}  # (body var, mb, rank) -> slot
    index_slot: dict = {}
    replay = list_schedule(
        schedule.tasks(n_mb),
        schedule.num_stages,
        schedule.split_backward,
        schedule.stage_to_rank,
        duration=lambda item: sum(2.0 if t.phase is Phase.BWD else 1.0 for t in item_tasks(item)),
    )
    replay.sort(key=lambda s: (s.start, s.rank))
    for sched in replay:
        for t in item_tasks(sched.item):
            _emit_loop_task(
                b,
                t,
                sched.rank,
                body,
                loop_codes,
                loop_consts,
                loop_xs,
                where,
                mb_slot,
                acc_slot,
                index_slot,
                consumers,
                ops,
                axis,
                body_const_index,
                body_mb_index,
            )

    # ---- after the loop: placed work per (rank, segment), with transfers between segments
    for j, v in enumerate(loop_eqn.outvars):
        where[(v, acc_rank[j])] = acc_slot[j]
    seg = after_segments(placement)
    groups: dict = {}
    for e in placement.after:
        for r in placement.eqn_ranks.get(id(e), ()):
            groups.setdefault((seg[(id(e), r)], r), []).append(e)
    step_outs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    for (k, r), eqns in sorted(groups.items()):
        missing = {v for v in _reads(eqns, extra=()) if v in free_out and (v, r) not in where}
        eqns = _dce(placement.free_eqns, missing) + eqns
        reads = _reads(eqns, extra=())
        ins = []
        for v in reads:
            if (v, r) not in where:
                src_rank = min(rr for (vv, rr) in where if vv is v)
                dst = b.new(r, v.aval, "value")
                b.instrs.append(Transfer(where[(v, src_rank)], dst, src_rank, r))
                where[(v, r)] = dst
            ins.append(where[(v, r)])
        # export only what other tasks or the step's outputs read; the rest stays fused inside
        mine = {id(e) for e in eqns}
        read_elsewhere = {
            v
            for (k2, r2), other in groups.items()
            if (k2, r2) != (k, r)
            for e in other
            if id(e) not in mine or r2 != r
            for v in e.invars
            if isinstance(v, Var)
        }
        produced = [o for e in eqns for o in e.outvars if o in read_elsewhere or o in step_outs]
        code = TaskCode(f"after_loop_{r}_{k}", r, "after", eqns, reads, produced)
        outs = []
        for o in produced:
            outs.append(b.new(r, o.aval, "value"))
            where[(o, r)] = outs[-1]
        b.instrs.append(Run(code, tuple(ins), tuple(outs), None))

    # ---- step outputs
    outputs = []
    for v, ranks in zip(jaxpr.outvars, placement.output_ranks):
        slots = {}
        for r in sorted(ranks):
            if isinstance(v, Literal):
                slots[r] = b.constant(r, np.asarray(v.val), v.aval)
            elif (v, r) in where:
                slots[r] = where[(v, r)]
            else:
                src_rank = min(rr for (vv, rr) in where if vv is v)
                dst = b.new(r, v.aval, "value")
                b.instrs.append(Transfer(where[(v, src_rank)], dst, src_rank, r))
                slots[r] = where[(v, r)] = dst
        outputs.append(slots)

    prog = Program(
        b.instrs, b.slot_rank, b.slot_aval, b.slot_kind, inputs, outputs, b.constants, b.mpmd_dim
    )
    return prog


def _dce(eqns, targets):
    """The equations (in order) needed to compute `targets`."""
    need = set(targets)
    keep = []
    for e in reversed(eqns):
        if any(o in need for o in e.outvars):
            keep.append(e)
            need.update(v for v in e.invars if isinstance(v, Var))
    return keep[::-1]


def _reads(eqns, extra):
    local = {o for e in eqns for o in e.outvars}
    out = []
    for e in eqns:
        for v in e.invars:
            if isinstance(v, Var) and v not in local and v not in out:
                out.append(v)
    return out


def _emit_loop_task(
    b,
    t: Task,
    rank,
    body,
    codes,
    loop_consts,
    loop_xs,
    where,
    mb_slot,
    acc_slot,
    index_slot,
    consumers,
    ops,
    axis,
    body_const_index,
    body_mb_index,
):
    task = body.tasks[(t.stage, t.phase)]
    if not task.eqns and not task.owned_outputs:
        return
    mb = t.microbatch
    key = (t.stage, t.phase, rank)
    if key not in codes:
        mb_positions = tuple(i for i, v in enumerate(task.invars) if v in body_mb_index)
        acc_ops = tuple((ops[j], body.outvars[j]) for j in task.owned_outputs)
        codes[key] = TaskCode(
            task.name,
            rank,
            "loop",
            task.eqns,
            task.invars,
            task.outvars,
            t.stage,
            t.phase,
            mb_slices=mb_positions,
            acc_ops=acc_ops,
            mb_axis=axis,
        )
    code = codes[key]
    ins = []
    for v in task.invars:
        if v in body_const_index:
            top = loop_consts[body_const_index[v]]
            ins.append(_top_slot(b, top, rank, where))
        elif v in body_mb_index:
            top = loop_xs[body_mb_index[v]]
            ins.append(_top_slot(b, top, rank, where))
        else:
            ins.append(mb_slot[(v, mb, rank)])
    accs = [acc_slot[j] for j in task.owned_outputs]
    if (rank, mb) not in index_slot:
        index_slot[(rank, mb)] = b.constant(rank, np.int32(mb), jax.core.ShapedArray((), np.int32))
    ins_all = tuple(ins) + tuple(accs) + (index_slot[(rank, mb)],)
    outs = []
    for v in task.outvars:
        s = b.new(rank, v.aval, "activation" if t.phase is Phase.FWD else "value")
        mb_slot[(v, mb, rank)] = s
        outs.append(s)
    new_accs = []
    for j in task.owned_outputs:
        new_accs.append(b.new(rank, b.slot_aval[acc_slot[j]], "acc"))
    donate = tuple(range(len(ins), len(ins) + len(accs)))
    b.instrs.append(Run(code, ins_all, tuple(outs) + tuple(new_accs), mb, donate))
    for j, s in zip(task.owned_outputs, new_accs):
        acc_slot[j] = s
    for v, s in zip(task.outvars, outs):
        for r in sorted(consumers.get(v, ())):
            if r != rank:
                dst = b.new(r, v.aval, "value")  # "activation" counts a rank's own stage only
                b.instrs.append(Transfer(s, dst, rank, r))
                mb_slot[(v, mb, r)] = dst


def _top_slot(b, top, rank, where):
    if isinstance(top, Literal):
        return b.constant(rank, np.asarray(top.val), top.aval)
    return where[(top, rank)]


def add_deletes(prog: Program, donated_inputs: set) -> Program:
    """Inserts a Delete after each slot's last use (or right after it is made, if unused)."""
    keep = {s for slots in prog.outputs for s in slots.values()}
    keep |= set(prog.constants)
    for i, slots in enumerate(prog.inputs):
        if i not in donated_inputs:
            keep |= set(slots.values())
    last_use: dict = {}
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Run):
            for s in ins.ins:
                last_use[s] = idx
            for s in ins.outs:
                last_use.setdefault(s, idx)
        elif isinstance(ins, Transfer):
            last_use[ins.src] = idx
            last_use.setdefault(ins.dst, idx)
    donated_by_run = set()
    for ins in prog.instrs:
        if isinstance(ins, Run):
            donated_by_run.update(ins.ins[d] for d in ins.donate)
    frees: dict = {}
    for s, idx in last_use.items():
        if s in keep:
            continue
        frees.setdefault(idx, []).append(s)
    out = []
    for idx, ins in enumerate(prog.instrs):
        out.append(ins)
        for s in sorted(frees.get(idx, ())):
            out.append(Delete(s, prog.slot_rank[s], donated=s in donated_by_run))
    prog.instrs = out
    return prog
