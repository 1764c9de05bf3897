"""Device meshes and the logical-axis rules that map the model's axis names onto them.

The model names every parameter axis (`embed`, `mlp`, `heads`, `kv_heads`, `kv`, `vocab`, `norm`,
`layers`, ...) and knows nothing else of parallelism. The rules here decide which mesh axis shards
each name:

- `data`   pure data parallelism: the batch is split, parameters are replicated;
- `fsdp`   the batch is split and parameters / optimizer state are sharded along `embed` (ZeRO-3);
- `tensor` heads, kv heads, mlp and vocab are split (Megatron-style tensor parallelism);
- `expert` (MoE, `ici_expert_parallelism`) the experts of every MoE layer (`exp`) are split; the
  batch is split over it too, so everything but the experts (attention, router, norms,
  embeddings) is data-parallel over it. Token-slots travel to their experts' devices and back
  by all-to-all inside the MoE block (`MaxText/model/moe.py`). Always inside a pipeline group;
- `stage`  (pipelined meshes only) the MPMD axis: one group of devices per pipeline rank. It never
  appears in a rule; the engine places each stage's parameters on its group.

SPMD runs use a ("data", "fsdp", "tensor", "expert") mesh; pipelined runs use
("stage", "data", "fsdp", "tensor", "expert") wrapped in `jaxpp.MpmdMesh(mesh, "stage")`, and the
same rules give the in/out PartitionSpecs within each group. The expert axis is innermost (the
all-to-all's devices are neighbours, as MaxText orders it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.config import Config

SPMD_AXES = ("data", "fsdp", "tensor", "expert")
PIPELINE_AXIS = "stage"
PIPELINE_AXES = (PIPELINE_AXIS, *SPMD_AXES)

# (logical name, mesh axes). Names not listed are replicated.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    # activations
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    # parameters
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("vocab", "tensor"),
    ("norm", None),
    ("position", None),
    ("layers", None),
    ("exp", "expert"),
)

# Logical axes of the batch arrays fed to a step: [batch, length].
BATCH_LOGICAL_AXES = ("activation_batch", "activation_length")


def mesh_device_array(config: Config, devices: Sequence[Any]) -> np.ndarray:
    """The devices of `make_mesh` as an array of the mesh's shape (any objects with
    `process_index`, so the layout can be checked without real devices).

    Each axis has size ici x dcn. Without dcn axes the devices (ordered by process) are reshaped
    in order. With a dcn_*_parallelism > 1, JAX's hybrid mesh (`create_hybrid_device_mesh`,
    processes as the outer granules, as MaxText does across slices): along each axis the dcn
    index is the outer one, so an axis with dcn 1 never leaves a process.
    """
    ici = [
        config.ici_data_parallelism,
        config.ici_fsdp_parallelism,
        config.ici_tensor_parallelism,
        config.ici_expert_parallelism,
    ]
    dcn = [config.dcn_data_parallelism, config.dcn_fsdp_parallelism, config.dcn_tensor_parallelism]
    dcn.append(1)  # expert: inside a process
    if config.is_pipelined:
        ici.insert(0, config.ici_pipeline_parallelism)
        dcn.insert(0, config.dcn_pipeline_parallelism)
    shape = [i * d for i, d in zip(ici, dcn, strict=True)]
    if not config.uses_dcn:
        return np.asarray(devices, dtype=object).reshape(shape)
    from jax.experimental import mesh_utils

    return mesh_utils.create_hybrid_device_mesh(ici, dcn, list(devices), process_is_granule=True)


def make_mesh(config: Config, devices: Sequence[jax.Device]) -> Mesh:
    """The device mesh for `config` over exactly `config.num_devices` devices.

    Pipelined: ("stage", "data", "fsdp", "tensor", "expert"), stage outermost so each pipeline
    group is a contiguous block of devices (on one process). Otherwise without "stage".
    """
    assert len(devices) == config.num_devices, (len(devices), config.num_devices)
    names = PIPELINE_AXES if config.is_pipelined else SPMD_AXES
    return Mesh(mesh_device_array(config, devices), names)


def make_mpmd_mesh(mesh: Mesh):
    """Wraps a pipelined mesh for the engine (`jaxpp.MpmdMesh(mesh, "stage")`)."""
    import jaxpp_integration as jaxpp

    return jaxpp.MpmdMesh(mesh, PIPELINE_AXIS)


def logical_to_specs(logical_tree: Any) -> Any:
    """Maps a pytree of logical PartitionSpecs to mesh-axis PartitionSpecs."""
    return nn.logical_to_mesh(logical_tree, LOGICAL_AXIS_RULES)


def batch_spec() -> PartitionSpec:
    return nn.logical_to_mesh_axes(BATCH_LOGICAL_AXES, LOGICAL_AXIS_RULES)


def named_shardings(mesh: Mesh, spec_tree: Any) -> Any:
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        spec_tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def axis_rules():
    """Context manager activating the rules (for activation sharding constraints while tracing)."""
    return nn.logical_axis_rules(LOGICAL_AXIS_RULES)
