"""Pass (option `gradient_reduction="step"`): keep the loop's `Add` outputs unreduced per device.

Under data parallelism inside a group, a gradient (or a loss sum, a token count) is a sum over
the rows of a microbatch that are spread over the data axes; XLA reduces it with an all-reduce
in every task instance, so m times per step. This pass rewrites the `treduce` body before it is
partitioned so that such sums come out as per-device partial sums with a leading axis of size D
(the product of the data axes): the reduction over rows `sum_n x_n` becomes
`sum_d (sum_k x_{d*N/D+k})`, computed as a `vmap` over the D slices, which needs no
communication when the rows are sharded over those axes. The partial sums are then carried
through linear operations (transpose, reshape, casts between floats, products with a non-partial
factor, sums of partials; adding a non-partial value adds it to slice 0) and accumulated as is;
the engine sums the leading axis once per step after the loop (`reduce_r` tasks).

Exactness: the rewrite is algebraically exact whatever dimension it splits — only the order of
the floating-point additions changes (results agree with `jax.jit` to rounding, ~1e-7
relative). Which dimension is "the rows" (`ddim`) is tracked from the step inputs' specs through
the equations; a wrong guess only costs memory or communication, never correctness. A partial
value that an unsupported operation reads, or that another stage reads (it would be sent at D
times its size), is summed first: that is today's per-microbatch all-reduce for that value only.

Call primitives (`pjit`, `checkpoint`, `closed_call`, custom derivatives, which after
differentiation only evaluate) are inlined so gradients computed inside them can be deferred;
`scan`/`while`/`cond` bodies are left alone (their outputs are reduced per microbatch).

The same row tracking also answers two sharding questions for the program builder:
`reduced_specs` (the spec a deferred sum should come out with: its weight's, so fsdp gets a
reduce-scatter) and `gather_specs` (`pipeline_fsdp_ag_once`: what each fsdp-sharded weight is
gathered to once per step).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal, Var
from jax.sharding import PartitionSpec

from jaxpp_integration.frontend.marker import is_marker
from jaxpp_integration.frontend.reductions import Add
from jaxpp_integration.jax_compat import eqn_source_context

# call-like primitives whose body is evaluated inline: name -> parameter holding the jaxpr
_INLINE = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
_ELEMENTWISE_UNARY_LINEAR = {"neg", "copy", "copy_p", "real", "imag", "conj", "reduce_precision"}
_SHAPE_LINEAR = {
    "transpose",
    "reshape",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "reduce_sum",
    "rev",
    "slice",
    "cumsum",
}


@dataclasses.dataclass(frozen=True)
class RowDim:
    """Dimension `dim` of a value holds rows spread over mesh `axes` (D = their size product)."""

    dim: int
    axes: tuple


@dataclasses.dataclass
class _V:
    val: object
    row: RowDim | None = None
    partial: tuple | None = None  # data axes of a partial sum stored as [D, *shape]


@dataclasses.dataclass
class Deferred:
    """The rewritten body and, per body output, the axes it stays unreduced over (or None)."""

    body: ClosedJaxpr
    partial_axes: list


def seed_rows(jaxpr, in_specs: list, before_eqns: list, xs_vars: list, axis: int) -> list:
    """The row dimension of each microbatch (per-microbatch leaf of `xs_vars`), found from the
    step inputs' specs through the equations before the loop; None where unknown."""
    rows: dict = {}
    for v, spec in zip(jaxpr.invars, in_specs):
        for d, entry in enumerate(tuple(spec)):
            if entry is not None:
                rows[v] = RowDim(d, tuple(entry) if isinstance(entry, tuple) else (entry,))
                break
    for eqn in before_eqns:
        ins = [rows.get(v) if _is_var(v) else None for v in eqn.invars]
        if not any(ins):
            continue
        for o, r in zip(eqn.outvars, _propagate(eqn.primitive.name, eqn.params, eqn, ins)):
            if r is not None:
                rows[o] = r
    out = []
    for v in xs_vars:
        r = rows.get(v) if _is_var(v) else None
        if r is None or r.dim == axis:
            out.append(None)
        else:
            out.append(RowDim(r.dim - (r.dim > axis), r.axes))
    return out


def defer_reductions(body: ClosedJaxpr, n_consts: int, mb_rows: list, ops, mesh_shape) -> Deferred:
    """Rewrites `body` (invars = consts, microbatch leaves) so that `Add` outputs summed over
    rows are per-device partial sums [D, *shape]. `mesh_shape` maps axis name -> size."""
    jaxpr = body.jaxpr
    region = _regions(jaxpr)
    users = _user_regions(jaxpr, region)

    def run(*args):
        env: dict = {}
        for i, (v, a) in enumerate(zip(jaxpr.invars, args)):
            row = mb_rows[i - n_consts] if i >= n_consts else None
            env[v] = _V(a, row)
        for v, c in zip(jaxpr.constvars, body.consts):
            env[v] = _V(c)
        _eval_eqns(jaxpr.eqns, env, mesh_shape, region, users)
        result = []
        for v, op in zip(jaxpr.outvars, ops):
            x = _read(env, v) if not isinstance(v, Literal) else _V(v.val)
            if x.partial is not None and not isinstance(op, Add):
                x = _materialize(x)
            result.append(x)
        return result

    captured: list = []

    def traced(*args):
        res = run(*args)
        captured[:] = [x.partial for x in res]
        return [x.val for x in res]

    new = jax.make_jaxpr(traced)(*body.in_avals)
    if new.consts:  # a captured constant would break the invar layout: keep the body as is
        return Deferred(body, [None] * len(jaxpr.outvars))
    return Deferred(new, list(captured))


def _read(env, v):
    if isinstance(v, Literal):
        return _V(v.val)
    return env[v]


def _regions(jaxpr) -> dict:
    """Top-level equation id -> marker region (a new region starts after every marker)."""
    out, k = {}, 0
    for e in jaxpr.eqns:
        out[id(e)] = k
        if is_marker(e):
            k += 1
    return out


def _user_regions(jaxpr, region) -> dict:
    users: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if isinstance(v, Var) and not isinstance(v, Literal):
                users.setdefault(v, set()).add(region[id(e)])
    return users


def _eval_eqns(eqns, env, mesh_shape, region=None, users=None):
    for eqn in eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        with eqn_source_context(eqn):
            if name in _INLINE and _INLINE[name] in eqn.params:
                outs = _inline(eqn, ins, mesh_shape)
            else:
                outs = _apply(eqn, ins, mesh_shape)
        if region is not None:  # a partial read by another stage is reduced here, where made
            here = region[id(eqn)]
            outs = [
                _materialize(x) if x.partial and users.get(o, {here}) - {here} else x
                for o, x in zip(eqn.outvars, outs)
            ]
        for o, x in zip(eqn.outvars, outs):
            env[o] = x


def _inline(eqn, ins, mesh_shape):
    sub = eqn.params[_INLINE[eqn.primitive.name]]
    closed = sub if isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, [])
    inner = closed.jaxpr
    env: dict = {}
    for v, x in zip(inner.invars, ins):
        env[v] = x
    for v, c in zip(inner.constvars, closed.consts):
        env[v] = _V(c)
    _eval_eqns(inner.eqns, env, mesh_shape)
    return [_read(env, v) for v in inner.outvars]


def _materialize(x: _V) -> _V:
    if x.partial is None:
        return x
    return _V(jnp.sum(x.val, axis=0, dtype=x.val.dtype))


def _bind(eqn, vals):
    params = eqn.primitive.get_bind_params(eqn.params)  # e.g. shard_map's body as a function
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    out = eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _apply(eqn, ins, mesh_shape):
    name = eqn.primitive.name
    if any(x.partial is not None for x in ins):
        got = _apply_partial(eqn, ins)
        if got is not None:
            return got
        ins = [_materialize(x) for x in ins]
    split = _split_reduction(eqn, ins, mesh_shape)
    if split is not None:
        return split
    outs = _bind(eqn, [x.val for x in ins])
    rows = _propagate(name, eqn.params, eqn, [x.row for x in ins])
    return [_V(o, r) for o, r in zip(outs, rows)]


# ------------------------------------------------------------------ row tracking


def _propagate(name, params, eqn, rows) -> list:
    """Row dimension of each output, given those of the inputs (None = unknown)."""
    in_avals = [v.aval for v in eqn.invars]
    out_avals = [v.aval for v in eqn.outvars]
    k = next((i for i, r in enumerate(rows) if r is not None), None)
    if k is None:
        return [None] * len(out_avals)
    r = rows[k]
    shape = tuple(getattr(in_avals[k], "shape", ()))
    if name == "transpose":
        return [RowDim(tuple(params["permutation"]).index(r.dim), r.axes)]
    if name == "broadcast_in_dim":
        return [RowDim(params["broadcast_dimensions"][r.dim], r.axes)] if k == 0 else [None]
    if name == "reshape":
        return [_reshape_row(r, shape, tuple(out_avals[0].shape))]
    if name.startswith("reduce_") or name in ("argmax", "argmin"):
        axes = tuple(params.get("axes", ()))
        if r.dim in axes:
            return [None] * len(out_avals)
        return [RowDim(r.dim - sum(a < r.dim for a in axes), r.axes)] * len(out_avals)
    if name == "squeeze":
        dims = tuple(params["dimensions"])
        return [None] if r.dim in dims else [RowDim(r.dim - sum(a < r.dim for a in dims), r.axes)]
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        contract, batch = (lc, lb) if k == 0 else (rc, rb)
        if r.dim in contract:
            return [None]
        if r.dim in batch:
            return [RowDim(list(batch).index(r.dim), r.axes)]
        nb = len(lb)
        free_l = [d for d in range(len(in_avals[0].shape)) if d not in lc and d not in lb]
        free_r = [d for d in range(len(in_avals[1].shape)) if d not in rc and d not in rb]
        if k == 0:
            return [RowDim(nb + free_l.index(r.dim), r.axes)]
        return [RowDim(nb + len(free_l) + free_r.index(r.dim), r.axes)]
    # elementwise and the rest: the same dimension if an output keeps its size there
    n = shape[r.dim] if r.dim < len(shape) else None
    out = []
    for a in out_avals:
        s = tuple(getattr(a, "shape", ()))
        out.append(r if len(s) == len(shape) and r.dim < len(s) and s[r.dim] == n else None)
    return out


def _reshape_row(r: RowDim, src: tuple, dst: tuple):
    pre = math.prod(src[: r.dim])
    acc = 1
    for j, size in enumerate(dst):
        if acc == pre:
            n = src[r.dim]
            if size == n or size % n == 0 or n % size == 0:
                return RowDim(j, r.axes)
            return None
        acc *= size
        if acc > pre:
            return None
    return None


# ------------------------------------------------------------------ splitting reductions


def _size(mesh_shape, axes) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _split(x, dim: int, d: int):
    """[.., N, ..] -> [D, .., N/D, ..] (slice i holds rows i*N/D .. (i+1)*N/D - 1)."""
    shape = x.shape
    x = x.reshape(*shape[:dim], d, shape[dim] // d, *shape[dim + 1 :])
    return jnp.moveaxis(x, dim, 0)


def _can_split(x: _V, dim, mesh_shape) -> int:
    if x.row is None or x.row.dim != dim:
        return 0
    d = _size(mesh_shape, x.row.axes)
    n = x.val.shape[dim]
    return d if d > 1 and n % d == 0 else 0


def _split_reduction(eqn, ins, mesh_shape):
    """A sum over rows computed as D partial sums, or None when `eqn` is not one."""
    name = eqn.primitive.name
    if name == "reduce_sum":
        x = ins[0]
        if x.row is None or x.row.dim not in eqn.params["axes"]:
            return None
        d = _can_split(x, x.row.dim, mesh_shape)
        if not d:
            return None
        part = jax.vmap(lambda a: _bind(eqn, [a])[0])(_split(x.val, x.row.dim, d))
        return [_V(part, None, x.row.axes)]
    if name == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        for side, (x, mine, other) in enumerate(((lhs, lc, rc), (rhs, rc, lc))):
            if x.row is None or x.row.dim not in mine:
                continue
            d = _can_split(x, x.row.dim, mesh_shape)
            if not d:
                continue
            pair = other[list(mine).index(x.row.dim)]
            y = rhs if side == 0 else lhs
            a = _split(x.val, x.row.dim, d)
            b = _split(y.val, pair, d)
            fn = lambda p, q, s=side: _bind(eqn, [p, q] if s == 0 else [q, p])[0]  # noqa: E731
            return [_V(jax.vmap(fn)(a, b), None, x.row.axes)]
        return None
    if name == "scatter-add":
        return _split_scatter_add(eqn, ins, mesh_shape)
    return None


def _split_scatter_add(eqn, ins, mesh_shape):
    operand, indices, updates = ins
    dn = eqn.params["dimension_numbers"]
    if getattr(dn, "operand_batching_dims", ()) or updates.row is None:
        return None
    scatter_dims = [d for d in range(updates.val.ndim) if d not in dn.update_window_dims]
    if updates.row.dim not in scatter_dims:
        return None
    d = _can_split(updates, updates.row.dim, mesh_shape)
    idx_dim = scatter_dims.index(updates.row.dim)  # indices: batch dims in order, vector last
    if (
        not d
        or indices.val.ndim < 2
        or indices.val.shape[idx_dim] != updates.val.shape[updates.row.dim]
    ):
        return None
    zeros = jnp.zeros_like(operand.val)
    part = jax.vmap(lambda i, u: _bind(eqn, [zeros, i, u])[0])(
        _split(indices.val, idx_dim, d), _split(updates.val, updates.row.dim, d)
    )
    return [_V(_add_to_first(part, operand.val), None, updates.row.axes)]


def _add_to_first(part, value):
    """A partial sum plus a non-partial value: the value joins slice 0 (exact)."""
    first = lax.broadcasted_iota(jnp.int32, (part.shape[0],) + (1,) * (part.ndim - 1), 0) == 0
    return part + jnp.where(first, jnp.asarray(value, part.dtype)[None], jnp.zeros((), part.dtype))


# ------------------------------------------------------------------ linear ops on partials


def _apply_partial(eqn, ins):
    """`eqn` applied to partial sums, kept partial when it is linear in them; else None."""
    name = eqn.primitive.name
    parts = [x.partial is not None for x in ins]
    axes = next(x.partial for x in ins if x.partial is not None)
    if any(x.partial not in (None, axes) for x in ins):
        return None

    def vmapped():
        in_axes = [0 if p else None for p in parts]
        fn = lambda *a: _bind(eqn, list(a))  # noqa: E731
        outs = jax.vmap(fn, in_axes=in_axes)(*[x.val for x in ins])
        return [_V(o, None, axes) for o in outs]

    if name in ("add", "sub", "add_any"):
        if all(parts):
            return vmapped()
        p, c = (ins[0], ins[1]) if parts[0] else (ins[1], ins[0])
        if name == "sub" and parts[1]:  # c - p
            neg = jax.vmap(lambda a: -a)(p.val)
            return [_V(_add_to_first(neg, c.val), None, axes)]
        c_val = -c.val if name == "sub" else c.val
        return [_V(_add_to_first(p.val, c_val), None, axes)]
    if name in _ELEMENTWISE_UNARY_LINEAR or name in _SHAPE_LINEAR:
        return vmapped() if parts == [True] + [False] * (len(ins) - 1) else None
    if name == "sharding_constraint":
        # the identity on values (e.g. the transpose of a model's activation/weight constraint):
        # the partials keep their own layout, [D, ...] sharded over the data axes
        return [_V(ins[0].val, None, axes)] if parts == [True] else None
    if name == "convert_element_type":
        src, dst = ins[0].val.dtype, eqn.params["new_dtype"]
        floats = jnp.issubdtype(src, jnp.inexact) and jnp.issubdtype(dst, jnp.inexact)
        return vmapped() if floats else None
    if name in ("mul", "dot_general"):
        return vmapped() if sum(parts) == 1 else None
    if name == "div":
        return vmapped() if parts == [True, False] else None
    if name in ("dynamic_slice", "gather"):
        return vmapped() if parts[0] and not any(parts[1:]) else None
    if name == "concatenate":
        return vmapped() if all(parts) else None
    if name == "select_n":
        return vmapped() if not parts[0] and all(parts[1:]) else None
    if name == "pad":
        zero = isinstance(eqn.invars[1], Literal) and eqn.invars[1].val == 0
        return vmapped() if parts == [True, False] and zero else None
    return None


def defer_step_reductions(jaxpr, in_specs: list, mpmd_mesh):
    """(loop body, per-output partial axes or None) for the step `jaxpr`'s one `treduce`; the
    original body and None when nothing is summed over sharded rows."""
    from jaxpp_integration.compiler.placement import split_at_loop

    before, loop_eqn, _ = split_at_loop(jaxpr)
    p = loop_eqn.params
    body = p["body"]
    mb_rows = seed_rows(jaxpr, in_specs, before, loop_eqn.invars[p["n_consts"] :], p["axis"])
    if not any(mb_rows):
        return body, None
    got = defer_reductions(body, p["n_consts"], mb_rows, p["ops"], dict(mpmd_mesh.jax_mesh.shape))
    if not any(got.partial_axes):
        return body, None
    return got.body, got.partial_axes


def gather_specs(jaxpr, in_specs: list) -> dict:
    """`pipeline_fsdp_ag_once`: for each step input read by the loop whose spec uses an axis that
    also splits the microbatches' rows (fsdp), the spec without those axes (what it is gathered
    to once per step). Tensor-parallel axes stay sharded."""
    from jaxpp_integration.compiler.placement import split_at_loop

    before, loop_eqn, _ = split_at_loop(jaxpr)
    p = loop_eqn.params
    rows = seed_rows(jaxpr, in_specs, before, loop_eqn.invars[p["n_consts"] :], p["axis"])
    row_axes = {a for r in rows if r is not None for a in r.axes}
    spec_of = dict(zip(jaxpr.invars, in_specs))
    out = {}
    for v in loop_eqn.invars[: p["n_consts"]]:
        spec = spec_of.get(v) if _is_var(v) else None
        if spec is None:
            continue
        kept = []
        for entry in tuple(spec):
            names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
            rest = tuple(a for a in names if a not in row_axes)
            kept.append(rest if len(rest) > 1 else (rest[0] if rest else None))
        if kept != list(tuple(spec)):
            out[v] = PartitionSpec(*kept)
    return out


def reduced_specs(jaxpr, in_specs: list, partial_axes: list) -> list:
    """Per loop output kept partial over fsdp-like axes: the spec its once-per-step sum should
    have (a reduce-scatter instead of an all-reduce), taken from the step input it meets first
    in an after-loop equation of the same shape (the weight an optimizer updates with it, or
    its moment); None where no such input uses those axes (left to XLA)."""
    from jaxpp_integration.compiler.placement import split_at_loop

    _, loop_eqn, after = split_at_loop(jaxpr)
    spec_of = {v: sp for v, sp in zip(jaxpr.invars, in_specs) if tuple(sp)}
    out = []
    for v, axes in zip(loop_eqn.outvars, partial_axes):
        found = None
        if axes:
            shape = tuple(v.aval.shape)
            reach = {v}
            for eqn in after:
                if not any(_is_var(i) and i in reach for i in eqn.invars):
                    continue
                partner = [
                    i
                    for i in eqn.invars
                    if _is_var(i) and i in spec_of and tuple(i.aval.shape) == shape
                ]
                if partner:
                    found = spec_of[partner[0]]
                    break
                reach.update(o for o in eqn.outvars if tuple(o.aval.shape) == shape)
        uses = found is not None and any(
            a in axes
            for entry in tuple(found)
            for a in (entry if isinstance(entry, tuple) else (entry,))
        )
        out.append(found if uses else None)
    return out


def _is_var(v) -> bool:
    return isinstance(v, Var) and not isinstance(v, Literal)
