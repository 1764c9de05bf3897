"""A task of a program, or a piece of a cut task, as the function XLA compiles, and what makes
two of them the same program.

`task_function` / `piece_function` turn a `TaskCode`'s equations into a Python function over flat
arrays (slicing the microbatch, updating accumulators); `jit_task` / `jit_piece` jit it on its
group's sub-mesh, with meshes captured inside equations rebound to that sub-mesh
(`rebind_meshes`), its outputs constrained to the task's specs and its name the task's (XLA's
module name). `task_key`, `piece_key` and `layout_key` say when two tasks or pieces are one
program on any group: their equations as traced, their accumulator handling and their input
layouts relative to the group's sub-mesh, never stage, rank or device ids. `compile.py` compiles
each distinct key once.
"""

from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding

from jaxpp_integration.compiler.program import Program, Run, TaskCode
from jaxpp_integration.compiler.scan_accumulate import accumulating_function
from jaxpp_integration.frontend.treduce import microbatch


def rebind_meshes(eqns, src_meshes, dst_mesh: Mesh):
    """Equations with every Mesh in `src_meshes` (and shardings on it) replaced by `dst_mesh`."""
    if all(m == dst_mesh for m in src_meshes):
        return eqns

    def fix(x):
        if isinstance(x, Mesh):
            return dst_mesh if x in src_meshes else x
        if isinstance(x, NamedSharding):
            if x.mesh in src_meshes:
                return NamedSharding(dst_mesh, x.spec, memory_kind=x.memory_kind)
            return x
        if isinstance(x, ClosedJaxpr):
            return ClosedJaxpr(fix(x.jaxpr), x.consts)
        if isinstance(x, Jaxpr):
            return Jaxpr(
                x.constvars,
                x.invars,
                x.outvars,
                [fix_eqn(e) for e in x.eqns],
                x.effects,
                x.debug_info,
            )
        if type(x) is tuple:
            return tuple(fix(y) for y in x)
        if type(x) is list:
            return [fix(y) for y in x]
        return x

    def fix_eqn(e):
        return e.replace(params={k: fix(v) for k, v in e.params.items()})

    return [fix_eqn(e) for e in eqns]


def make_jaxpr_of(eqns, invars, outvars, name="task") -> Jaxpr:
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    info = DebugInfo(
        name,
        name,
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return Jaxpr([], list(invars), list(outvars), list(eqns), effects, info)


def _eqns_fn(eqns, invars, outvars):
    jaxpr = make_jaxpr_of(eqns, invars, outvars)
    return jaxpr_as_fun(ClosedJaxpr(jaxpr, []))


def task_function(code: TaskCode, eqns):
    if code.kind == "before":
        run = _eqns_fn(eqns, code.invars, code.outvars)
        inits = code.acc_inits

        def before(*args):
            outs = list(run(*args[:-1]))  # the last input only pins the rank
            return outs + [op.init(n, aval) for op, n, aval in inits]

        return before
    if code.kind == "after":
        return _eqns_fn(eqns, code.invars, code.outvars)

    owned = [v for _, v in code.acc_ops]
    ops = [op for op, _ in code.acc_ops]
    return _loop_function(eqns, code.invars, code.outvars, owned, ops, code)


def piece_function(code: TaskCode, piece, eqns):
    """One piece of a task (see `compile_program`'s `pieces`) as a function. A loop task's
    piece takes (its inputs..., the accumulators it updates..., microbatch index): it slices the
    microbatch inputs it reads and updates its accumulators, as `task_function` does for a whole
    task.
    A part of after-loop work takes its inputs only."""
    if code.kind != "loop":
        return _eqns_fn(eqns, piece.invars, piece.outvars)
    ops = [code.acc_ops[k][0] for k in piece.owned]
    owned = [code.acc_ops[k][1] for k in piece.owned]
    return _loop_function(eqns, piece.invars, piece.outvars, owned, ops, code)


def _loop_function(eqns, invars, outvars, owned, ops, code: TaskCode):
    """fn(inputs..., accumulators..., microbatch index) of a loop task (or piece): it slices
    the microbatch inputs among `invars` and updates its accumulators, inside the layer scan
    that stacks a value where it can (`scan_accumulate`), else after its equations."""
    mb_vars = {code.invars[i] for i in code.mb_slices}
    slices = {i for i, v in enumerate(invars) if v in mb_vars}
    n_in, n_out = len(invars), len(outvars)
    axis = code.mb_axis
    inside = accumulating_function(eqns, invars, outvars, owned, ops)
    run = _eqns_fn(eqns, invars, list(outvars) + list(owned)) if inside is None else None

    def loop(*args):
        index = args[-1]
        ins = [microbatch(x, index, axis) if i in slices else x for i, x in enumerate(args[:n_in])]
        accs = args[n_in:-1]
        if inside is not None:
            return inside(ins, accs, index)
        outs = run(*ins)
        values, owned_vals = outs[:n_out], outs[n_out:]
        return list(values) + [op.update(a, v, index) for op, a, v in zip(ops, accs, owned_vals)]

    return loop


def piece_name(code: TaskCode, piece) -> str:
    """A piece's program name: `fwd_layers`, `bwd_layers`, ... for a layer block (one program
    for every stage that has it), `<task>_<role>` otherwise (`fwd_0_pre`, `fwd_3_post`,
    `after_loop_1_1_part4`: named after the first task compiling it)."""
    if piece.role == "layers":
        return f"{code.phase.value}_layers"
    return f"{code.name}_{piece.role}"


def piece_specs(code: TaskCode, piece) -> tuple:
    """The output specs of one piece, taken from its task's (`TaskCode.out_specs`)."""
    if not code.out_specs:
        return ()
    where = {v: i for i, v in enumerate(code.outvars)}
    specs = tuple(code.out_specs[where[v]] if v in where else None for v in piece.outvars)
    specs += tuple(code.out_specs[len(code.outvars) + k] for k in piece.owned)
    return specs if any(s is not None for s in specs) else ()


def piece_key(code: TaskCode, piece):
    """Like `task_key`, for one piece of a cut task: identical layer blocks of different stages
    (and groups) are the same program."""
    mb_vars = {code.invars[i] for i in code.mb_slices}
    owned = [code.acc_ops[k][1] for k in piece.owned]
    text = str(make_jaxpr_of(piece.eqns, piece.invars, list(piece.outvars) + owned))
    return (
        "piece",
        text,
        tuple(str(code.acc_ops[k][0]) for k in piece.owned),
        tuple(i for i, v in enumerate(piece.invars) if v in mb_vars),
        code.mb_axis,
        piece_specs(code, piece),
    )


def task_key(code: TaskCode):
    """What makes two tasks the same program, whatever group they run on: the task's equations
    as traced against the lowering mesh (identical text for identical stages), its kind, its
    accumulator handling and which inputs are sliced per microbatch. No rank, no device ids."""
    text = str(make_jaxpr_of(code.eqns, code.invars, code.outvars))
    return (
        code.kind,
        text,
        tuple(str(op) for op, _ in code.acc_ops),
        tuple(str(i) for i in code.acc_inits),
        code.mb_slices,
        code.mb_axis,
        code.out_specs,
    )


def layout_key(sharding, mesh: Mesh):
    """An input sharding relative to its group's sub-mesh: the spec and memory kind, plus the
    sub-mesh's axis names and shape. Equal for the same layout on any group of one MpmdMesh."""
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        size = dict(zip(mesh.axis_names, mesh.devices.shape))
        spec = []
        for entry in sharding.spec:  # axes of size 1 split nothing: P("fsdp") == P() there
            names = entry if isinstance(entry, tuple) else (entry,)
            kept = tuple(n for n in names if not isinstance(n, str) or size.get(n, 1) > 1)
            spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        while spec and spec[-1] is None:
            spec.pop()
        kind = None if sharding.memory_kind == "device" else sharding.memory_kind
        return (tuple(spec), kind, mesh.axis_names, mesh.devices.shape)
    return ("exact", sharding)  # another kind of sharding: only shared where it is identical


def plain_sharding(sharding, mesh: Mesh):
    """A piece output's sharding as the sharding the engine gives a task input of that layout
    (default memory kind left implicit), so a layer block reading it is keyed and lowered alike
    whether its input came from an earlier piece or from another group."""
    if (
        isinstance(sharding, NamedSharding)
        and sharding.mesh == mesh
        and sharding.memory_kind in (None, "device")
    ):
        return NamedSharding(mesh, sharding.spec)
    return sharding


def device_bytes(aval, sharding) -> int:
    """Bytes one device holds of an array of `aval` laid out by `sharding`."""
    shape = sharding.shard_shape(aval.shape) if hasattr(sharding, "shard_shape") else aval.shape
    n = 1
    for d in shape:
        n *= d
    return n * aval.dtype.itemsize


def _sds(aval, sharding):
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False)
    )


def jit_task(prog: Program, mpmd_mesh, ins: Run, in_shardings):
    """(the `jax.jit` of `ins`'s program on its group's mesh, its abstract arguments)."""
    code = ins.code
    group = mpmd_mesh.unstack[code.rank]
    eqns = rebind_meshes(code.eqns, (mpmd_mesh.lowering_mesh(), mpmd_mesh.jax_mesh), group)
    fn = task_function(code, eqns)
    if code.out_specs:
        fn = constrained(fn, code.out_specs, group)
    fn = named(fn, code.name)  # XLA's module name; JAX's compile events and logs say it
    avals = tuple(_sds(prog.slot_aval[s], sh) for s, sh in zip(ins.ins, in_shardings))
    return jax.jit(fn, donate_argnums=ins.donate, keep_unused=True), avals


def jit_piece(mpmd_mesh, code: TaskCode, piece, avals, in_shardings, donate):
    """(the `jax.jit` of one piece of `code` on its group's mesh, its abstract arguments)."""
    group = mpmd_mesh.unstack[code.rank]
    eqns = rebind_meshes(piece.eqns, (mpmd_mesh.lowering_mesh(), mpmd_mesh.jax_mesh), group)
    fn = piece_function(code, piece, eqns)
    specs = piece_specs(code, piece)
    if specs:
        fn = constrained(fn, specs, group)
    fn = named(fn, piece_name(code, piece))
    args = tuple(_sds(a, sh) for a, sh in zip(avals, in_shardings))
    return jax.jit(fn, donate_argnums=donate, keep_unused=True), args


def named(fn, name: str):
    """`fn` under the function name `name` (what `jax.jit` names the program after)."""

    def program(*args):
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def constrained(fn, specs, mesh: Mesh):
    """`fn` with output i constrained to `specs[i]` on `mesh` (None: left to XLA)."""

    def wrapped(*args):
        outs = fn(*args)
        return [
            o if s is None else jax.lax.with_sharding_constraint(o, NamedSharding(mesh, s))
            for o, s in zip(outs, specs)
        ]

    return wrapped
