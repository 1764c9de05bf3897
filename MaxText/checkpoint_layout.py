"""How checkpointed state leaves map between a training layout and the canonical on-disk tree.

Save: `saveable(leaves)` gives orbax one global array per leaf (pipelined `MpmdArray`s are written
from the first group holding them, never gathered; under several processes spread over all groups
first, see `jaxpp.mpmd_to_spmd_reshard`). Restore: `restore_shardings(indices)` tells
orbax where to read each leaf, and `place(leaves, indices)` turns what it read into what the step
takes (SPMD: the step's shardings; pipelined: one `MpmdArray` over the groups that read it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

# orbax's placeholder (`...`): a leaf this process does not read (it holds no group of it).
SKIPPED = ...


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

    Save, one process: an `MpmdArray` is written from the first group holding it (that group's
    `jax.Array`). Several processes: orbax refuses arrays that live on one process, so each value
    is spread over all groups (`mpmd_to_spmd_reshard`) and every process writes its part.
    Restore: leaf i is read once onto the devices of this process's groups among its holders
    (replicated across groups, sharded within each by its PartitionSpec; not read at all by a
    process holding none), then split into one `jax.Array` per group without copying, and
    wrapped as the `MpmdArray` the step takes without any transfer.
    """

    def __init__(self, trainer: Any, abstract_leaves: Sequence[Any]):
        import jaxpp_integration as jaxpp
        from jaxpp_integration.api import local_ranks

        self._MpmdArray = jaxpp.MpmdArray
        self.mesh = trainer.mpmd_mesh
        self.local = local_ranks(self.mesh)
        self.abstract = list(abstract_leaves)
        num_leaves = len(self.abstract)
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
        if jax.process_count() > 1:  # orbax writes only arrays spanning several processes
            from jaxpp_integration.reshard import mpmd_to_spmd_reshard

            return jax.tree.leaves(mpmd_to_spmd_reshard(leaves))
        return [x.arrays[x.mpmd_idxs[0]] if isinstance(x, self._MpmdArray) else x for x in leaves]

    def restore_shardings(self, indices: Sequence[int]) -> list:
        """Where this process reads each leaf: onto its own groups among the leaf's holders, or
        None (not read here) when it holds none of them."""
        out = []
        for i in indices:
            ranks = [r for r in self.groups[i] if r in self.local]
            out.append(NamedSharding(self.mesh.submesh(ranks), self.specs[i]) if ranks else None)
        return out

    def place(self, leaves: list, indices: Sequence[int]) -> list:
        out = []
        for x, i in zip(leaves, indices, strict=True):
            ranks, spec = self.groups[i], self.specs[i]
            per_group = {}
            if x is not SKIPPED:
                for r in ranks:
                    devices = set(self.mesh.devices_of(r))
                    shards = [s.data for s in x.addressable_shards if s.device in devices]
                    if shards:
                        sharding = self.mesh.sharding(r, spec)
                        per_group[r] = jax.make_array_from_single_device_arrays(
                            x.shape, sharding, shards
                        )
            a = self.abstract[i]
            aval = jax.ShapeDtypeStruct(a.shape, a.dtype)
            out.append(self._MpmdArray(self.mesh, per_group, mpmd_idxs=ranks, aval=aval, spec=spec))
        return out


def _is_spec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def placement_for(trainer: Any, abstract_leaves: Sequence[Any]):
    if getattr(trainer, "mpmd_mesh", None) is not None:
        return _MpmdPlacement(trainer, abstract_leaves)
    return _SpmdPlacement(trainer.state_shardings)


# ------------------------------------------------------------------------------ reading helpers


def restore_args(abstract_leaves: Sequence[Any], shardings: Sequence[Any]) -> tuple[list, list]:
    """(orbax item leaves, orbax restore args): a leaf whose sharding is None is not read here
    (orbax's placeholder in both; `place` gets `SKIPPED` for it)."""
    import orbax.checkpoint as ocp

    items, args = [], []
    for a, s in zip(abstract_leaves, shardings, strict=True):
        if s is None:
            items.append(SKIPPED)
            args.append(SKIPPED)
        else:
            items.append(a)
            args.append(
                ocp.ArrayRestoreArgs(sharding=s, global_shape=tuple(a.shape), dtype=a.dtype)
            )
    return items, args
