"""`MpmdArray`: a value of a pipelined program, held by one or more groups."""

from __future__ import annotations

import collections

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpp_integration.mesh import MpmdMesh


class MpmdArray:
    """One logical array; `arrays[g]` is group g's copy (a `jax.Array` on g's sub-mesh)."""

    def __init__(self, mpmd_mesh: MpmdMesh, arrays: dict[int, jax.Array]):
        if not arrays:
            raise ValueError("MpmdArray needs at least one group's array")
        self.mpmd_mesh = mpmd_mesh
        self._arrays = collections.OrderedDict(sorted(arrays.items()))
        first = next(iter(self._arrays.values()))
        self.shape = tuple(first.shape)
        self.dtype = first.dtype

    @property
    def mpmd_idxs(self) -> tuple[int, ...]:
        return tuple(self._arrays)

    @property
    def arrays(self) -> dict[int, jax.Array]:
        """Group index → that group's `jax.Array` (public accessor)."""
        return dict(self._arrays)

    @property
    def _partially_addressable_arrays(self) -> collections.OrderedDict:
        return self._arrays

    @property
    def spec(self):
        return self.first_array.sharding.spec

    @property
    def sharding(self) -> NamedSharding:
        """Within one group: that group's sharding; across groups: the mesh of those groups."""
        if len(self._arrays) == 1:
            return self.first_array.sharding
        mesh = self.mpmd_mesh.submesh(self.mpmd_idxs)
        return NamedSharding(mesh, self.spec)

    @property
    def first_array(self) -> jax.Array:
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
