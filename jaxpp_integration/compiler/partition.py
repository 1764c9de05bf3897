"""Pass: cluster the `treduce` loop body into per-stage tasks (`fwd_s`, `bwd_s`, `bwdI_s`/`bwdW_s`).

Takes the body jaxpr (invars = loop constants, then microbatch leaves) with stage markers in it.
Cuts it at the markers: forward cluster s ends at fwd marker s; after bwd marker s comes `bwd_s`.
Between the last fwd marker and the first bwd marker lie the loss and the start of its gradient
(and, with markers only between stages, the last stage's whole backward): the loss joins the
last stage's forward, and from JAX's cotangent seed on everything joins the last stage's backward,
so `bwd_{n-1}` is a real task like every other `bwd_s`. Both seed conventions work: k = n-1
markers (only between stages) or k = n (also after the last stage). Markers themselves become
aliases, so identical stages yield identical task jaxprs. For zero-bubble schedules each `bwd_s`
is split into `bwdI_s` (the cotangent chain: what earlier stages need, and the inputs of the
weight-gradient operations) and `bwdW_s` (those operations), every stage included.

Guarantees: every equation lands in exactly one task; a task only reads values of earlier tasks
in the order fwd_0 < … < fwd_{n-1} < bwd_{n-1} < … < bwd_0 (with bwdI_s < bwdW_s; other
tasks read only bwdI_s), which every valid schedule honours for one microbatch; each body
output is owned (accumulated) by exactly one task.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend.core import Literal, Var

from jaxpp_integration.compiler.blocks import Piece, cut_task, stacked_layer_values
from jaxpp_integration.frontend.marker import check_markers_top_level, is_marker
from jaxpp_integration.jax_compat import source_line
from jaxpp_integration.schedules import Phase


@dataclasses.dataclass
class LoopTask:
    """One stage's forward or backward work for one (any) microbatch."""

    stage: int
    phase: Phase
    eqns: list
    invars: list = dataclasses.field(default_factory=list)  # vars read from outside
    outvars: list = dataclasses.field(default_factory=list)  # vars other tasks need
    owned_outputs: list = dataclasses.field(default_factory=list)  # body output indices
    pieces: list[Piece] = dataclasses.field(default_factory=list)  # [] = one program (blocks.py)

    @property
    def name(self) -> str:
        return f"{self.phase.value}_{self.stage}"


@dataclasses.dataclass
class PartitionedBody:
    tasks: dict[tuple[int, Phase], LoopTask]
    const_vars: list
    mb_vars: list
    outvars: list  # body outputs (aliases resolved); Var or Literal
    output_owner: list  # (stage, phase) owning each body output


def partition_body(body, n_consts: int, num_stages: int, split_backward: bool) -> PartitionedBody:
    jaxpr = body.jaxpr
    check_markers_top_level(jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.effects:
            raise ValueError(
                f"cannot place {eqn.primitive} at {source_line(eqn)}: side-effecting equations are "
                "not supported inside a pipelined loop body; move it outside treduce"
            )
    fwd_markers = [e for e in jaxpr.eqns if is_marker(e) and e.params["phase"] == "fwd"]
    k = 1 + max((e.params["stage_id"] for e in fwd_markers), default=-1)  # stages marked
    if k > num_stages:
        raise ValueError(
            f"the loop body has {k} stage markers but the schedule expects {num_stages} stages; "
            f"use a schedule with {k} or {k + 1} stages, or remove markers"
        )
    if k < num_stages - 1:
        raise ValueError(
            f"the loop body has {k} stage markers, fewer than the {num_stages} stages the schedule "
            f"expects (need {num_stages - 1} between stages, or {num_stages} with one after the "
            "last); add pipeline_enter_stage calls or use fewer stages"
        )

    alias: dict = {}

    def resolve(v):
        while isinstance(v, Var) and v in alias:
            v = alias[v]
        return v

    clusters: dict[tuple[int, Phase], list] = {}
    for s in range(num_stages):
        clusters[(s, Phase.FWD)] = []
        clusters[(s, Phase.BWD)] = []
    current = (0, Phase.FWD)
    segment: list = []  # the forward equations since the last forward marker
    for eqn in jaxpr.eqns:
        if is_marker(eqn):
            sid = eqn.params["stage_id"]
            if eqn.params["phase"] == "fwd":
                _close_segment(clusters, segment, current[0], sid, [resolve(v) for v in eqn.invars])
            else:
                clusters[current] += segment
            segment = []
            for o, i in zip(eqn.outvars, eqn.invars):
                alias[o] = resolve(i)
            if eqn.params["phase"] == "fwd":
                current = (min(sid + 1, num_stages - 1), Phase.FWD)
            else:
                current = (sid, Phase.BWD)
            continue
        new_invars = [resolve(v) for v in eqn.invars]
        segment.append(eqn.replace(invars=new_invars))
    clusters[current] += segment

    outvars = [resolve(v) for v in jaxpr.outvars]
    producer: dict = {}
    for key, eqns in clusters.items():
        for eqn in eqns:
            for o in eqn.outvars:
                producer[o] = key

    _move_loss_gradient_to_last_backward(clusters, num_stages, outvars)
    producer = {o: key for key, eqns in clusters.items() for e in eqns for o in e.outvars}
    if split_backward:
        clusters = _split_backward(clusters, outvars)
        producer = {o: key for key, eqns in clusters.items() for e in eqns for o in e.outvars}

    _recompute_constants(clusters)
    tasks = {key: LoopTask(key[0], key[1], eqns) for key, eqns in clusters.items()}
    last_fwd = (num_stages - 1, Phase.FWD)
    owner = []
    for j, v in enumerate(outvars):
        key = producer.get(v, last_fwd) if isinstance(v, Var) else last_fwd
        owner.append(key)
        tasks[key].owned_outputs.append(j)

    # def-use across tasks
    const_vars = list(jaxpr.invars[:n_consts])
    mb_vars = list(jaxpr.invars[n_consts:])
    needed_by: dict = {}
    for key, task in tasks.items():
        local = {o for e in task.eqns for o in e.outvars}
        reads = []
        for e in task.eqns:
            for v in e.invars:
                if isinstance(v, Var) and v not in local and v not in reads:
                    reads.append(v)
        for j in task.owned_outputs:
            v = outvars[j]
            if isinstance(v, Var) and v not in local and v not in reads:
                reads.append(v)
        task.invars = reads
        for v in reads:
            needed_by.setdefault(v, []).append(key)
    for task in tasks.values():
        task.outvars = [o for e in task.eqns for o in e.outvars if o in needed_by]
    layer_values = stacked_layer_values(const_vars, jaxpr.eqns)
    for (_, phase), task in tasks.items():
        owned = [outvars[j] for j in task.owned_outputs]
        task.pieces = cut_task(task.eqns, task.outvars, owned, phase, layer_values)
    return PartitionedBody(tasks, const_vars, mb_vars, outvars, owner)


def _close_segment(clusters, segment: list, current: int, stage: int, marked: list) -> None:
    """Places the equations before a forward marker that ends stage `stage`. In one forward pass
    the marker ends the stage the equations are in (`stage == current`). A marker that ends an
    earlier stage starts another pass through the stages (`forward_pass`: a frozen reference
    model's forward before the trained model's): then the equations the marked values depend on
    are that pass's stage `stage`, and the rest finish stage `current` of the pass before."""
    if stage >= current:
        clusters[(current, Phase.FWD)] += segment
        return
    needed = {v for v in marked if isinstance(v, Var)}
    mine = [False] * len(segment)
    for j in range(len(segment) - 1, -1, -1):
        if any(o in needed for o in segment[j].outvars):
            mine[j] = True
            needed.update(v for v in segment[j].invars if isinstance(v, Var))
    clusters[(stage, Phase.FWD)] += [e for e, m in zip(segment, mine, strict=True) if m]
    clusters[(current, Phase.FWD)] += [e for e, m in zip(segment, mine, strict=True) if not m]


def _recompute_constants(clusters) -> None:
    """Program constants (values computed from nothing: an `iota`, a broadcast literal, the
    positions, rotary tables and causal mask made from them) are computed by every task that
    reads them, in front of its own equations, instead of being sent from the task that made
    them for every microbatch (XLA folds them into the reading program, as `jax.jit` does)."""
    made_by = {o: e for eqns in clusters.values() for e in eqns for o in e.outvars}
    constant: dict = {}

    def is_constant(first) -> bool:
        # Depth-first over the equations it reads, with a stack of our own: the chain of an
        # unrolled model's equations is thousands deep (Python's recursion limit is 1000).
        stack, entered = [first], set()
        while stack:
            e = stack[-1]
            if id(e) in constant:
                stack.pop()
                continue
            inputs = [made_by[v] for v in e.invars if isinstance(v, Var) and v in made_by]
            todo = [d for d in inputs if id(d) not in constant]
            if todo and id(e) not in entered:
                entered.add(id(e))
                stack.extend(todo)
                continue
            stack.pop()
            constant[id(e)] = (
                bool(e.outvars)
                and not e.effects
                and all(
                    not isinstance(v, Var) or (v in made_by and constant.get(id(made_by[v]), False))
                    for v in e.invars
                )
            )
        return constant[id(first)]

    for key, eqns in clusters.items():
        local = {o for e in eqns for o in e.outvars}
        chain: list = []
        added: set = set()
        for e in eqns:
            for v in e.invars:
                if isinstance(v, Var) and v not in local and v in made_by:
                    if is_constant(made_by[v]):
                        behind = _constant_closure(v, made_by)
                        if not any(
                            isinstance(u, Var) and u in local for c in behind for u in c.invars
                        ):
                            chain += [c for c in behind if id(c) not in added]
                            added.update(id(c) for c in behind)
        if chain:
            clusters[key] = chain + eqns


def _move_loss_gradient_to_last_backward(clusters, num_stages: int, outvars) -> None:
    """Moves the start of the loss gradient from ``fwd_{n-1}`` to the front of ``bwd_{n-1}``.

    Cutting at markers leaves everything between the last forward marker and the first backward
    marker in ``fwd_{n-1}``: the loss and the start of its gradient, and, with markers only
    between stages, the last stage's whole backward. The backward begins at the cotangent seed
    JAX's ``value_and_grad`` emits: the first equation after the loss (the earliest body output
    ``fwd_{n-1}`` computes) that reads no variable or reads the float scalar literal 1, and on
    which a value a backward task reads depends. Everything from there on follows the loss in
    program order, so nothing before it reads it (any cut in program order is a valid split; this
    one keeps the forward whole). A step that does not return its loss has no such equation
    after its first output: the search then starts at the beginning of ``fwd_{n-1}``, which may
    cut inside the last stage's forward. A forward-only loop (no backward reads
    ``fwd_{n-1}``, e.g. evaluation) is left whole.
    """
    last = num_stages - 1
    eqns = clusters[(last, Phase.FWD)]
    made_at = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    owned_at = sorted(made_at[v] for v in outvars if isinstance(v, Var) and v in made_at)
    handed = {
        v
        for (_, phase), others in clusters.items()
        if phase is Phase.BWD
        for e in others
        for v in e.invars
        if isinstance(v, Var) and v in made_at
    }
    if not handed:  # no backward reads this cluster: a forward-only loop, nothing to move
        return
    after_loss = owned_at[0] + 1 if owned_at else 0
    for i in [*range(after_loss, len(eqns)), *range(after_loss)]:
        if _reads_only_literals_or_unit(eqns[i]) and _reaches(eqns, i, handed):
            clusters[(last, Phase.BWD)] = eqns[i:] + clusters[(last, Phase.BWD)]
            clusters[(last, Phase.FWD)] = eqns[:i]
            return


def _reads_only_literals_or_unit(eqn) -> bool:
    if not any(isinstance(v, Var) for v in eqn.invars):
        return True
    return any(
        isinstance(v, Literal)
        and np.ndim(v.val) == 0
        and np.issubdtype(np.asarray(v.val).dtype, np.floating)
        and v.val == 1
        for v in eqn.invars
    )


def _reaches(eqns, start: int, targets) -> bool:
    """Whether any of `targets` depends on the outputs of ``eqns[start]``."""
    reached = set(eqns[start].outvars)
    for e in eqns[start + 1 :]:
        if any(isinstance(v, Var) and v in reached for v in e.invars):
            reached.update(e.outvars)
    return bool(reached & set(targets))


# Equations that only move or regroup a gradient (sum contributions, cast, reshape, transpose):
# walking back from a weight gradient through them finds the operation that computes it.
_PLUMBING = frozenset(
    [
        "add_any",
        "convert_element_type",
        "copy",
        "copy_p",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "reduce_precision",
    ]
)


def _split_backward(clusters, outvars):
    """Splits each bwd_s into bwdI_s (input gradient) and bwdW_s (weight gradient), as ZB-H1.

    bwdI_s is the backward slice, within bwd_s, of what other tasks read (the cotangent for the
    previous stage, a tied weight's contribution) and of the inputs of the operations that make
    the stage's weight gradients; bwdW_s is the rest: those operations (the weight-gradient
    matmuls, an embedding's scatter-add) and what only regroups their results. So the first
    stage, which hands no cotangent on, still runs its cotangent chain in bwdI_0.
    """
    body_outputs = {v for v in outvars if isinstance(v, Var)}
    out = {}
    for (stage, phase), eqns in clusters.items():
        if phase is not Phase.BWD:
            out[(stage, phase)] = eqns
            continue
        local = {o: e for e in eqns for o in e.outvars}
        exported = set()
        for (s2, p2), eqns2 in clusters.items():
            if (s2, p2) == (stage, phase):
                continue
            for e in eqns2:
                exported.update(v for v in e.invars if isinstance(v, Var) and v in local)
        # the operations computing this stage's weight gradients, found through the plumbing
        weight_ops, todo, seen = set(), [v for v in body_outputs if v in local], set()
        while todo:
            e = local[todo.pop()]
            if id(e) in seen:
                continue
            seen.add(id(e))
            if e.primitive.name in _PLUMBING:
                todo.extend(v for v in e.invars if isinstance(v, Var) and v in local)
            else:
                weight_ops.add(id(e))
        weight_inputs = {
            v for e in eqns if id(e) in weight_ops for v in e.invars if isinstance(v, Var)
        }
        # backward slice of `exported` and of `weight_inputs` within the cluster; a weight
        # operation joins bwdI only if bwdI itself reads its result
        need = set(exported)
        in_i = [False] * len(eqns)
        for idx in range(len(eqns) - 1, -1, -1):
            e = eqns[idx]
            if any(o in need for o in e.outvars) or (
                id(e) not in weight_ops and any(o in weight_inputs for o in e.outvars)
            ):
                in_i[idx] = True
                need.update(v for v in e.invars if isinstance(v, Var))
        out[(stage, Phase.BWD_I)] = [e for e, f in zip(eqns, in_i) if f]
        out[(stage, Phase.BWD_W)] = [e for e, f in zip(eqns, in_i) if not f]
    return out


def _constant_closure(v, made_by) -> list:
    """The equations computing constant `v`, inputs first."""
    out, seen, todo = [], set(), [(made_by[v], False)]
    while todo:
        e, expanded = todo.pop()
        if expanded:
            out.append(e)
            continue
        if id(e) in seen:
            continue
        seen.add(id(e))
        todo.append((e, True))
        todo.extend((made_by[u], False) for u in e.invars if isinstance(u, Var) and u in made_by)
    return out
