"""`MpmdMesh`: a JAX mesh with one axis naming the pipeline groups (MPMD ranks)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class MpmdMesh:
    """`jax_mesh` split along `mpmd_axis_name` into `mpmd_dim` groups, each an SPMD sub-mesh."""

    jax_mesh: Mesh
    mpmd_axis_name: str

    def __post_init__(self):
        if self.mpmd_axis_name not in self.jax_mesh.axis_names:
            raise ValueError(
                f"MpmdMesh: axis {self.mpmd_axis_name!r} is not in the mesh axes "
                f"{self.jax_mesh.axis_names}; name the pipeline axis of your mesh"
            )

    @property
    def mpmd_dim(self) -> int:
        return self.jax_mesh.shape[self.mpmd_axis_name]

    @property
    def _axis_index(self) -> int:
        return self.jax_mesh.axis_names.index(self.mpmd_axis_name)

    @functools.cached_property
    def unstack(self) -> list[Mesh]:
        """One mesh per group; same axis names, the mpmd axis of size 1."""
        devices = self.jax_mesh.devices
        axis = self._axis_index
        return [
            Mesh(np.take(devices, [i], axis=axis), self.jax_mesh.axis_names)
            for i in range(self.mpmd_dim)
        ]

    def lowering_mesh(self) -> Mesh:
        """The mesh a single group sees; the step is traced against it."""
        return self.unstack[0]

    def submesh(self, ranks) -> Mesh:
        """The mesh spanning `ranks` (in order) along the mpmd axis."""
        ranks = list(ranks)
        if ranks == list(range(self.mpmd_dim)):
            return self.jax_mesh
        return Mesh(
            np.take(self.jax_mesh.devices, ranks, axis=self._axis_index), self.jax_mesh.axis_names
        )

    def sharding(self, rank: int, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.unstack[rank], spec)

    def devices_of(self, rank: int) -> list[jax.Device]:
        return list(self.unstack[rank].devices.flat)

    def check_spec(self, spec: PartitionSpec, what: str) -> PartitionSpec:
        for entry in spec:
            names = entry if isinstance(entry, tuple) else (entry,)
            if self.mpmd_axis_name in names:
                raise ValueError(
                    f"{what}: spec {spec} shards over the pipeline axis {self.mpmd_axis_name!r}; "
                    "specs name only the axes inside a group, drop it"
                )
        return spec
