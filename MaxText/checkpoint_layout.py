"""How checkpointed state leaves map between a training layout and the canonical on-disk tree.

Save: `saveable(leaves)` gives orbax one global array per leaf (pipelined `MpmdArray`s are written
from the first group holding them, never gathered). Restore: `restore_shardings(indices)` tells
orbax where to read each leaf, and `place(leaves, indices)` turns what it read into what the step
takes (SPMD: the step's shardings; pipelined: one `MpmdArray` over the groups that read it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding


class _SpmdPlacement:
    """SPMD: leaves are global `jax.Array`s; restore onto the step's input shardings."""

    def __init__(self, shardings: Any):
        self._shardings = jax.tree.leaves(shardings)

    def saveable(self, leaves: list) -> list:
        return leaves

    def restore_shardings(self, indices: Sequence[int]) -> list:
        return [self._shardings[i] for i in indices]

    def place(self, leaves: list, indices: Sequence[int]) -> list:
        return leaves


class _MpmdPlacement:
    """Pipelined: leaf i lives on the groups whose compiled tasks read state input i.

    Save: an `MpmdArray` is written from the first group holding it (that group's `jax.Array`, on
    that group's devices). Under several processes a process that does not hold that group passes
    an array with no local shards, so only the holder writes.
    Restore: leaf i is read once onto the devices of all its groups (replicated across groups,
    sharded within each by its PartitionSpec), then split into one `jax.Array` per group without
    copying, and wrapped as the `MpmdArray` the step takes without any transfer.
    """

    def __init__(self, trainer: Any, num_leaves: int):
        import jaxpp_integration as jaxpp

        self._MpmdArray = jaxpp.MpmdArray
        self.mesh = trainer.mpmd_mesh
        fallback = jax.tree.leaves(trainer.state_specs, is_leaf=_is_spec)
        self.groups: list[tuple[int, ...]] = []
        self.specs: list = []
        program = getattr(trainer.train_step, "program", None)
        slot_sharding = getattr(trainer.train_step, "slot_sharding", None)
        for i in range(num_leaves):
            slots = program.inputs[i] if program is not None else {}
            if slots:
                ranks = tuple(sorted(slots))
                spec = slot_sharding[slots[ranks[0]]].spec
            else:  # not compiled by the engine (or an unused leaf): the first group
                ranks, spec = (0,), fallback[i]
            self.groups.append(ranks)
            self.specs.append(spec)

    def saveable(self, leaves: list) -> list:
        out = []
        for x in leaves:
            if isinstance(x, self._MpmdArray):
                group = x.mpmd_idxs[0]
                arr = x.arrays.get(group)
                if arr is None:  # another process holds it: a global view with no local shards
                    sharding = NamedSharding(self.mesh.unstack[group], x.spec)
                    arr = jax.make_array_from_single_device_arrays(
                        x.shape, sharding, [], dtype=x.dtype
                    )
                x = arr
            out.append(x)
        return out

    def restore_shardings(self, indices: Sequence[int]) -> list:
        return [NamedSharding(self.mesh.submesh(self.groups[i]), self.specs[i]) for i in indices]

    def place(self, leaves: list, indices: Sequence[int]) -> list:
        out = []
        for x, i in zip(leaves, indices, strict=True):
            ranks, spec = self.groups[i], self.specs[i]
            per_group = {}
            for r in ranks:
                devices = set(self.mesh.devices_of(r))
                shards = [s.data for s in x.addressable_shards if s.device in devices]
                if shards:
                    sharding = self.mesh.sharding(r, spec)
                    per_group[r] = jax.make_array_from_single_device_arrays(
                        x.shape, sharding, shards
                    )
            aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
            out.append(self._MpmdArray(self.mesh, per_group, mpmd_idxs=ranks, aval=aval, spec=spec))
        return out


def _is_spec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def placement_for(trainer: Any, num_leaves: int):
    if getattr(trainer, "mpmd_mesh", None) is not None:
        return _MpmdPlacement(trainer, num_leaves)
    return _SpmdPlacement(trainer.state_shardings)


# ------------------------------------------------------------------------------ reading helpers


def restore_args(abstract_leaves: Sequence[Any], shardings: Sequence[Any]) -> list:
    import orbax.checkpoint as ocp

    return [
        ocp.ArrayRestoreArgs(sharding=s, global_shape=tuple(a.shape), dtype=a.dtype)
        for a, s in zip(abstract_leaves, shardings)
    ]
