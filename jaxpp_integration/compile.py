"""Pass: turn each distinct task into a compiled SPMD executable on its group's sub-mesh.

Each `TaskCode` becomes a Python function over flat arrays (evaluating its equations, slicing the
microbatch, updating accumulators) and is compiled with `jax.jit(...).lower(...).compile()` with
explicit input shardings on its rank's mesh. Meshes captured inside equations (sharding
constraints, nested jits, shard_map) are rebound from the lowering mesh to the group's mesh.
Executables are cached by (rank, task jaxpr text, input shardings, donation), so microbatches —
and identical stages on one rank — share one compile.
"""

from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpp_integration.program import Fill, Program, Run, TaskCode, Transfer
from jaxpp_integration.treduce import microbatch


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
    run = _eqns_fn(eqns, code.invars, list(code.outvars) + owned)
    n_in = len(code.invars)
    n_out = len(code.outvars)
    slices = set(code.mb_slices)
    ops = [op for op, _ in code.acc_ops]
    axis = code.mb_axis

    def loop(*args):
        index = args[-1]
        ins = [microbatch(x, index, axis) if i in slices else x for i, x in enumerate(args[:n_in])]
        accs = args[n_in:-1]
        outs = run(*ins)
        values, owned_vals = outs[:n_out], outs[n_out:]
        return list(values) + [op.update(a, v, index) for op, a, v in zip(ops, accs, owned_vals)]

    return loop


def _key(code: TaskCode, eqns):
    text = str(make_jaxpr_of(eqns, code.invars, code.outvars))
    return (
        code.kind,
        code.rank,
        text,
        tuple(str(op) for op, _ in code.acc_ops),
        tuple(str(i) for i in code.acc_inits),
        code.mb_slices,
    )


def _sds(aval, sharding):
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False)
    )


def compile_program(prog: Program, mpmd_mesh, input_shardings: dict, cache: dict):
    """Compiles every Run of `prog`; returns (executables per instr index, slot shardings)."""
    lowering = mpmd_mesh.lowering_mesh()
    src_meshes = (lowering, mpmd_mesh.jax_mesh)
    slot_sharding = dict(input_shardings)
    for s in prog.constants:
        slot_sharding[s] = mpmd_mesh.sharding(prog.slot_rank[s], PartitionSpec())
    executables = {}
    fn_cache: dict = {}
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Transfer):
            src = slot_sharding[ins.src]
            spec = src.spec if isinstance(src, NamedSharding) else PartitionSpec()
            slot_sharding[ins.dst] = mpmd_mesh.sharding(ins.dst_rank, spec)
        elif isinstance(ins, Run):
            code = ins.code
            if id(code) not in fn_cache:
                eqns = rebind_meshes(code.eqns, src_meshes, mpmd_mesh.unstack[code.rank])
                fn = task_function(code, eqns)
                if code.out_specs:
                    fn = _constrained(fn, code.out_specs, mpmd_mesh.unstack[code.rank])
                fn_cache[id(code)] = (fn, (_key(code, eqns), code.out_specs))
            fn, key = fn_cache[id(code)]
            in_sh = tuple(slot_sharding[s] for s in ins.ins)
            full_key = (key, in_sh, ins.donate)
            if full_key not in cache:
                avals = [_sds(prog.slot_aval[s], sh) for s, sh in zip(ins.ins, in_sh)]
                cache[full_key] = (
                    jax.jit(fn, donate_argnums=ins.donate, keep_unused=True).lower(*avals).compile()
                )
            exe = cache[full_key]
            executables[idx] = exe
            for s, sh in zip(ins.outs, exe.output_shardings):
                slot_sharding[s] = sh
        elif isinstance(ins, Fill):
            spec = prog.slot_spec.get(ins.slot, PartitionSpec())
            slot_sharding[ins.slot] = mpmd_mesh.sharding(ins.rank, spec)
    return executables, slot_sharding


def _constrained(fn, specs, mesh: Mesh):
    """`fn` with output i constrained to `specs[i]` on `mesh` (None: left to XLA)."""

    def wrapped(*args):
        outs = fn(*args)
        return [
            o if s is None else jax.lax.with_sharding_constraint(o, NamedSharding(mesh, s))
            for o, s in zip(outs, specs)
        ]

    return wrapped


def literal_value(v):
    return v.val if isinstance(v, Literal) else None
