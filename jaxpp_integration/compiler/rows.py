"""Which dimension of a value holds the batch rows, and over which mesh axes they are spread.

A gradient is a sum over the rows of a microbatch; where those rows are split over mesh axes
(data, fsdp, ...) the sum is a cross-device reduction. `seed_rows` finds the row dimension of
each microbatch from the step inputs' specs through the equations before the loop;
`propagate_rows` carries it through one equation (transposes, reshapes, dots, reductions,
elementwise ops, a `shard_map` by its out_specs), None where it is lost. A wrong answer only
costs memory or communication in
the passes that use it (`unreduced.py`, `reduction_plan.py`), never correctness.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpp_integration.compiler.placement import is_var


@dataclasses.dataclass(frozen=True)
class RowDim:
    """Dimension `dim` of a value holds rows spread over mesh `axes` (D = their size product)."""

    dim: int
    axes: tuple


def seed_rows(jaxpr, in_specs: list, before_eqns: list, xs_vars: list, axis: int) -> list:
    """The row dimension of each microbatch (per-microbatch leaf of `xs_vars`), found from the
    step inputs' specs through the equations before the loop; None where unknown."""
    rows: dict = {}
    for v, spec in zip(jaxpr.invars, in_specs):
        r = spec_row(spec)
        if r is not None:
            rows[v] = r
    for eqn in before_eqns:
        ins = [rows.get(v) if is_var(v) else None for v in eqn.invars]
        if not any(ins):
            continue
        for o, r in zip(eqn.outvars, propagate_rows(eqn.primitive.name, eqn.params, eqn, ins)):
            if r is not None:
                rows[o] = r
    out = []
    for v in xs_vars:
        r = rows.get(v) if is_var(v) else None
        if r is None or r.dim == axis:
            out.append(None)
        else:
            out.append(RowDim(r.dim - (r.dim > axis), r.axes))
    return out


def spec_row(spec) -> RowDim | None:
    """The first dimension a PartitionSpec splits, as rows over its axes."""
    for d, entry in enumerate(tuple(spec)):
        if entry:
            return RowDim(d, tuple(entry) if isinstance(entry, tuple) else (entry,))
    return None


def propagate_rows(name, params, eqn, rows) -> list:
    """Row dimension of each output, given those of the inputs (None = unknown)."""
    in_avals = [v.aval for v in eqn.invars]
    out_avals = [v.aval for v in eqn.outvars]
    if name == "shard_map":  # each output is split as its spec says (e.g. a MoE block's
        return [spec_row(spec) for spec in params["out_specs"]]  # per-device weight partials)
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
