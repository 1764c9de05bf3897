"""`mpmd_to_spmd_reshard`: pipelined values (`MpmdArray`s) as global `jax.Array`s on the full mesh.

A pipelined state lives group by group: a stage's weights are a `jax.Array` on one group's
devices. Tools written for SPMD programs (orbax, which refuses to write an array that lives on one
process when several processes run) want one global array per value instead. This module makes
one, spread over every group, without gathering the value anywhere:

- the value's dimension `d` chosen by `spread_spec` (the first one that splits evenly over the
  groups on top of its sharding within a group) is cut into one piece per group: group j keeps
  piece j, so each process stores (and writes) 1/G of it;
- a value with no such dimension (a scalar step counter, an odd shape) is copied whole to every
  group (replicated over the pipeline axis).

The copy is one compiled program per source group over the full mesh: the source group's block is
row `g` of a `(G, ...)` array, and a `ppermute` per target group moves its piece (XLA collectives:
gloo on CPU, NCCL on GPU; a device copy within one process). The other groups' rows are never
read, but an SPMD program needs a block on every device: they are zeros made on those devices
by a compiled program (`dummy_rows`, once per source group and layouts), never host arrays
placed with `device_put` (which copied (G-1)/G of the state from host to device per save).
They still take device memory while the copy runs, as much per device as the source group's
block of the values in flight.
Moving pieces selects values and never adds them, so the result is bitwise the source.
Every process must call it on the same tree in the same order (it is a collective).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_integration.frontend.array import MpmdArray
from jaxpp_integration.frontend.mesh import MpmdMesh
from jaxpp_integration.jax_compat import shard_map


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spread_spec(mesh: MpmdMesh, shape, spec: PartitionSpec) -> tuple[PartitionSpec, int | None]:
    """(spec over the full mesh, dimension split over the groups or None for replicated)."""
    axis, groups = mesh.mpmd_axis_name, mesh.mpmd_dim
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if any(axis in _axes(e) for e in entries):
        raise ValueError(f"spec {spec} already uses the pipeline axis {axis!r}")
    sizes = mesh.jax_mesh.shape
    for d, (n, entry) in enumerate(zip(shape, entries)):
        within = math.prod(sizes[a] for a in _axes(entry))
        if n % (within * groups) == 0:
            entries[d] = (*_axes(entry), axis)  # groups split each within-group block
            return PartitionSpec(*entries), d
    return PartitionSpec(*entries), None


@functools.cache
def _program(mesh: MpmdMesh, source: int, layouts: tuple):
    """Compiled copy of values held by group `source` into their spread layouts.

    `layouts`: one (spec, split dimension or None) per value."""
    axis, groups = mesh.mpmd_axis_name, mesh.mpmd_dim

    def body(*blocks):
        me = jax.lax.axis_index(axis)
        out = []
        for block, (_, d) in zip(blocks, layouts):
            block = block[0]
            if d is None:
                pieces = [block] * groups
            else:
                pieces = jnp.split(block, groups, axis=d)
            mine = pieces[0] if d is None else _select(pieces, me)
            for j in range(groups):
                if j != source:
                    got = jax.lax.ppermute(pieces[j], axis, [(source, j)])
                    mine = jnp.where(me == j, got, mine)
            out.append(mine)
        return tuple(out)

    in_specs = tuple(PartitionSpec(axis, *spec_in) for spec_in in _input_specs(layouts, axis))
    out_specs = tuple(spec for spec, _ in layouts)
    mapped = shard_map(
        body, mesh=mesh.jax_mesh, in_specs=in_specs, out_specs=out_specs, check=False
    )
    return jax.jit(mapped)


def _select(pieces, index):
    """pieces[index] for a traced index, by selection (no arithmetic on the values)."""
    out = pieces[0]
    for j, piece in enumerate(pieces[1:], start=1):
        out = jnp.where(index == j, piece, out)
    return out


def _input_specs(layouts, axis):
    """The within-group spec of each value (its spread spec without the pipeline axis)."""
    specs = []
    for spec, _ in layouts:
        entries = []
        for e in spec:
            rest = tuple(a for a in _axes(e) if a != axis)
            entries.append(None if not rest else rest[0] if len(rest) == 1 else rest)
        specs.append(entries)
    return specs


def mpmd_to_spmd_reshard(tree):
    """`tree` with every `MpmdArray` leaf replaced by a global `jax.Array` on the full mesh, laid
    out by `spread_spec` and copied from the first group holding it. Other leaves pass through."""
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    by_source: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, MpmdArray):
            by_source.setdefault((x.mpmd_mesh, x.mpmd_idxs[0]), []).append(i)
    for (mesh, source), idx in by_source.items():
        layouts = tuple(spread_spec(mesh, leaves[i].shape, leaves[i].spec) for i in idx)
        program = _program(mesh, source, layouts)
        specs = tuple(PartitionSpec(*s) for s in _input_specs(layouts, mesh.mpmd_axis_name))
        entries = tuple((leaves[i].shape, np.dtype(leaves[i].dtype), s) for i, s in zip(idx, specs))
        dummies = dummy_rows(mesh, source, entries)
        stacked = [
            stack_rows(mesh, leaves[i].shape, leaves[i].arrays.get(source), spec, rows)
            for i, spec, rows in zip(idx, specs, dummies)
        ]
        del dummies
        for i, y in zip(idx, program(*stacked)):
            out[i] = y
    return jax.tree.unflatten(treedef, out)


def _local_others(mesh: MpmdMesh, source: int) -> tuple[int, ...]:
    """The groups other than `source` whose devices are this process's."""
    me = jax.process_index()
    return tuple(
        g
        for g in range(mesh.mpmd_dim)
        if g != source and all(d.process_index == me for d in mesh.devices_of(g))
    )


@functools.cache
def _dummy_program(mesh: MpmdMesh, groups: tuple, entries: tuple):
    """Compiled program making, on the devices of `groups` (this process's), the zero rows of
    every entry (shape, dtype, spec within a group): one (len(groups), *shape) array per entry
    split over the groups, so each device gets exactly its block of one row."""
    sub = mesh.submesh(groups)
    axis = mesh.mpmd_axis_name
    shardings = tuple(NamedSharding(sub, PartitionSpec(axis, *spec)) for _, _, spec in entries)

    def rows():
        return tuple(jnp.zeros((len(groups), *shape), dtype) for shape, dtype, _ in entries)

    return jax.jit(rows, out_shardings=shardings).lower().compile()


def dummy_rows(mesh: MpmdMesh, source: int, entries: tuple) -> list[dict]:
    """Per entry, {device: zero block} on this process's devices of the groups other than
    `source`: the rows of the (G, ...) input the copy program never reads, made on the devices
    (one compiled program per source and layouts, kept), never placed from the host."""
    groups = _local_others(mesh, source)
    if not groups:
        return [{} for _ in entries]
    made = _dummy_program(mesh, groups, entries)()
    return [{s.device: s.data for s in a.addressable_shards} for a in made]


def stack_rows(mesh: MpmdMesh, shape, value, spec: PartitionSpec, rows: dict) -> jax.Array:
    """The global (G, *shape) input of the copy program over the full mesh, from this process's
    devices only: on devices where `value` (the source group's `jax.Array`, or None on a process
    without it) has a shard, that shard as a row; on the others, the block `rows` holds for
    them (`dummy_rows`)."""
    local = {} if value is None else {s.device: s.data[None] for s in value.addressable_shards}
    sharding = NamedSharding(mesh.jax_mesh, PartitionSpec(mesh.mpmd_axis_name, *spec))
    full = (mesh.mpmd_dim, *shape)
    shards = [
        local[d] if d in local else rows[d] for d in sharding.addressable_devices_indices_map(full)
    ]
    return jax.make_array_from_single_device_arrays(full, sharding, shards)
