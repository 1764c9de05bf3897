"""Moving values between groups of different processes with an XLA collective.

Single process: the runtime copies shards to the target group itself (`jax_compat.copy_shards`).
Multi-controller (`jax.distributed`): the two groups' meshes are stacked along the mpmd axis
into a 2-group mesh, the value becomes row 0 of a `(2, *shape)` global array (the receiver
contributes zeros as row 1), and a compiled `ppermute` 0 → 1 over the mpmd axis moves it — gloo
on CPU, NCCL on GPU. Shards pair by position, so both sides must use the same spec (the engine
guarantees it: a transfer keeps the producer's spec). Both processes issue transfers in program
order, so the collectives match. `stack_rows` (one row per group, zeros where this process holds
nothing) is shared with `reshard.py`.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpp_integration.jax_compat import shard_map


@functools.cache
def _pair(src_mesh: Mesh, dst_mesh: Mesh, axis: str, spec: PartitionSpec):
    axis_index = src_mesh.axis_names.index(axis)
    devices = np.concatenate([src_mesh.devices, dst_mesh.devices], axis=axis_index)
    mesh = Mesh(devices, src_mesh.axis_names)
    pair_spec = PartitionSpec(axis, *spec)
    move = shard_map(
        lambda a: jax.lax.ppermute(a, axis, [(0, 1)]),
        mesh=mesh,
        in_specs=pair_spec,
        out_specs=pair_spec,
    )
    return mesh, NamedSharding(mesh, pair_spec), jax.jit(move)


def cross_process_transfer(
    value, src: NamedSharding, dst: NamedSharding, aval, axis: str, on_issue=None
):
    """Collective send of `value` (None on the receiving process); returns the received array on
    the receiver, None on the sender. `on_issue(array)` gets the collective's result on both
    sides (the hang watchdog waits on it)."""
    mesh, pair_sharding, move = _pair(src.mesh, dst.mesh, axis, src.spec)
    # the sender's devices hold row 0; the receiver contributes zeros for row 1
    stacked = stack_rows((2, *aval.shape), pair_sharding, value, aval.dtype)
    moved = move(stacked)
    if on_issue is not None:
        on_issue(moved)
    if value is not None:
        return None
    dst_devices = dst.device_set
    pieces = [s.data[0] for s in moved.addressable_shards if s.device in dst_devices]
    return jax.make_array_from_single_device_arrays(tuple(aval.shape), dst, pieces)


def stack_rows(shape, sharding: NamedSharding, value, dtype) -> jax.Array:
    """A global `shape` = (rows, *value.shape) array over `sharding` (rows split over the
    pipeline axis), built from this process's devices only: on devices where `value` (a
    `jax.Array` or None) has a shard, that shard as a row; zeros on the others."""
    local = {s.device: s.data for s in value.addressable_shards} if value is not None else {}
    shards = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        if device in local:
            shards.append(local[device][None])
        else:
            block = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))
            shards.append(jax.device_put(np.zeros(block, dtype), device))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)
