"""Pass: how the loop's sums over batch rows are reduced, per mesh axis (`gradient_reduction`).

A gradient (or loss sum, token count) is a sum over the rows of a microbatch, and the rows are
split over the batch axes of a group (`data`, `fsdp`; `dcn_*` axes share those names). Modes:

- `"step"`: every such sum is deferred (`unreduced.py`) and reduced once per stage per step
  after the loop (`reduce_r` tasks). Over an axis the weight is sharded on (fsdp) each device
  then holds a full-size partial sum: the weight's full size, not its shard.
- `"microbatch"`: nothing is deferred; XLA reduces in every task instance (bitwise `jax.jit`).
- `"auto"` (default), per axis and per gradient: over the axes its weight is replicated on
  (data) the sum is deferred as with `"step"`, which costs no memory (the device holds the
  full gradient either way). Over the axes its weight is sharded on (fsdp) the microbatch's sum
  is reduce-scattered into the shard right where it is made, every microbatch (an explicit
  `psum_scatter` in a `shard_map`, so it is a reduce-scatter on every backend), and the
  accumulator holds one shard per device — the HSDP pattern — unless full-size partials fit.
  Only axes the gradient really is a sum over count: an expert weight sharded over `expert`
  has a whole gradient on its device (its rows arrived by all-to-all inside the MoE block), so
  over `expert` it is neither reduced nor scattered, while weights replicated over `expert`
  (attention, router, norms, embeddings) are deferred over it like over `data`; its partial
  over `data` keeps the expert split ([D, ..., E / ep, ...] per device, not every expert).
  Inside a scanned stage "where it is made" is the backward layer scan's body: each layer's
  gradient is reduce-scattered on its own (`Finish.per_layer`), so a stage holds one layer's
  full-size gradient at a time, never its whole stack.
  Full-size partials fit when what deferring needs per device — the step's inputs (parameters,
  optimizer state, batch), the full-size partials, and the temporaries deferring creates: the
  once-per-step reduction's full-size sum and one layer's full-size partials in the backward
  (a whole output's for a gradient no scan stacks) — averaged over the groups, takes at most
  `AUTO_MEMORY_FRACTION` of the device memory (the rest is left to activations and the other
  temporaries). The memory is `AutoReduction.device_memory_bytes`, else the devices'
  `bytes_limit`; XLA:CPU reports none, and then the scatter is chosen. The estimate reads
  shapes and specs only: no compile.

Also the layouts around the loop: `reduce_specs` (each deferred sum leaves `reduce_r` laid out
like its weight) and `gather_specs` (`pipeline_fsdp_ag_once`: what each fsdp weight is gathered
to once per step).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr
from jax.sharding import PartitionSpec

from jaxpp_integration.compiler.placement import is_var, split_at_loop
from jaxpp_integration.compiler.rows import seed_rows
from jaxpp_integration.compiler.unreduced import Finish, defer_reductions, stacking_scan
from jaxpp_integration.frontend.reductions import Add

GRADIENT_REDUCTIONS = ("auto", "step", "microbatch")
# "auto" keeps full-size partials over sharded axes when the state and the partials take at
# most this fraction of a device's memory
AUTO_MEMORY_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class AutoReduction:
    """`gradient_reduction="auto"` deciding against `device_memory_bytes` (per device) instead of
    the devices' own figure (e.g. a planner compiling for an H100 on a CPU host)."""

    device_memory_bytes: float | None = None


@dataclasses.dataclass(frozen=True)
class ReductionChoice:
    """What a compiled step does with its sums over rows (`compiled.reduction_choice`)."""

    mode: str  # "auto" | "step" | "microbatch"
    deferred_axes: tuple = ()  # reduced once per stage per step (`reduce_r`)
    scattered_axes: tuple = ()  # reduce-scattered into the weight's shard every microbatch
    state_bytes: float = 0.0  # step inputs per device, averaged over the groups
    full_partial_bytes: float = 0.0  # full-size partials over sharded axes, per device likewise
    temp_bytes: float = 0.0  # temporaries deferring over sharded axes creates, likewise
    memory_bytes: float | None = None  # per device, what "auto" decided against

    def describe(self) -> str:
        """One line for the log."""
        head = f"gradient_reduction={self.mode}"
        if self.mode == "microbatch":
            return f"{head}: sums over batch rows reduced in every task instance"
        if not self.deferred_axes and not self.scattered_axes:
            return f"{head}: no sum over rows split across devices"
        parts = []
        if self.deferred_axes:
            parts.append(f"over {'+'.join(self.deferred_axes)} deferred to once per step")
        if self.scattered_axes:
            parts.append(
                f"over {'+'.join(self.scattered_axes)} reduce-scattered into the shard every "
                "microbatch"
            )
        line = f"{head}: sums {'; '.join(parts)}"
        if self.mode != "auto" or not self.full_partial_bytes:
            return line
        need = (
            f"{_gb(self.state_bytes)} state + {_gb(self.full_partial_bytes)} full-size partials "
            f"+ {_gb(self.temp_bytes)} temporaries"
        )
        if self.memory_bytes is None:
            return f"{line} (device memory unknown; deferring would need {need} per device)"
        budget = f"{AUTO_MEMORY_FRACTION:g} x {_gb(self.memory_bytes)}"
        fits = not self.scattered_axes
        return f"{line} ({need} per device {'<=' if fits else '>'} {budget})"


@dataclasses.dataclass
class ReductionPlan:
    """The loop body to partition, and per body output: `deferred[j]` (None: reduced as made;
    a tuple of axes: a full-size partial [D, ...] over them; a PartitionSpec: the whole layout
    of a partial scattered over fsdp, [D_data, *shard]) and `reduce_specs[j]` (the layout its
    once-per-step sum leaves `reduce_r` with; None: XLA's choice)."""

    body: ClosedJaxpr
    deferred: list | None
    reduce_specs: list | None
    choice: ReductionChoice


def check_mode(mode) -> None:
    if not isinstance(mode, AutoReduction) and mode not in GRADIENT_REDUCTIONS:
        raise ValueError(
            f"gradient_reduction={mode!r} is not one of {', '.join(GRADIENT_REDUCTIONS)} "
            "(or jaxpp.AutoReduction(device_memory_bytes=...))"
        )


def plan_reductions(jaxpr, in_specs: list, mpmd_mesh, mode) -> ReductionPlan:
    """The `ReductionPlan` of the step `jaxpr`'s one `treduce` under `mode`."""
    before, loop_eqn, _ = split_at_loop(jaxpr)
    p = loop_eqn.params
    body = p["body"]
    name = "auto" if isinstance(mode, AutoReduction) else mode
    if name == "microbatch":
        return ReductionPlan(body, None, None, ReductionChoice(name))
    mb_rows = seed_rows(jaxpr, in_specs, before, loop_eqn.invars[p["n_consts"] :], p["axis"])
    mesh_shape = dict(mpmd_mesh.jax_mesh.shape)
    row_axes = tuple(  # axes of size 1 split nothing
        dict.fromkeys(a for r in mb_rows if r is not None for a in r.axes if mesh_shape[a] > 1)
    )
    if not row_axes:
        return ReductionPlan(body, None, None, ReductionChoice(name))
    partners = _partner_specs(jaxpr, in_specs)
    sharded = [
        tuple(a for a in row_axes if spec is not None and a in _names_of(spec))
        if isinstance(op, Add)
        else ()
        for spec, op in zip(partners, p["ops"])
    ]
    choice = ReductionChoice(name, deferred_axes=row_axes)
    finish = {}
    got = None
    if name == "auto" and any(sharded):
        # a weight sharded over an axis that splits rows is not always summed over it: an
        # expert weight's gradient is whole on its device (the rows came to it by all-to-all)
        got = defer_reductions(body, p["n_consts"], mb_rows, p["ops"], mesh_shape)
        sharded = [
            tuple(a for a in axes if a in (partial or ()))
            for axes, partial in zip(sharded, got.partial_axes)
        ]
    if name == "auto" and any(sharded):
        memory = mode.device_memory_bytes if isinstance(mode, AutoReduction) else None
        memory = memory or device_memory_bytes(mpmd_mesh)
        state, full, temp = _estimate(jaxpr, in_specs, loop_eqn, partners, sharded, mpmd_mesh)
        fits = memory is not None and state + full + temp <= AUTO_MEMORY_FRACTION * memory
        scattered = () if fits else tuple(dict.fromkeys(a for s in sharded for a in s))
        kept = tuple(a for a in row_axes if a not in scattered)
        choice = ReductionChoice(name, kept, scattered, state, full, temp, memory)
        if not fits:
            lowering = mpmd_mesh.lowering_mesh()
            finish = {
                j: _scatter(partners[j], axes, lowering, mesh_shape)
                for j, axes in enumerate(sharded)
                if axes
            }
    if got is None or finish:
        got = defer_reductions(body, p["n_consts"], mb_rows, p["ops"], mesh_shape, finish)
    if not any(got.partial_axes) and not finish:
        return ReductionPlan(body, None, None, dataclasses.replace(choice, deferred_axes=()))
    deferred, reduce_specs = [], []
    for j, axes in enumerate(got.partial_axes):
        if j in finish and axes is not None:  # partial over data, scattered over fsdp
            inner = _entries(partners[j], len(got.body.out_avals[j].shape) - 1)
            deferred.append(PartitionSpec(axes, *inner))
            reduce_specs.append(partners[j])
        elif axes and _split_rows(partners[j], axes, row_axes):
            # a weight split over an axis that splits rows but is not summed over it (an expert
            # weight over `expert`): its partial keeps that split, [D, ..., E / ep, ...]
            ndim = len(got.body.out_avals[j].shape) - 1
            inner = [_only(e, set(row_axes) - set(axes)) for e in _entries(partners[j], ndim)]
            deferred.append(PartitionSpec(axes, *inner))
            reduce_specs.append(partners[j])
        else:
            deferred.append(axes)
            uses = axes and partners[j] is not None and set(axes) & _names_of(partners[j])
            reduce_specs.append(partners[j] if uses else None)
    if not any(got.partial_axes):
        choice = dataclasses.replace(choice, deferred_axes=())
    return ReductionPlan(got.body, deferred, reduce_specs, choice)


# ------------------------------------------------------------------ the scatter


def _scatter(spec: PartitionSpec, sharded: tuple, mesh, mesh_shape) -> Finish:
    """The reduce-scatter over `sharded` into `spec`'s layout, for the whole output and, when
    its leading (layer) dimension is not split over those axes, for one layer's slice."""
    entries = tuple(spec)
    per_layer = None
    if not (entries and _names(entries[0]) & set(sharded)):
        per_layer = _scatter_fn(PartitionSpec(*entries[1:]), sharded, mesh, mesh_shape)
    return Finish(_scatter_fn(spec, sharded, mesh, mesh_shape), per_layer)


def _scatter_fn(spec: PartitionSpec, sharded: tuple, mesh, mesh_shape):
    """fn(partial [D, *shape] over axes) -> (the sum over `sharded` scattered into `spec`'s
    layout, [D_rest, *shape] over the remaining axes, or [*shape] when none remain)."""

    def fn(val, axes):
        f_axes = tuple(a for a in axes if a in sharded)
        rest = tuple(a for a in axes if a not in sharded)
        if not f_axes:
            return val, axes
        shape = val.shape[1:]
        entries = _entries(spec, len(shape))
        dims = [k for k, e in enumerate(entries) if _names(e) & set(f_axes)]
        if len(dims) == 1 and _names(entries[dims[0]]) == set(f_axes):
            k = dims[0]
            order = tuple(a for a in _ordered(entries[k]) if a in f_axes)
            in_entries = [None if i == k else e for i, e in enumerate(entries)]

            def local(x):  # this device's [1, *local shape] slice of the partials
                y = lax.psum_scatter(x[0], order, scatter_dimension=k, tiled=True)
                return y[None] if rest else y

            out_spec = PartitionSpec(rest, *entries) if rest else PartitionSpec(*entries)
            out = jax.shard_map(
                local,
                mesh=mesh,
                in_specs=PartitionSpec(axes, *in_entries),
                out_specs=out_spec,
            )(val)
            return out, (rest or None)
        # the fsdp axes share a dimension with others: sum the slices, XLA lays the result out
        sizes = [mesh_shape[a] for a in axes]
        split = val.reshape(*sizes, *shape)
        summed = jnp.sum(split, axis=tuple(i for i, a in enumerate(axes) if a in f_axes))
        summed = summed.reshape(-1, *shape) if rest else summed.reshape(shape)
        out_spec = PartitionSpec(rest, *entries) if rest else PartitionSpec(*entries)
        return lax.with_sharding_constraint(summed, out_spec), (rest or None)

    return fn


# ------------------------------------------------------------------ the estimate


def device_memory_bytes(mpmd_mesh) -> float | None:
    """The smallest `bytes_limit` of this process's devices in the mesh; None when a device
    reports none (XLA:CPU)."""
    me = jax.process_index()
    limits = []
    for d in mpmd_mesh.jax_mesh.devices.flat:
        if d.process_index != me:
            continue
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(float(stats["bytes_limit"]))
    return min(limits) if limits else None


def _estimate(jaxpr, in_specs, loop_eqn, partners, sharded, mpmd_mesh):
    """(step inputs, full-size partials over sharded axes, the temporaries deferring them
    creates) in bytes per device, averaged over the groups. The temporaries: the reduction
    after the loop makes each stage's full-size sum once (as large as its partials), and the
    backward makes one layer's full-size partials at a time for a gradient a layer scan stacks
    (its whole partial for any other)."""
    mesh_shape = dict(mpmd_mesh.jax_mesh.shape)
    groups = mpmd_mesh.mpmd_dim
    body = loop_eqn.params["body"].jaxpr
    row_axes = {a for s in sharded for a in s}
    state = sum(_bytes(v.aval, spec, mesh_shape) for v, spec in zip(jaxpr.invars, in_specs))
    full = layer = 0.0
    for j, v in enumerate(loop_eqn.outvars):
        if not sharded[j]:
            continue
        nbytes = _bytes(v.aval, partners[j], mesh_shape, skip=row_axes)
        full += nbytes
        scan = stacking_scan(body, body.outvars[j]) if is_var(body.outvars[j]) else None
        layer += nbytes / scan[0].params["length"] if scan is not None else nbytes
    return state / groups, full / groups, (full + layer) / groups


def _bytes(aval, spec, mesh_shape, skip=()) -> float:
    shards = math.prod(mesh_shape[a] for a in _names_of(spec) if a not in skip) if spec else 1
    return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize / shards


# ------------------------------------------------------------------ specs


def _names(entry) -> set:
    return set(_ordered(entry))


def _ordered(entry) -> tuple:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _split_rows(spec, partial: tuple, row_axes: tuple) -> bool:
    """`spec` splits a dimension over an axis that splits rows without being summed over."""
    return spec is not None and bool(_names_of(spec) & (set(row_axes) - set(partial)))


def _only(entry, axes: set):
    """A spec entry keeping only `axes`."""
    kept = tuple(a for a in _ordered(entry) if a in axes)
    return kept if len(kept) > 1 else (kept[0] if kept else None)


def _names_of(spec) -> set:
    return {a for entry in tuple(spec) for a in _ordered(entry)}


def _entries(spec, ndim: int) -> list:
    entries = list(tuple(spec)) if spec is not None else []
    return entries + [None] * (ndim - len(entries))


def _partner_specs(jaxpr, in_specs: list) -> list:
    """Per loop output: the spec of the step input it meets first in an after-loop equation of
    the same shape (the weight an optimizer updates with it, or its moment); None if none."""
    _, loop_eqn, after = split_at_loop(jaxpr)
    spec_of = {v: sp for v, sp in zip(jaxpr.invars, in_specs) if tuple(sp)}
    out = []
    for v in loop_eqn.outvars:
        found = None
        shape = tuple(v.aval.shape)
        reach = {v}
        for eqn in after:
            if not any(is_var(i) and i in reach for i in eqn.invars):
                continue
            partner = [
                i for i in eqn.invars if is_var(i) and i in spec_of and tuple(i.aval.shape) == shape
            ]
            if partner:
                found = spec_of[partner[0]]
                break
            reach.update(o for o in eqn.outvars if tuple(o.aval.shape) == shape)
        out.append(found)
    return out


def gather_specs(jaxpr, in_specs: list) -> dict:
    """`pipeline_fsdp_ag_once`: for each step input read by the loop whose spec uses an axis that
    also splits the microbatches' rows (fsdp), the spec without those axes (what it is gathered
    to once per step). Tensor-parallel axes stay sharded."""
    before, loop_eqn, _ = split_at_loop(jaxpr)
    p = loop_eqn.params
    rows = seed_rows(jaxpr, in_specs, before, loop_eqn.invars[p["n_consts"] :], p["axis"])
    row_axes = {a for r in rows if r is not None for a in r.axes}
    spec_of = dict(zip(jaxpr.invars, in_specs))
    out = {}
    for v in loop_eqn.invars[: p["n_consts"]]:
        spec = spec_of.get(v) if is_var(v) else None
        if spec is None:
            continue
        kept = []
        for entry in tuple(spec):
            rest = tuple(a for a in _ordered(entry) if a not in row_axes)
            kept.append(rest if len(rest) > 1 else (rest[0] if rest else None))
        if kept != list(tuple(spec)):
            out[v] = PartitionSpec(*kept)
    return out


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"
