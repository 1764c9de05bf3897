"""Which work after the loop runs as parts that groups share (one program for every group).

An optimizer update is cut into its independent parts (`blocks.independent_parts`: in practice
one weight's update, or its squared norm) only where a part is the very same program on several
of this process's groups, and only where that leaves less to compile (`PROGRAM_COST_EQNS`):
uniform stages' whole after-loop tasks already share one compile, so a layer stack's update is cut
from the embedding's and the head's where those make the first and last groups' tasks differ.
"""

from __future__ import annotations

from jaxpp_integration.compiler.blocks import group_parts, independent_parts
from jaxpp_integration.compiler.task_functions import make_jaxpr_of


def after_loop_pieces(codes) -> dict:
    """id(code) -> the pieces of each after-loop task in `codes` (the distinct `TaskCode`s of
    one program): its independent parts (`independent_parts`) grouped by the groups
    whose tasks have the very same part, one piece per such set, the most widely shared first:
    a layer stack's optimizer update is then one program on every stage's group, the
    embedding's and the head's each a piece of its own; () when no part is shared."""
    parts = {  # (the engine's reduce_r / gather_r tasks batch collectives: left whole)
        id(c): independent_parts(c.eqns, c.outvars)
        for c in codes
        if c.kind == "after" and c.name.startswith("after_loop_")
    }
    text = {
        id(p): str(make_jaxpr_of(p.eqns, p.invars, p.outvars)) for ps in parts.values() for p in ps
    }
    ranks: dict = {}
    for c in codes:
        for p in parts.get(id(c), ()):
            ranks.setdefault(text[id(p)], set()).add(c.rank)
    # parts found on the same groups go together; the most widely shared first
    kinds = sorted({frozenset(r) for r in ranks.values()}, key=lambda r: (-len(r), sorted(r)))
    order = {r: i for i, r in enumerate(kinds)}
    out = {}
    for c in codes:
        ps = parts.get(id(c))
        if ps:
            groups = [  # the scalars handed on last, whatever groups they are found on
                len(kinds) if p.role == "light" else order[frozenset(ranks[text[id(p)]])]
                for p in ps
            ]
            if any(g < len(kinds) and len(kinds[g]) > 1 for g in groups):  # else: as it is
                out[id(c)] = tuple(group_parts(c.eqns, ps, groups, c.outvars))
    # a task is cut only if a piece of it is one program with a piece of another group's task
    # (a task left whole, e.g. for `blocks._same_scalar_uses`, shares nothing)
    piece_text = {
        id(p): str(make_jaxpr_of(p.eqns, p.invars, p.outvars)) for ps in out.values() for p in ps
    }
    while True:
        found: dict = {}
        for c in codes:
            for p in out.get(id(c), ()):
                found.setdefault(piece_text[id(p)], set()).add(c.rank)
        lone = [
            c
            for c in codes
            if out.get(id(c)) and all(len(found[piece_text[id(p)]]) < 2 for p in out[id(c)])
        ]
        if not lone:
            break
        for c in lone:
            out[id(c)] = ()
    # cut only if that makes less to compile: XLA's work grows with a program's equations, plus
    # a fixed cost per program (identical whole tasks, as uniform stages have, share one compile)
    after = [c for c in codes if id(c) in parts]
    task_text = {id(c): str(make_jaxpr_of(c.eqns, c.invars, c.outvars)) for c in after}
    whole = {task_text[id(c)]: len(c.eqns) for c in after}
    cut = {piece_text[id(p)]: len(p.eqns) for c in after for p in out.get(id(c), ())}
    cut.update((task_text[id(c)], len(c.eqns)) for c in after if not out.get(id(c)))
    if sum(n + PROGRAM_COST_EQNS for n in cut.values()) >= sum(
        n + PROGRAM_COST_EQNS for n in whole.values()
    ):
        return {}
    return {k: v for k, v in out.items() if v}


# What compiling one more program costs, in equations of a program (XLA:CPU here: ~25 ms for a
# program of a few equations, ~2 ms per optimizer equation).
PROGRAM_COST_EQNS = 25
