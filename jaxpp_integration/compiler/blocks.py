"""Pass: cut each loop task at its layer scans, so every stage's layer block is one program.

A scanned model runs each stage's layers as one `scan` over weights stacked along a leading
layer axis. Left whole, the first stage's forward also holds the embedding and the last stage's
the final norm, head and loss, so three different programs (first, middle, last stage) each
carry their own copy of the scan body, and so do the backward tasks: XLA compiles the body six
times, whatever the depth. Here a loop task is cut into *pieces*, compiled as programs of their
own and run back to back as the one schedule task they make up (`ChainedExecutable`):

- a **layer block**: a top-level `scan` over weights stacked per layer (or their casts, or
  what the forward's layer scan stacked for the backward; a scan over computed values, such as
  chunked attention inside an unrolled layer, is not one), with the
  program constants it reads (values computed from nothing, such as rotary tables and causal
  masks, recomputed where they are read) and the sharding constraints that close a stage's
  layers: the constraint on the scan's result in a forward task, its transpose on the scan's
  incoming cotangent in a backward task;
- the **glue** before, between and after the blocks (the first stage's embedding, the last
  stage's norm, head and loss and their gradients), one piece per gap, left out when empty.

Stages with the same layer count and remat policy thus have identical block pieces, compiled once
for the forward and once for the backward and loaded onto every group (`task_functions.py` keys
programs by their equations, never by stage or device). A task without a layer scan stays one
program.

Each piece uses the scalars it combines with arrays as XLA sees them used in the whole task
(`_same_scalar_uses`; where that cannot be arranged the task is not cut), so XLA simplifies it
alike and results keep their bits. Work after the loop (an optimizer update) is cut the same
way into its independent parts (`independent_parts`, `group_parts`; which tasks are cut:
`shared_parts.py`): the update of a layer stack is then one program for every stage.

Guarantees: the pieces run in order compute exactly the task's equations (a piece reads only
task inputs and earlier pieces' outputs); every accumulator the task updates is updated by
exactly one piece (the one producing its value, else the last); the schedule, the simulator and
the memory accounting keep seeing one task (`Run`): values passed between pieces live only
while the task runs, like a program's temporaries.
"""

from __future__ import annotations

import dataclasses

from jax.extend.core import Var

from jaxpp_integration.frontend.marker import is_marker
from jaxpp_integration.schedules import Phase

_CONSTRAINT = "sharding_constraint"


@dataclasses.dataclass
class Piece:
    """One program of a cut task: its equations and what it reads and hands on."""

    role: str  # "layers"; "pre" / "mid" / "post": glue before / between / after; "part<i>"
    eqns: list
    invars: list = dataclasses.field(default_factory=list)  # task inputs or earlier outputs
    outvars: list = dataclasses.field(default_factory=list)  # read by later pieces or outside
    owned: list = dataclasses.field(default_factory=list)  # positions in the task's accumulators


def is_layer_scan(eqn, layer_values) -> bool:
    """A top-level `scan` over values stacked per layer (see `stacked_layer_values`)."""
    if eqn.primitive.name != "scan":
        return False
    xs = eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"] :]
    return any(isinstance(v, Var) and v in layer_values for v in xs)


# Equations that only cast or lay out a value: a weight's cast is still that weight.
_CASTS = frozenset(["convert_element_type", "sharding_constraint", "copy", "copy_p"])


def stacked_layer_values(loop_constants, eqns) -> set:
    """The values a layer scan scans over, over `eqns` (the loop body's, in order): the loop
    constants (weights stacked per layer) and their casts, and what a layer scan stacks per
    layer (its `ys`: the residuals the backward's scan reads, such as a bfloat16 copy of each
    layer's weights). So the backward of a layer block is a layer block too, while a scan over
    computed values (chunked attention inside an unrolled layer, and its backward) is not."""
    out = set(loop_constants)
    for e in eqns:
        if is_marker(e):
            out.update(o for o, i in zip(e.outvars, e.invars) if isinstance(i, Var) and i in out)
        elif e.primitive.name in _CASTS:
            if any(isinstance(v, Var) and v in out for v in e.invars):
                out.update(e.outvars)
        elif is_layer_scan(e, out):
            out.update(e.outvars[e.params["num_carry"] :])
    return out


def constant_eqns(eqns) -> set:
    """Ids of the equations computed from nothing (no effects, every input a literal or the
    result of such an equation): program constants, recomputed wherever they are read."""
    made, out = set(), set()
    for e in eqns:
        if not e.effects and all(not isinstance(v, Var) or v in made for v in e.invars):
            out.add(id(e))
            made.update(e.outvars)
    return out


def cut_task(eqns, outvars, owned_vars, phase: Phase, layer_values) -> list[Piece]:
    """The pieces of one loop task, or [] when it has no layer scan (one program, as it is).

    `outvars`: the task's values other tasks read; `owned_vars`: the body outputs it accumulates
    (Var or Literal, in accumulator order); `layer_values`: see `stacked_layer_values`."""
    scans = {id(e) for e in eqns if is_layer_scan(e, layer_values)}
    if not scans:
        return []
    consts = constant_eqns(eqns)
    segments: list[Piece] = []
    glue: list = []
    for e in eqns:
        if id(e) in consts:
            continue
        if id(e) in scans:
            segments += [Piece("glue", glue), Piece("layers", [e])]
            glue = []
        else:
            glue.append(e)
    segments.append(Piece("glue", glue))
    needed_outside = {v for v in [*outvars, *owned_vars] if isinstance(v, Var)}
    for k, seg in enumerate(segments):
        if seg.role != "layers":
            continue
        if phase is Phase.FWD:
            _absorb_constraints_after(seg, segments[k + 1])
        else:
            _absorb_constraints_before(seg, segments[k - 1], segments, needed_outside)
            _absorb_stack_transposes(seg, segments[k + 1], owned_vars)
    _add_constants(segments, eqns, consts, needed_outside)
    pieces = [p for p in segments if p.eqns]  # a single piece too: keyed like other blocks
    first = next(i for i, p in enumerate(pieces) if p.role == "layers")
    last = max(i for i, p in enumerate(pieces) if p.role == "layers")
    for i, p in enumerate(pieces):
        if p.role == "glue":
            p.role = "pre" if i < first else "post" if i > last else "mid"
    _wire(pieces, outvars, owned_vars)
    handed = [*outvars, *owned_vars]
    if not all(_same_scalar_uses(eqns, handed, p) for p in pieces):
        return []  # XLA would simplify a piece otherwise than the task: left one program
    return pieces


def _absorb_constraints_after(block: Piece, after: Piece) -> None:
    """Forward: constraints on the scan's results (a stage's closing constraint) join the block."""
    made = {o for e in block.eqns for o in e.outvars}
    for e in list(after.eqns):
        if e.primitive.name == _CONSTRAINT and all(
            not isinstance(v, Var) or v in made for v in e.invars
        ):
            after.eqns.remove(e)
            block.eqns.append(e)
            made.update(e.outvars)


def _absorb_stack_transposes(block: Piece, after: Piece, owned_vars) -> None:
    """Backward: a transpose [L, D, ...] -> [D, L, ...] of what the scan stacks (a per-layer
    partial sum, `unreduced.py`) that gives an accumulated value and nothing else joins the
    block, so the block adds each layer's slice into its accumulator inside the scan
    (`scan_accumulate.py`) instead of stacking them all first."""
    made = {o for e in block.eqns for o in e.outvars}
    owned = {v for v in owned_vars if isinstance(v, Var)}
    read_later = {v for e in after.eqns for v in e.invars if isinstance(v, Var)}
    for e in list(after.eqns):
        perm = tuple(e.params.get("permutation", ())) if e.primitive.name == "transpose" else ()
        if (
            perm[:2] == (1, 0)
            and perm[2:] == tuple(range(2, len(perm)))
            and isinstance(e.invars[0], Var)
            and e.invars[0] in made
            and e.outvars[0] in owned
            and e.outvars[0] not in read_later
        ):
            after.eqns.remove(e)
            block.eqns.append(e)


def _absorb_constraints_before(block: Piece, before: Piece, segments, needed_outside) -> None:
    """Backward: constraints whose results only the block reads (the transpose of the forward's
    closing constraint, on the incoming cotangent) join the block."""
    for e in reversed(list(before.eqns)):
        if e.primitive.name != _CONSTRAINT:
            continue
        outs = set(e.outvars)
        if outs & needed_outside:
            continue
        readers = [
            other
            for seg in segments
            if seg is not block
            for other in seg.eqns
            if any(isinstance(v, Var) and v in outs for v in other.invars)
        ]
        if readers:
            continue
        before.eqns.remove(e)
        block.eqns.insert(0, e)


def _add_constants(segments, eqns, consts, needed_outside) -> None:
    """Gives every piece the program constants it reads (in program order); constants the task
    hands on that no piece computes go to the last non-empty piece."""
    made_by = {o: e for e in eqns if id(e) in consts for o in e.outvars}

    def closure(wanted):
        need = {v for v in wanted if v in made_by}
        keep = []
        for e in reversed(eqns):
            if id(e) in consts and any(o in need for o in e.outvars):
                keep.append(e)
                need.update(v for v in e.invars if isinstance(v, Var))
        return keep[::-1]

    for seg in segments:
        reads = {v for e in seg.eqns for v in e.invars if isinstance(v, Var)}
        seg.eqns[:0] = closure(reads)
    computed = {o for seg in segments for e in seg.eqns for o in e.outvars}
    missing = [v for v in needed_outside if v in made_by and v not in computed]
    if missing:
        last = next(seg for seg in reversed(segments) if seg.eqns)
        have = {id(e) for e in last.eqns}
        last.eqns[:0] = [e for e in closure(missing) if id(e) not in have]


def _wire(pieces: list[Piece], outvars, owned_vars) -> None:
    """Sets each piece's inputs, outputs and accumulators (see `Piece`)."""
    made_in = [{o for e in p.eqns for o in e.outvars} for p in pieces]
    for k, v in enumerate(owned_vars):  # the last piece producing it, else the last piece
        home = next(
            (i for i in range(len(pieces) - 1, -1, -1) if isinstance(v, Var) and v in made_in[i]),
            len(pieces) - 1,
        )
        pieces[home].owned.append(k)
    handed = {v for v in outvars if isinstance(v, Var)}
    for i, p in enumerate(pieces):
        reads = []
        wanted = [v for e in p.eqns for v in e.invars] + [owned_vars[k] for k in p.owned]
        for v in wanted:
            if isinstance(v, Var) and v not in made_in[i] and v not in reads:
                reads.append(v)
        p.invars = reads
    for i, p in enumerate(pieces):
        later = {v for q in pieces[i + 1 :] for v in q.invars}
        p.outvars = []
        for e in p.eqns:
            for o in e.outvars:
                if (
                    (o in later or o in handed)
                    and o not in p.outvars
                    and not _made_later(o, made_in, i)
                ):
                    p.outvars.append(o)


def _made_later(v, made_in, i) -> bool:
    """A program constant recomputed by a later piece: that piece hands it on, not this one."""
    return any(v in m for m in made_in[i + 1 :])


def independent_parts(eqns, outvars) -> list[Piece]:
    """Work outside the loop (an optimizer update) cut into its independent parts, or [] when
    it is one part: one piece per group of equations connected through non-scalar values (in
    practice one parameter's update, or its squared norm), scalar work that only reads scalars
    (a step count, a clip factor, a learning rate) recomputed in every part that reads it. So
    the update of a layer stack is one program for every stage, and of every weight of one
    shape. Parts run in an order that respects the scalars one hands another (a squared norm
    summed later); the scalars the task hands on (`outvars`) are made by a last part of their
    own (role "light"), so the other parts look alike on every group."""
    light = {
        id(e)
        for e in eqns
        if not e.effects and e.outvars and all(_scalar(v) for v in [*e.invars, *e.outvars])
    }
    heavy = [e for e in eqns if id(e) not in light]
    if len(heavy) < 2:
        return []
    parent = {id(e): id(e) for e in heavy}

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    made_by = {o: e for e in heavy for o in e.outvars}
    for e in heavy:
        for v in e.invars:
            if isinstance(v, Var) and not _scalar(v) and v in made_by:
                parent[root(id(made_by[v]))] = root(id(e))
    groups: dict = {}
    for e in heavy:
        groups.setdefault(root(id(e)), []).append(e)
    if len(groups) < 2:
        return []
    light_by = {o: e for e in eqns if id(e) in light for o in e.outvars}

    def light_closure(wanted) -> list:
        need, keep = set(wanted), []
        for e in reversed(eqns):
            if id(e) in light and any(o in need for o in e.outvars):
                keep.append(e)
                need.update(v for v in e.invars if isinstance(v, Var))
        return keep[::-1]

    position = {id(e): i for i, e in enumerate(eqns)}
    parts = []
    for members in groups.values():
        reads = {v for e in members for v in e.invars if isinstance(v, Var) and v in light_by}
        body = light_closure(reads) + members
        parts.append(Piece("part", sorted(body, key=lambda e: position[id(e)])))
    handed = [v for v in outvars if isinstance(v, Var) and v in light_by]
    order = _dependency_order(parts)
    if order is None:  # parts that feed each other scalars both ways: left whole
        return []
    if handed:  # light results the task hands on: made last, by a part of their own
        order.append(Piece("light", light_closure(handed)))
    for i, part in enumerate(order):
        part.role = f"part{i}" if part.role == "part" else part.role
    _wire(order, outvars, [])
    return order


def group_parts(eqns, parts: list[Piece], groups: list[int], outvars) -> list[Piece]:
    """`parts` (of `independent_parts`) merged into one piece per group id (`groups[i]` for
    part i), smaller ids first where the values they hand each other allow; [] when no order
    is valid."""
    ids = sorted(set(groups))
    position = {id(e): i for i, e in enumerate(eqns)}
    merged = []
    for g in ids:
        seen, body = set(), []
        for part, pg in zip(parts, groups):
            if pg == g:
                for e in part.eqns:
                    if id(e) not in seen:
                        seen.add(id(e))
                        body.append(e)
        merged.append(Piece("part", sorted(body, key=lambda e: position[id(e)])))
    order = _dependency_order(merged)
    if order is None:
        return []
    for i, piece in enumerate(order):
        piece.role = f"part{i}"
    _wire(order, outvars, [])
    if not all(_same_scalar_uses(eqns, outvars, piece) for piece in order):
        return []
    return order


def _same_scalar_uses(eqns, outvars, piece: Piece) -> bool:
    """Makes XLA see every scalar `piece` combines with arrays used once there exactly when it
    is used once in the whole task, or says it cannot. XLA rewrites `x / s` as `x * (1 / s)`
    only when `s` has one use (and then no longer folds `(x / a) / b` into `x / (a * b)`), which
    changes results in the last bit. A scalar used once in the piece but several times in the
    task (one weight's update cut from the others') is also handed out of the piece, a second
    use that keeps XLA's choice; one used several times in the piece but once in the task
    cannot be helped (False: the task is not cut)."""

    def uses(body, handed):
        n: dict = {}
        for e in body:
            for v in e.invars:
                if isinstance(v, Var) and _scalar(v):
                    n[v] = n.get(v, 0) + 1
        for v in handed:
            if isinstance(v, Var) and _scalar(v):
                n[v] = n.get(v, 0) + 1
        return n

    whole = uses(eqns, outvars)
    mine = uses(piece.eqns, piece.outvars)
    mixed = []  # in the order of first use (program order: the same on every run)
    for e in piece.eqns:
        if not all(_scalar(o) for o in e.outvars):
            for v in e.invars:
                if isinstance(v, Var) and _scalar(v) and v not in mixed:
                    mixed.append(v)
    for v in mixed:
        if (mine[v] == 1) == (whole.get(v, 0) == 1):
            continue
        if mine[v] != 1:
            return False
        piece.outvars.append(v)  # (an output nobody reads: the second use)
    return True


def _scalar(v) -> bool:
    return not getattr(getattr(v, "aval", None), "shape", (1,))


def _dependency_order(parts):
    """`parts` ordered so that each reads only what earlier ones make (stable: program order
    among independent parts), or None when no such order exists."""
    made = [{o for e in p.eqns for o in e.outvars} for p in parts]
    reads = [
        {v for e in p.eqns for v in e.invars if isinstance(v, Var)} - made[i]
        for i, p in enumerate(parts)
    ]
    after = [
        {j for j in range(len(parts)) if j != i and reads[i] & made[j]} for i in range(len(parts))
    ]
    out, done = [], set()
    while len(out) < len(parts):
        ready = [i for i in range(len(parts)) if i not in done and after[i] <= done]
        if not ready:
            return None
        done.add(ready[0])
        out.append(parts[ready[0]])
    return out


class ChainedExecutable:
    """A cut task's compiled pieces run back to back as one callable task program.

    `steps`: per piece (its executable, positions of its arguments among the task's arguments
    and the outputs of earlier pieces); `results`: the positions of the task's outputs;
    `nbytes`: bytes per device of the value at each position; `consume`: the task's donated
    arguments no piece was given to donate (scalars), deleted after the last piece, so the task
    consumes every argument it donates as one program would. A value passed between pieces is
    dropped after its last reader, so it lives no longer than a temporary of one program would.
    Reports (`as_text`, `cost_analysis`, `memory_analysis`) are those of the pieces together, so
    tools reading one executable per task keep working."""

    def __init__(
        self, steps, results, n_args: int, input_shardings, output_shardings, nbytes, consume=()
    ):
        self.steps = steps
        self.consume = list(consume)
        self.results = list(results)
        self.n_args = n_args
        self.input_shardings = (tuple(input_shardings), {})
        self.output_shardings = list(output_shardings)
        self.nbytes = list(nbytes)
        self.programs: list = []  # (program key, compile.TaskProgram) per piece, for tools
        last_use = {p: k for k, (_, args) in enumerate(steps) for p in args}
        keep = set(self.results)
        self._drop = [
            [p for p, k2 in last_use.items() if k2 == k and p not in keep and p >= n_args]
            for k in range(len(steps))
        ]

    @property
    def executables(self) -> list:
        return [exe for exe, _ in self.steps]

    def __call__(self, *args):
        env = list(args)
        for (exe, positions), drop in zip(self.steps, self._drop):
            env.extend(exe(*[env[p] for p in positions]))
            for p in drop:
                env[p] = None
        for p in self.consume:
            env[p].delete()
        return [env[p] for p in self.results]

    def as_text(self) -> str:
        """The pieces' HLO modules one after the other (each module read on its own: see
        `executables`)."""
        return "\n".join(exe.as_text() for exe in self.executables)

    def cost_analysis(self) -> dict:
        total: dict = {}
        for exe in self.executables:
            ca = exe.cost_analysis()
            for k, v in (ca[0] if isinstance(ca, list) else ca or {}).items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0.0) + v
        return total

    def memory_analysis(self) -> ChainedMemory:
        """The task's arguments and outputs; as temporary space, the largest over the pieces of
        a piece's own temporaries plus the values passed between pieces alive while it runs."""
        analyses = [exe.memory_analysis() for exe in self.executables]
        read = {p for _, args in self.steps for p in args if p < self.n_args}
        temp, alive, made = 0, set(), self.n_args
        for (exe, _), m, drop in zip(self.steps, analyses, self._drop):
            outs = range(made, made + len(exe.output_shardings))
            made += len(outs)
            alive.update(p for p in outs if p not in self.results)
            passing = sum(self.nbytes[p] for p in alive)
            temp = max(temp, int(m.temp_size_in_bytes) + passing)
            alive.difference_update(drop)
        return ChainedMemory(
            argument_size_in_bytes=sum(self.nbytes[p] for p in read),
            output_size_in_bytes=sum(self.nbytes[p] for p in self.results),
            alias_size_in_bytes=sum(int(m.alias_size_in_bytes) for m in analyses),
            temp_size_in_bytes=temp,
            generated_code_size_in_bytes=sum(int(m.generated_code_size_in_bytes) for m in analyses),
        )


@dataclasses.dataclass(frozen=True)
class ChainedMemory:
    """`memory_analysis()` of a `ChainedExecutable`, with XLA's field names (bytes per device)."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    generated_code_size_in_bytes: int
