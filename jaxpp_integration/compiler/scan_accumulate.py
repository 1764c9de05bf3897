"""Pass (when a loop task becomes a function): a stacked `Add` output is accumulated inside the
`scan` that stacks it, one layer's slice per trip.

A loop task returns its outputs and the engine adds each into its accumulator (`Add.update`:
`acc + value`). When the value is what a `scan` stacks, a per-layer weight gradient of a
scanned stage ([L, ...]: the layer axis first, or [D, L, ...]: the partial sums of
`unreduced.py`, moved there by a transpose), `acc + value` holds the whole stack as a
temporary: every layer's gradient of the stage at once. Here that scan carries the accumulator
instead and each trip adds its own layer's slice into it (`acc[l] += y_l`), so no stack is
made: the task's temporaries do not grow with the layers of a stage (XLA updates the carried
accumulator in place, in the buffer of the donated one).

Exactness: every element receives the same single addition as in `acc + value` (the value
made first, behind an optimization barrier, so XLA cannot fold the addition into the matmul
that makes it), so results are bitwise those of the plain update. Where XLA reduces a
gradient itself (a sum over rows split across devices, `gradient_reduction="microbatch"`),
adding it into the carried accumulator makes that reduction happen per layer inside the loop,
as for a replicated weight.

Only a scan output nothing else reads is accumulated this way (the transpose in between read
by nothing else either); any other `Add` output is added after the task's equations, as before.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from jaxpp_integration.compiler.placement import is_var
from jaxpp_integration.frontend.reductions import Add


@dataclasses.dataclass(frozen=True)
class _Target:
    acc: int  # position among the task's accumulators
    ys: int  # position among the scan's stacked outputs
    layer_dim: int  # the accumulator's dimension the scan's trips run along


def accumulating_function(eqns, invars, outvars, owned, ops):
    """fn(inputs, accumulators, microbatch index) -> [outputs..., updated accumulators...] of
    equations `eqns` that read `invars` and make `outvars` and, per accumulator k, the value
    `owned[k]` reduced into it with `ops[k]`; None when no accumulator can be updated inside a
    scan (the caller then keeps its plain function)."""
    targets, skipped = _targets(eqns, outvars, owned, ops)
    if not targets:
        return None
    by_scan: dict = {}
    for scan_eqn, t in targets:
        by_scan.setdefault(id(scan_eqn), []).append(t)
    done = {t.acc for _, t in targets}

    def fn(ins, accs, index):
        env = dict(zip(invars, ins))
        accs = list(accs)

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        for eqn in eqns:
            if id(eqn) in skipped:
                continue
            vals = [read(v) for v in eqn.invars]
            if id(eqn) in by_scan:
                outs = _scan_into(eqn, vals, by_scan[id(eqn)], accs)
            else:
                outs = _bind(eqn, vals)
            for o, x in zip(eqn.outvars, outs):
                env[o] = x
        updated = [
            a if k in done else op.update(a, read(v), index)
            for k, (a, v, op) in enumerate(zip(accs, owned, ops))
        ]
        return [read(v) for v in outvars] + updated

    return fn


def _targets(eqns, outvars, owned, ops):
    """([(scan equation, _Target)], ids of the equations no longer needed: the transposes
    between a scan and an accumulated value)."""
    made = {}
    reads: dict = {}
    for e in eqns:
        for i, o in enumerate(e.outvars):
            made[o] = (e, i)
        for v in e.invars:
            if is_var(v):
                reads[v] = reads.get(v, 0) + 1
    outside = [v for v in (*outvars, *owned) if is_var(v)]
    for v in outside:
        reads[v] = reads.get(v, 0) + 1
    targets, skipped = [], set()
    for k, (v, op) in enumerate(zip(owned, ops)):
        if not isinstance(op, Add) or not is_var(v) or reads.get(v) != 1 or v not in made:
            continue  # (the one read is the accumulation itself)
        eqn, i = made[v]
        layer_dim, between = 0, None
        if eqn.primitive.name == "transpose" and _moves_first_to_second(eqn):
            u = eqn.invars[0]
            if not is_var(u) or reads.get(u) != 1 or u not in made:
                continue
            between = eqn
            eqn, i = made[u]
            layer_dim = 1
        if eqn.primitive.name != "scan" or i < eqn.params["num_carry"]:
            continue
        if v.aval.shape[layer_dim] != eqn.params["length"]:
            continue
        targets.append((eqn, _Target(k, i - eqn.params["num_carry"], layer_dim)))
        if between is not None:
            skipped.add(id(between))
    return targets, skipped


def _moves_first_to_second(eqn) -> bool:
    """A transpose [L, D, ...] -> [D, L, ...]."""
    perm = tuple(eqn.params["permutation"])
    return perm[:2] == (1, 0) and perm[2:] == tuple(range(2, len(perm)))


def _scan_into(eqn, vals, targets, accs):
    """The `scan` equation `eqn` on `vals`, its stacked outputs named by `targets` added into
    their accumulators (updated in `accs`) trip by trip instead of being stacked. Returns the
    equation's outputs (None in place of those no longer made)."""
    p = eqn.params
    body = p["jaxpr"]
    body_fn = jaxpr_as_fun(body if isinstance(body, ClosedJaxpr) else ClosedJaxpr(body, []))
    nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
    consts, init, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    into = {t.ys: t for t in targets}

    def trip(carry, x):
        c, acc = carry
        index, x_vals = x
        outs = body_fn(*consts, *c, *x_vals)
        ys = outs[nk:]
        acc = [_add_slice(a, ys[t.ys], index, t.layer_dim) for a, t in zip(acc, targets)]
        return (list(outs[:nk]), acc), [y for k, y in enumerate(ys) if k not in into]

    (carry, acc), stacked = lax.scan(
        trip,
        (list(init), [accs[t.acc] for t in targets]),
        (jnp.arange(length, dtype=jnp.int32), list(xs)),
        length=length,
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    for a, t in zip(acc, targets):
        accs[t.acc] = a
    rest = iter(stacked)
    n_ys = len(eqn.outvars) - nk
    return list(carry) + [None if k in into else next(rest) for k in range(n_ys)]


def _add_slice(acc, y, index, dim: int):
    """`acc` with `y` added into its slice `index` along `dim`. `y` passes an optimization
    barrier first: XLA:CPU would otherwise fuse the addition into the matmul that makes `y`
    (starting its sum from the accumulator: other roundings than `acc + value`)."""
    current = lax.dynamic_index_in_dim(acc, index, dim, keepdims=False)
    return lax.dynamic_update_index_in_dim(acc, current + lax.optimization_barrier(y), index, dim)


def _bind(eqn, vals):
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    out = eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]
