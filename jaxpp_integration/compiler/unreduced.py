"""Pass (option `gradient_reduction="step"` or `"auto"`): keep the loop's `Add` outputs unreduced.

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
differentiation only evaluate) are inlined so gradients computed inside them can be deferred.
`scan` bodies (a scanned layer stack, forward and backward) are evaluated the same way inside a
new `scan`: a per-layer weight gradient leaves the backward scan as a partial sum per trip, a
gradient carried across trips is carried partial, so nothing deferred is reduced inside the
loop (`_scan`). `while`/`cond` bodies are left alone (their outputs are reduced where made).
A `shard_map` runs as is; its outputs' rows are read off its out_specs, so a sum outside it over
a dimension its devices split (a MoE block's per-device weight-gradient partials,
`MaxText/model/moe.py`) is deferred like any other.

`finish` hooks (`Finish`) let the caller transform an output right where it is made
(`reduction_plan`: the per-microbatch reduce-scatter over fsdp of `gradient_reduction="auto"`);
for an output a scan stacks (a layer stack's weight gradient), "where it is made" is the scan's
body: the hook's `per_layer` form runs there on each trip's slice, so one layer's full-size
partial exists at a time, never the stack. Which dimension holds the rows: `rows.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal, Var

from jaxpp_integration.compiler.placement import is_var
from jaxpp_integration.compiler.rows import RowDim, propagate_rows
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


@dataclasses.dataclass
class _V:
    val: object
    row: RowDim | None = None
    partial: tuple | None = None  # data axes of a partial sum stored as [D, *shape]


@dataclasses.dataclass(frozen=True)
class Finish:
    """What to do with a partial output right where it is made (see `defer_reductions`):
    `whole(value [D, *shape], axes) -> (value, axes or None)` on the output as made;
    `per_layer`, the same for one trip's slice [D, *shape[1:]] of an output a `scan` stacks
    (a per-layer weight gradient), applied inside the scan's body, so that only one slice at a
    time exists in its [D, ...] form; None: `whole` only."""

    whole: Callable
    per_layer: Callable | None = None


@dataclasses.dataclass
class Deferred:
    """The rewritten body and, per body output, the axes it stays unreduced over (or None)."""

    body: ClosedJaxpr
    partial_axes: list


def defer_reductions(
    body: ClosedJaxpr, n_consts: int, mb_rows: list, ops, mesh_shape, finish=None
) -> Deferred:
    """Rewrites `body` (invars = consts, microbatch leaves) so that `Add` outputs summed over
    rows are per-device partial sums [D, *shape]. `mesh_shape` maps axis name -> size.

    `finish` ({output index: `Finish`}) transforms a partial output right where it is made
    (in the same stage as its last contribution), e.g. a reduce-scatter over some of the axes
    every microbatch; an output stacked by a `scan` (directly, or through inlined calls) and
    read by nothing else gets `per_layer` applied inside that scan's body, once per trip."""
    jaxpr = body.jaxpr
    region = _regions(jaxpr)
    users = _user_regions(jaxpr, region)
    finish = finish or {}
    finish_at: dict = {}
    for j, v in enumerate(jaxpr.outvars):
        if j in finish and is_var(v):
            finish_at.setdefault(v, []).append(j)
    per_trip = _per_trip_finish(jaxpr, finish)

    def run(*args):
        env: dict = {}
        finals: dict = {}

        def on_output(o, x):
            for j in finish_at.get(o, ()):
                if x.partial is not None:
                    val, axes = finish[j].whole(x.val, x.partial)
                    finals[j] = _V(val, None, axes)

        for i, (v, a) in enumerate(zip(jaxpr.invars, args)):
            row = mb_rows[i - n_consts] if i >= n_consts else None
            env[v] = _V(a, row)
        for v, c in zip(jaxpr.constvars, body.consts):
            env[v] = _V(c)
        _eval_eqns(
            jaxpr.eqns,
            env,
            _Ctx(mesh_shape, per_trip),
            region,
            users,
            on_output if finish_at else None,
        )
        result = []
        for j, (v, op) in enumerate(zip(jaxpr.outvars, ops)):
            x = finals.get(j) or (_read(env, v) if not isinstance(v, Literal) else _V(v.val))
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


@dataclasses.dataclass(frozen=True)
class _Ctx:
    mesh_shape: dict  # axis name -> size
    per_trip: dict  # id(scan equation) -> {ys position: fn applied to each trip's slice}


def _per_trip_finish(jaxpr, finish: dict) -> dict:
    """`_Ctx.per_trip` for the outputs of `finish` that a scan stacks and nothing else reads."""
    out: dict = {}
    reads: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if is_var(v):
                reads[v] = reads.get(v, 0) + 1
    for j, f in finish.items():
        v = jaxpr.outvars[j]
        if f.per_layer is None or not is_var(v) or reads.get(v) or jaxpr.outvars.count(v) > 1:
            continue
        found = stacking_scan(jaxpr, v)
        if found is not None:
            out.setdefault(id(found[0]), {})[found[1]] = f.per_layer
    return out


def stacking_scan(jaxpr, v):
    """(scan equation, ys position) of the scan whose stacked output `v` is, looking into
    inlined calls (whose output nothing else reads); None if another equation makes it."""
    for eqn in jaxpr.eqns:
        if v not in eqn.outvars:
            continue
        k = eqn.outvars.index(v)
        name = eqn.primitive.name
        if name == "scan":
            nk = eqn.params["num_carry"]
            return (eqn, k - nk) if k >= nk else None
        if name in _INLINE and _INLINE[name] in eqn.params:
            sub = eqn.params[_INLINE[name]]
            inner = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
            w = inner.outvars[k]
            inner_reads = sum(1 for e in inner.eqns for u in e.invars if u is w)
            if is_var(w) and not inner_reads and inner.outvars.count(w) == 1:
                return stacking_scan(inner, w)
        return None
    return None


def _eval_eqns(eqns, env, ctx: _Ctx, region=None, users=None, on_output=None):
    mesh_shape = ctx.mesh_shape
    for eqn in eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        with eqn_source_context(eqn):
            if name in _INLINE and _INLINE[name] in eqn.params:
                outs = _inline(eqn, ins, ctx)
            elif name == "scan":
                outs = _scan(eqn, ins, ctx)
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
            if on_output is not None:
                on_output(o, x)


def _inline(eqn, ins, ctx: _Ctx):
    sub = eqn.params[_INLINE[eqn.primitive.name]]
    closed = sub if isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, [])
    inner = closed.jaxpr
    env: dict = {}
    for v, x in zip(inner.invars, ins):
        env[v] = x
    for v, c in zip(inner.constvars, closed.consts):
        env[v] = _V(c)
    _eval_eqns(inner.eqns, env, ctx)
    return [_read(env, v) for v in inner.outvars]


# ------------------------------------------------------------------ scans


def _scan_body(closed, n_consts: int, flags: list, consts: list, carry: list, xs: list, ctx):
    """The scan body evaluated on `_V`s (partial carries per `flags`): its outputs as `_V`s."""
    inner = closed.jaxpr
    env: dict = {}
    for v, c in zip(inner.constvars, closed.consts):
        env[v] = _V(c)
    k = n_consts + len(carry)
    for i, v in enumerate(inner.invars):
        if i < n_consts:
            env[v] = consts[i]
        elif i < k:
            env[v] = carry[i - n_consts]
        else:
            env[v] = xs[i - k]
    _eval_eqns(inner.eqns, env, ctx)
    return [_read(env, v) for v in inner.outvars]


def _scan(eqn, ins, ctx: _Ctx):
    """A `scan` (a scanned layer stack, forward or backward) whose body sums over rows: the body
    is evaluated like the loop body, so a per-layer weight gradient comes out of the backward
    scan as a partial sum [D, ...] per trip, stacked [L, D, ...] and returned as [D, L, ...]
    (a transpose, local to each device). A carry that comes out partial (a gradient summed over
    trips) is carried partial from the start; inputs that are partial sums are read per trip
    as such. No communication inside the loop for what is deferred, except what
    `ctx.per_trip` asks for this scan's outputs (e.g. each layer's gradient reduce-scattered
    over fsdp inside the body: one layer's full-size gradient at a time)."""
    mesh_shape = ctx.mesh_shape
    p = eqn.params
    closed, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
    if not any(x.row is not None or x.partial is not None for x in ins):
        return _apply(eqn, ins, mesh_shape)
    consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
    x_rows = [
        RowDim(x.row.dim - 1, x.row.axes) if x.row is not None and x.row.dim > 0 else None
        for x in xs
    ]

    def inner_xs(vals):
        return [_V(v, r, x.partial) for v, r, x in zip(vals, x_rows, xs)]

    def inner_carry(vals, flags):
        return [_V(v, None if f else x.row, f) for v, x, f in zip(vals, init, flags)]

    def x_slice_aval(x):  # one trip's slice ([D, ...] for a partial stacked as [D, L, ...])
        shape = x.val.shape[1:] if x.partial is None else (x.val.shape[0], *x.val.shape[2:])
        return jax.ShapeDtypeStruct(shape, x.val.dtype)

    def carry_aval(x, flag):
        shape = tuple(x.val.shape)
        if flag and x.partial is None:
            shape = (_size(mesh_shape, flag), *shape)
        return jax.ShapeDtypeStruct(shape, x.val.dtype)

    # which carries are partial: those the body makes partial, until nothing changes
    flags = [x.partial for x in init]
    for _ in range(nk + 1):
        probe: list = []

        def probe_body(c_vals, c_carry, c_xs, flags=flags, probe=probe):
            outs = _scan_body(
                closed,
                nc,
                flags,
                [_V(v, x.row, x.partial) for v, x in zip(c_vals, consts)],
                inner_carry(c_carry, flags),
                inner_xs(c_xs),
                ctx,
            )
            probe[:] = outs
            return [o.val for o in outs]

        jax.make_jaxpr(probe_body)(
            [jax.ShapeDtypeStruct(x.val.shape, x.val.dtype) for x in consts],
            [carry_aval(x, f) for x, f in zip(init, flags)],
            [x_slice_aval(x) for x in xs],
        )
        out_flags = [o.partial for o in probe[:nk]]
        merged = [f or o for f, o in zip(flags, out_flags)]
        if any(f and o and f != o for f, o in zip(flags, out_flags)):
            return _apply(eqn, [_materialize(x) for x in ins], mesh_shape)
        if merged == flags:
            break
        flags = merged
    else:  # pragma: no cover - each round adds a carry, so nk + 1 rounds always settle
        return _apply(eqn, [_materialize(x) for x in ins], mesh_shape)
    out_rows = [o.row for o in probe]
    y_partial = [o.partial for o in probe[nk:]]
    if not any(flags) and not any(y_partial) and not any(x.partial for x in ins):
        # nothing deferred inside: the equation as it was, with the rows the body gives
        outs = _bind(eqn, [x.val for x in ins])
        rows = out_rows[:nk] + [
            RowDim(r.dim + 1, r.axes) if r is not None else None for r in out_rows[nk:]
        ]
        return [_V(o, r) for o, r in zip(outs, rows)]

    per_trip = ctx.per_trip.get(id(eqn), {})
    y_axes = list(y_partial)  # what each stacked output is partial over after `per_trip`

    def body(carry, x_vals):
        outs = _scan_body(
            closed, nc, flags, consts, inner_carry(carry, flags), inner_xs(x_vals), ctx
        )
        new_carry = [
            _as_partial(o, f, mesh_shape).val if f else o.val for o, f in zip(outs[:nk], flags)
        ]
        ys = []
        for k, o in enumerate(outs[nk:]):
            if k in per_trip and o.partial:
                val, y_axes[k] = per_trip[k](o.val, o.partial)
                ys.append(val)
            else:
                ys.append(o.val)
        return new_carry, ys

    init_vals = [_as_partial(x, f, mesh_shape).val if f else x.val for x, f in zip(init, flags)]
    xs_vals = [x.val if x.partial is None else jnp.moveaxis(x.val, 0, 1) for x in xs]
    carry_out, ys = lax.scan(
        body,
        init_vals,
        xs_vals,
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    out = [_V(v, None if f else r, f) for v, f, r in zip(carry_out, flags, out_rows[:nk])]
    for y, part, r in zip(ys, y_axes, out_rows[nk:]):
        if part:
            out.append(_V(jnp.moveaxis(y, 1, 0), None, part))
        else:
            out.append(_V(y, RowDim(r.dim + 1, r.axes) if r is not None else None))
    return out


def _as_partial(x: _V, axes, mesh_shape) -> _V:
    """`x` as a partial sum over `axes`: itself if it is one, else its value in slice 0."""
    if x.partial is not None:
        return x
    zeros = jnp.zeros((_size(mesh_shape, axes), *x.val.shape), x.val.dtype)
    return _V(_add_to_first(zeros, x.val), None, axes)


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
    rows = propagate_rows(name, eqn.params, eqn, [x.row for x in ins])
    return [_V(o, r) for o, r in zip(outs, rows)]


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
