"""Pass: place the work outside the loop on groups.

Takes the traced step (top-level jaxpr with exactly one `treduce` equation) and the loop tasks'
ranks. Guarantees:
- the loop's outputs (accumulators) live on the rank of the task that produces them;
- an after-loop equation reading a placed array ("heavy": not a scalar, not light; e.g. a stage's
  gradient) runs where those arrays live: on their intersection, or on their union when they
  share none (a tied weight's two gradients, summed identically on each group); scalars and
  light values from other groups are sent to it. So a stage's optimizer update stays on its group
  even when the gradients are divided by a token count or scaled by a global-norm clip factor
  computed elsewhere;
- an after-loop equation reading only placed scalars and light values ("light": a token count,
  per-group squared norms and their sum, a clip factor and its broadcasts) runs on every group
  that reads its result (and where a step output needs it): each group receives the few scalars
  it needs at once and computes the same thing in the same order, so a cross-group reduction
  takes one round and stays bitwise;
- equations that read no placed value ("free": casts of params, step + 1, schedules of the
  learning rate) are replicated into every rank that needs them and run before the loop;
- step outputs that are free (e.g. the step counter) live on every group.
"""

from __future__ import annotations

import dataclasses

from jax.extend.core import Literal, Var

from jaxpp_integration.frontend.treduce import treduce_p
from jaxpp_integration.jax_compat import source_line


@dataclasses.dataclass
class Placement:
    before: list  # top-level eqns before the loop
    loop_eqn: object
    after: list  # top-level eqns after the loop
    placed: dict  # var -> frozenset of ranks (loop outputs and placed after-loop values)
    eqn_ranks: dict  # id(after eqn) -> frozenset ranks for placed after-loop eqns
    free_eqns: list  # all free eqns in program order (before + free after)
    need: dict  # var -> set of ranks that must hold it
    output_ranks: list  # per step output: frozenset of ranks


def split_at_loop(jaxpr):
    loops = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is treduce_p]
    if len(loops) != 1:
        raise ValueError(
            "mpmd_jit_with_loop needs exactly one treduce in the step function, found "
            f"{len(loops)}; call jaxpp.treduce once around the microbatch loop"
        )
    i = loops[0]
    return jaxpr.eqns[:i], jaxpr.eqns[i], jaxpr.eqns[i + 1 :]


def place(jaxpr, loop_out_ranks: list[int], loop_in_need: dict, mpmd_dim: int) -> Placement:
    """`loop_out_ranks[j]` is the rank of treduce output j; `loop_in_need` maps loop input vars
    to the ranks that read them."""
    before, loop_eqn, after = split_at_loop(jaxpr)
    all_ranks = frozenset(range(mpmd_dim))
    placed: dict = {}
    for v, r in zip(loop_eqn.outvars, loop_out_ranks):
        placed[v] = frozenset([r])
    eqn_ranks: dict = {}
    free_after = []
    light: set = set()  # ids of light eqns; their outputs are in light_vars
    light_vars: set = set()
    for eqn in after:
        if eqn.primitive is treduce_p:
            raise ValueError(f"a second treduce at {source_line(eqn)} is not supported")
        ins = [v for v in eqn.invars if is_var(v) and v in placed]
        if not ins:
            free_after.append(eqn)
            continue
        heavy = [v for v in ins if v not in light_vars and _size(v.aval) > 1]
        if heavy:
            ranks = _meet([placed[v] for v in heavy])
        else:  # final ranks are set below, from where the result is read
            ranks = _meet([placed[v] for v in ins])
            light.add(id(eqn))
            light_vars.update(eqn.outvars)
        eqn_ranks[id(eqn)] = ranks
        for o in eqn.outvars:
            placed[o] = ranks

    output_ranks = [
        placed[v] if isinstance(v, Var) and v in placed else all_ranks for v in jaxpr.outvars
    ]
    _place_light(after, light, eqn_ranks, placed, jaxpr.outvars, output_ranks)
    for eqn in after:
        ranks = eqn_ranks.get(id(eqn), ())
        if eqn.effects and len(ranks) > 1:
            raise ValueError(
                f"cannot place {eqn.primitive} at {source_line(eqn)}: a side-effecting equation "
                f"would run on groups {sorted(ranks)}; move it out of the step"
            )

    need: dict = {}

    def add_need(v, ranks):
        if isinstance(v, Var):
            need.setdefault(v, set()).update(ranks)

    for v, ranks in zip(jaxpr.outvars, output_ranks):
        add_need(v, ranks)
    for v, ranks in loop_in_need.items():
        add_need(v, ranks)
    for eqn in after:
        if id(eqn) in eqn_ranks:
            for v in eqn.invars:
                add_need(v, eqn_ranks[id(eqn)])
    free_eqns = list(before) + free_after
    for eqn in reversed(free_eqns):
        ranks = set()
        for o in eqn.outvars:
            ranks |= need.get(o, set())
        for v in eqn.invars:
            add_need(v, ranks)
    return Placement(before, loop_eqn, after, placed, eqn_ranks, free_eqns, need, output_ranks)


def _meet(sets: list) -> frozenset:
    """The ranks holding all of `sets` if any, else all of them (the inputs are sent there)."""
    common = frozenset.intersection(*sets)
    return common if common else frozenset.union(*sets)


def _place_light(after, light, eqn_ranks, placed, outvars, output_ranks) -> None:
    """Light equations run on the ranks that read their outputs (later equations, step outputs);
    visited last to first, so every reader's ranks are final. One read nowhere keeps its own."""
    readers: dict = {}
    for eqn in after:
        for v in eqn.invars:
            if isinstance(v, Var) and id(eqn) in eqn_ranks:
                readers.setdefault(v, []).append(eqn)
    out_ranks: dict = {}
    for v, ranks in zip(outvars, output_ranks):
        if isinstance(v, Var):
            out_ranks[v] = out_ranks.get(v, frozenset()) | ranks
    for eqn in reversed(after):
        if id(eqn) not in light:
            continue
        ranks = set()
        for o in eqn.outvars:
            ranks |= out_ranks.get(o, frozenset())
            for reader in readers.get(o, ()):
                ranks |= eqn_ranks[id(reader)]
        ranks = frozenset(ranks) or eqn_ranks[id(eqn)]
        eqn_ranks[id(eqn)] = ranks
        for o in eqn.outvars:
            placed[o] = ranks


def _size(aval) -> int:
    n = 1
    for d in getattr(aval, "shape", ()):
        n *= d
    return n


def after_segments(placement: Placement) -> dict:
    """(eqn id, rank) -> segment index: a rank's after-loop work is cut wherever it must wait
    for another rank's value, so segments run in order with transfers between them."""
    seg: dict = {}
    home: dict = {}  # var -> {rank: segment that produced it there}
    for eqn in placement.after:
        ranks = placement.eqn_ranks.get(id(eqn))
        if ranks is None:
            continue
        for r in sorted(ranks):
            s = 0
            for v in eqn.invars:
                if not isinstance(v, Var) or v not in home:
                    continue
                where = home[v]
                if r in where:
                    s = max(s, where[r])
                else:
                    s = max(s, min(where.values()) + 1)
            seg[(id(eqn), r)] = s
        for o in eqn.outvars:
            home[o] = {r: seg[(id(eqn), r)] for r in ranks}
    return seg


def is_var(v) -> bool:
    return isinstance(v, Var) and not isinstance(v, Literal)
