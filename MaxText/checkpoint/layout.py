"""How checkpointed state leaves map between a training layout and the canonical on-disk tree.

**Canonical tree.** On disk every decoder layer is its own sub-tree `layers_<i>` (the unrolled
model's names), whatever the training layout: unrolled (`layers_<i>`), scanned without stages
(`layers`, leading axis = all layers) or scanned with stages (`layers_stage_<s>`, leading axis =
stage s's layers, one leaf per stage so each stage's weights live on its own group). The same
mapping applies inside the optimizer state (Adam's moments have the parameters' tree). So a
checkpoint written scanned at pipeline_parallelism=4 resumes unrolled at 2 or under SPMD, and the
reverse. `CanonicalLayout` owns the mapping: canonical leaf c comes from state leaf `j` and, for a
stacked leaf, layer `k` of it (`sources[c] = (j, k)`; k is None for a leaf stored as it is).
Save slices each stacked leaf per layer (one extra device copy of the stacked state for the
duration of the save); restore reads each layer where its stack will live and stacks them there.

Save: `saveable(leaves)` gives orbax one global array per leaf (pipelined `MpmdArray`s are written
from the first group holding them, never gathered; under several processes spread over all groups
first, see `jaxpp.mpmd_to_spmd_reshard`). Restore: `restore_shardings(sources)` tells
orbax where to read each leaf, and `place(leaves, sources)` turns what it read into what the step
takes (SPMD: the step's shardings; pipelined: one `MpmdArray` over the groups that read it).
`make(values, indices)` makes state leaves where the step reads them (a fine-tune's fresh
optimizer state around loaded parameters).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# orbax's placeholder (`...`): a leaf this process does not read (it holds no group of it).
SKIPPED = ...


class _SpmdPlacement:
    """SPMD: leaves are global `jax.Array`s; restore onto the step's input shardings."""

    def __init__(self, shardings: Any):
        self._shardings = jax.tree.leaves(shardings)

    def saveable(self, leaves: list) -> list:
        return leaves

    def restore_shardings(self, sources: Sequence[Source]) -> list:
        out = []
        for j, k in sources:
            s = self._shardings[j]
            out.append(s if k is None else NamedSharding(s.mesh, _drop_first(s.spec)))
        return out

    def place(self, leaves: list, sources: Sequence[Source]) -> list:
        return leaves

    def stack(self, layers: list, j: int) -> Any:
        return _stack_onto(self._shardings[j])(*layers)

    def make(self, values: Any, indices: Sequence[int]) -> list:
        """State leaves `indices` of `values()` (traced: every state leaf), made in one program
        directly on the step's shardings."""
        shardings = [self._shardings[j] for j in indices]
        return list(jax.jit(lambda: [values()[j] for j in indices], out_shardings=shardings)())


class _MpmdPlacement:
    """Pipelined: leaf j lives on the groups whose compiled tasks read state input j.

    Save, one process: an `MpmdArray` is written from the first group holding it (that group's
    `jax.Array`). Several processes: orbax refuses arrays that live on one process, so each value
    is spread over all groups (`mpmd_to_spmd_reshard`) and every process writes its part.
    Restore: a canonical leaf is read once onto the devices of this process's groups among the
    holders of its state leaf (replicated across groups, sharded within each by its
    PartitionSpec; not read at all by a process holding none), then split into one `jax.Array`
    per group without copying, and wrapped as the `MpmdArray` the step takes without any
    transfer (a stacked leaf: its layers are stacked on each group first).
    """

    def __init__(self, trainer: Any, abstract_leaves: Sequence[Any]):
        import jaxpp_integration as jaxpp

        self._MpmdArray = jaxpp.MpmdArray
        self.mesh = trainer.mpmd_mesh
        self.local = jaxpp.local_ranks(self.mesh)
        self.abstract = list(abstract_leaves)
        num_leaves = len(self.abstract)
        fallback = jax.tree.leaves(trainer.state_specs, is_leaf=_is_spec)
        self.groups: list[tuple[int, ...]] = []
        self.specs: list = []
        # several processes: orbax writes only arrays spanning them, so a save spreads each value
        # over all groups first (tests set it in one process, to run that path)
        self.spread_over_groups = jax.process_count() > 1
        report = getattr(trainer.train_step, "report", None)
        inputs = report().inputs if report is not None else ()
        for i in range(num_leaves):
            if i < len(inputs) and inputs[i].groups:
                ranks = inputs[i].groups
                spec = trainer.train_step.in_specs[i]
            else:  # not compiled by the engine (or an unused leaf): the first group
                ranks, spec = (0,), fallback[i]
            self.groups.append(ranks)
            self.specs.append(spec)

    def saveable(self, leaves: list) -> list:
        if self.spread_over_groups:
            from jaxpp_integration.runtime.reshard import mpmd_to_spmd_reshard

            return jax.tree.leaves(mpmd_to_spmd_reshard(leaves))
        return [x.arrays[x.mpmd_idxs[0]] if isinstance(x, self._MpmdArray) else x for x in leaves]

    def _spec(self, source: Source):
        j, k = source
        return self.specs[j] if k is None else _drop_first(self.specs[j])

    def restore_shardings(self, sources: Sequence[Source]) -> list:
        """Where this process reads each leaf: onto its own groups among the leaf's holders, or
        None (not read here) when it holds none of them."""
        out = []
        for source in sources:
            ranks = [r for r in self.groups[source[0]] if r in self.local]
            sharding = (
                NamedSharding(self.mesh.submesh(ranks), self._spec(source)) if ranks else None
            )
            out.append(sharding)
        return out

    def place(self, leaves: list, sources: Sequence[Source]) -> list:
        out = []
        for x, source in zip(leaves, sources, strict=True):
            j, k = source
            ranks, spec = self.groups[j], self._spec(source)
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
            a = self.abstract[j]
            shape = a.shape if k is None else a.shape[1:]
            aval = jax.ShapeDtypeStruct(shape, a.dtype)
            out.append(self._MpmdArray(self.mesh, per_group, mpmd_idxs=ranks, aval=aval, spec=spec))
        return out

    def stack(self, layers: list, j: int) -> Any:
        """The placed layers of stacked leaf j, stacked on each of its groups."""
        ranks, spec, a = self.groups[j], self.specs[j], self.abstract[j]
        per_group = {
            r: _stack_onto(self.mesh.sharding(r, spec))(*[x.arrays[r] for x in layers])
            for r in ranks
            if r in self.local
        }
        aval = jax.ShapeDtypeStruct(a.shape, a.dtype)
        return self._MpmdArray(self.mesh, per_group, mpmd_idxs=ranks, aval=aval, spec=spec)

    def programs(self, values: Any, indices: Sequence[int]) -> dict[int, tuple[list, Any]]:
        """{group: (the leaves of `indices` it holds, the program making them there)}: one
        program per group of this process holding any of state leaves `indices` of `values()`
        (traced: every state leaf; XLA keeps only that group's outputs)."""
        by_group: dict[int, list[int]] = {}
        for j in indices:
            for r in self.groups[j]:
                if r in self.local:
                    by_group.setdefault(r, []).append(j)
        out = {}
        for r, held in sorted(by_group.items()):
            shardings = [self.mesh.sharding(r, self.specs[j]) for j in held]
            out[r] = (held, jax.jit(lambda held=held: [values()[j] for j in held],
                                    out_shardings=shardings))  # fmt: skip
        return out

    def make(self, values: Any, indices: Sequence[int]) -> list:
        """State leaves `indices` of `values()`, each made on the groups that read it and
        nowhere else (`programs`)."""
        made: dict[int, dict] = {j: {} for j in indices}
        for r, (held, program) in self.programs(values, indices).items():
            for j, x in zip(held, program(), strict=True):
                made[j][r] = x
        out = []
        for j in indices:
            aval = jax.ShapeDtypeStruct(self.abstract[j].shape, self.abstract[j].dtype)
            out.append(
                self._MpmdArray(
                    self.mesh, made[j], mpmd_idxs=self.groups[j], aval=aval, spec=self.specs[j]
                )
            )
        return out


# (state leaf index, layer within that stacked leaf or None): where a canonical leaf comes from.
Source = tuple[int, "int | None"]


def _drop_first(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(*tuple(spec)[1:])


@functools.cache
def _stack_onto(sharding: Any):
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


def _is_spec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def placement_for(trainer: Any, abstract_leaves: Sequence[Any]):
    if getattr(trainer, "mpmd_mesh", None) is not None:
        return _MpmdPlacement(trainer, abstract_leaves)
    return _SpmdPlacement(trainer.state_shardings)


# ---------------------------------------------------------------------------- canonical tree

_BLOCK = re.compile(r"layers(?:_stage_(\d+))?$")


def _block_order(key: Any) -> int | None:
    """The position of a stacked layer block (`layers` -> 0, `layers_stage_<s>` -> s), or None."""
    m = _BLOCK.match(key) if isinstance(key, str) else None
    return None if m is None else int(m.group(1) or 0)


def _has_blocks(node: Any) -> bool:
    return isinstance(node, dict) and any(_block_order(k) is not None for k in node)


def canonical_tree(tree: Any, take: Any, length: Any) -> Any:
    """`tree` with every stacked layer block split into `layers_<i>` sub-trees, in layer order
    (blocks in stage order, then along their leading axis). `take(leaf, k)` is layer k of a
    stacked leaf, `length(leaf)` its number of layers. Unrolled trees are returned as they are."""

    def split(node):
        if not _has_blocks(node):
            return node
        out = {k: v for k, v in node.items() if _block_order(k) is None}
        first = 0
        for name in sorted((k for k in node if _block_order(k) is not None), key=_block_order):
            block = node[name]
            n = length(jax.tree.leaves(block)[0])
            for k in range(n):
                out[f"layers_{first + k}"] = jax.tree.map(lambda x, k=k: take(x, k), block)
            first += n
        return out

    return jax.tree.map(split, tree, is_leaf=_has_blocks)


class _Ref:
    """A state leaf (or one layer of it) while the canonical tree is worked out."""

    def __init__(self, index: int, shape: tuple, dtype: Any, layer: int | None = None):
        self.index, self.shape, self.dtype, self.layer = index, tuple(shape), dtype, layer


class CanonicalLayout:
    """The canonical on-disk tree of a state (or params) tree and the way back.

    - `abstract`: the canonical tree of `jax.ShapeDtypeStruct`s (what orbax reads);
    - `sources[c]`: (state leaf, layer or None) of canonical leaf c;
    - `to_canonical(leaves)`: state leaves (global arrays) -> canonical tree;
    - `from_canonical(leaves, indices, stack)`: canonical leaves `indices` -> {state leaf: value},
      stacking the layers of a stacked leaf with `stack(layers, j)`.
    """

    def __init__(self, abstract_tree: Any):
        leaves, self.treedef = jax.tree.flatten(abstract_tree)
        refs = [_Ref(j, a.shape, a.dtype) for j, a in enumerate(leaves)]
        canon = canonical_tree(
            jax.tree.unflatten(self.treedef, refs),
            take=lambda r, k: _Ref(r.index, r.shape[1:], r.dtype, k),
            length=lambda r: r.shape[0],
        )
        canon_refs, self.canonical_treedef = jax.tree.flatten(canon)
        self.sources: list[Source] = [(r.index, r.layer) for r in canon_refs]
        self.abstract = jax.tree.unflatten(
            self.canonical_treedef, [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in canon_refs]
        )

    def to_canonical(self, leaves: Sequence[Any]) -> Any:
        out = [leaves[j] if k is None else leaves[j][k] for j, k in self.sources]
        return jax.tree.unflatten(self.canonical_treedef, out)

    def from_canonical(self, leaves: Sequence[Any], indices: Sequence[int], stack: Any) -> dict:
        parts: dict[int, dict] = {}
        for x, c in zip(leaves, indices, strict=True):
            j, k = self.sources[c]
            parts.setdefault(j, {})[k] = x
        out = {}
        for j, layers in sorted(parts.items()):
            out[j] = (
                layers[None] if None in layers else stack([layers[k] for k in sorted(layers)], j)
            )
        return out


def numpy_stack(layers: list, j: int) -> np.ndarray:
    del j
    return np.stack([np.asarray(x) for x in layers])


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
