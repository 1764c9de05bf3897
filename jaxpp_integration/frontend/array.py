"""`MpmdArray`: a value of a pipelined program, held by one or more groups."""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpp_integration.frontend.mesh import MpmdMesh


class MpmdArray:
    """One logical array; `arrays[g]` is group g's copy (a `jax.Array` on g's sub-mesh).

    Under multi-controller JAX a process holds only its own groups' copies; `mpmd_idxs` still
    names every group holding the value, and `shape`/`dtype`/`spec` are known everywhere."""

    def __init__(
        self,
        mpmd_mesh: MpmdMesh,
        arrays: dict[int, jax.Array],
        *,
        mpmd_idxs=None,
        aval=None,
        spec=None,
    ):
        self.mpmd_mesh = mpmd_mesh
        self._arrays = collections.OrderedDict(sorted(arrays.items()))
        self._mpmd_idxs = tuple(sorted(mpmd_idxs)) if mpmd_idxs is not None else tuple(arrays)
        if not self._mpmd_idxs:
            raise ValueError("MpmdArray needs at least one group")
        if self._arrays:
            first = next(iter(self._arrays.values()))
            self.shape, self.dtype = tuple(first.shape), first.dtype
            self._spec = first.sharding.spec
        else:
            self.shape, self.dtype = tuple(aval.shape), aval.dtype
            self._spec = spec

    @property
    def mpmd_idxs(self) -> tuple[int, ...]:
        return self._mpmd_idxs

    @property
    def arrays(self) -> dict[int, jax.Array]:
        """Group index → that group's `jax.Array` (public accessor; a copy of the mapping)."""
        return dict(self._arrays)

    def array_on(self, group: int) -> jax.Array | None:
        """Group `group`'s `jax.Array`, or None when this process holds no copy there."""
        return self._arrays.get(group)

    @property
    def _partially_addressable_arrays(self) -> collections.OrderedDict:
        return self._arrays

    @property
    def spec(self):
        return self._spec

    @property
    def sharding(self) -> NamedSharding:
        """Within one group: that group's sharding; across groups: the mesh of those groups."""
        if len(self._mpmd_idxs) == 1:
            return NamedSharding(self.mpmd_mesh.unstack[self._mpmd_idxs[0]], self.spec)
        mesh = self.mpmd_mesh.submesh(self.mpmd_idxs)
        return NamedSharding(mesh, self.spec)

    @property
    def first_array(self) -> jax.Array:
        if not self._arrays:
            raise ValueError(
                f"this process holds no copy of the value (it lives on groups {self.mpmd_idxs}); "
                "read it on a process that owns one of those groups"
            )
        return next(iter(self._arrays.values()))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def is_deleted(self) -> bool:
        return any(a.is_deleted() for a in self._arrays.values())

    def block_until_ready(self) -> MpmdArray:
        for a in self._arrays.values():
            a.block_until_ready()
        return self

    def delete(self) -> None:
        for a in self._arrays.values():
            if not a.is_deleted():
                a.delete()

    def __array__(self, dtype=None, copy=None):
        out = np.asarray(self.first_array)
        return out.astype(dtype) if dtype is not None else out

    def item(self):
        return np.asarray(self).item()

    def __float__(self):
        return float(np.asarray(self))

    def __int__(self):
        return int(np.asarray(self))

    def __repr__(self) -> str:
        return (
            f"MpmdArray(shape={self.shape}, dtype={np.dtype(self.dtype).name}, "
            f"mpmd_idxs={self.mpmd_idxs}, sharding={self.sharding})"
        )
