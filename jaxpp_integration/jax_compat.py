"""The only module that touches private JAX (`jax._src`); a JAX upgrade should change only this."""

from __future__ import annotations


def source_line(eqn) -> str:
    """'file.py:123 (fn)' for an equation, or '<unknown>'."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - best effort across JAX versions
        return "<unknown source line>"


def eqn_source_context(eqn):
    """A context in which equations bound again carry `eqn`'s source line and name stack."""
    import contextlib

    try:
        from jax._src import source_info_util

        info = eqn.source_info
        return source_info_util.user_context(info.traceback, name_stack=info.name_stack)
    except Exception:  # pragma: no cover - best effort across JAX versions
        return contextlib.nullcontext()


def shard_map(f, *, mesh, in_specs, out_specs, check: bool = True):
    """`jax.shard_map` where it exists (newer JAX), else the experimental one. `check=False`
    turns off the replication check (for outputs equal across an axis by construction)."""
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def wait_at_barrier(name: str, timeout_s: float) -> None:
    """All processes meet at `name` through the coordination service (no device collective, so
    no gloo/NCCL context timeout while slower processes are still compiling)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))


def same_shard_layout(src, dst, shape) -> bool:
    """Whether `dst` cuts an array of `shape` into the same blocks, in the same device order, as
    `src` (the same spec on another group's devices): then a copy moves shard i to device i."""
    a = list(src.addressable_devices_indices_map(shape).values())
    b = list(dst.addressable_devices_indices_map(shape).values())
    return a == b and len(src.addressable_devices) == len(src.device_set)


def copy_shards(arrays: list, shardings: list) -> list:
    """Copies each array shard by shard to the devices of `shardings[i]` (which must satisfy
    `same_shard_layout`), all in one runtime call. This is the copy `jax.device_put` ends in,
    without its per-call argument handling: about 5 us per array instead of 50 on this CPU."""
    import jax

    try:
        from jax._src.lib import xla_client as xc

        copy = xc.batched_copy_array_to_devices_with_sharding
        reuse = xc.ArrayCopySemantics.REUSE_INPUT
        devices = [s._internal_device_list.addressable_device_list for s in shardings]
    except (ImportError, AttributeError):  # pragma: no cover - another JAX version
        return jax.device_put(arrays, shardings)
    return copy(list(arrays), devices, list(shardings), [reuse] * len(arrays))
