"""Pass: cluster the `treduce` loop body into per-stage tasks (`fwd_s`, `bwd_s`, `bwdI_s`/`bwdW_s`).

Takes the body jaxpr (invars = loop constants, then microbatch leaves) with stage markers in it.
Cuts it at the markers: forward cluster s ends at fwd marker s; everything between the last fwd
marker and the first bwd marker (the loss and the start of its gradient) joins the last stage's
forward; after bwd marker s comes `bwd_s`. Both seed conventions work: k = n-1 markers (only
between stages) or k = n (also after the last stage). Markers themselves become aliases, so
identical stages yield identical task jaxprs.

Guarantees: every equation lands in exactly one task; a task only reads values of earlier tasks
in the order fwd_0 < … < fwd_{n-1} < bwd_{n-1} < … < bwd_0, which every valid schedule honours
for one microbatch; each body output is owned (accumulated) by exactly one task.
"""

from __future__ import annotations

import dataclasses

from jax.extend.core import Literal, Var

from jaxpp_integration.jax_compat import source_line
from jaxpp_integration.marker import check_markers_top_level, is_marker
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
    k = len(fwd_markers)
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
    for eqn in jaxpr.eqns:
        if is_marker(eqn):
            for o, i in zip(eqn.outvars, eqn.invars):
                alias[o] = resolve(i)
            sid = eqn.params["stage_id"]
            if eqn.params["phase"] == "fwd":
                current = (min(sid + 1, num_stages - 1), Phase.FWD)
            else:
                current = (sid, Phase.BWD)
            continue
        new_invars = [resolve(v) for v in eqn.invars]
        clusters[current].append(eqn.replace(invars=new_invars))

    outvars = [resolve(v) for v in jaxpr.outvars]
    producer: dict = {}
    for key, eqns in clusters.items():
        for eqn in eqns:
            for o in eqn.outvars:
                producer[o] = key

    if split_backward:
        clusters = _split_backward(clusters, producer, outvars)
        producer = {o: key for key, eqns in clusters.items() for e in eqns for o in e.outvars}

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
    return PartitionedBody(tasks, const_vars, mb_vars, outvars, owner)


def _split_backward(clusters, producer, outvars):
    """Splits each bwd_s into bwdI_s (what earlier stages need) and bwdW_s (the rest)."""
    out = {}
    for (stage, phase), eqns in clusters.items():
        if phase is not Phase.BWD:
            out[(stage, phase)] = eqns
            continue
        local = {o for e in eqns for o in e.outvars}
        exported = set()
        for (s2, p2), eqns2 in clusters.items():
            if (s2, p2) == (stage, phase):
                continue
            for e in eqns2:
                exported.update(v for v in e.invars if isinstance(v, Var) and v in local)
        # backward slice of exported values within the cluster
        need = set(exported)
        in_i = [False] * len(eqns)
        for idx in range(len(eqns) - 1, -1, -1):
            e = eqns[idx]
            if any(o in need for o in e.outvars):
                in_i[idx] = True
                need.update(v for v in e.invars if isinstance(v, Var))
        out[(stage, Phase.BWD_I)] = [e for e, f in zip(eqns, in_i) if f]
        out[(stage, Phase.BWD_W)] = [e for e, f in zip(eqns, in_i) if not f]
    del producer, outvars
    return out


def is_literal(v) -> bool:
    return isinstance(v, Literal)
