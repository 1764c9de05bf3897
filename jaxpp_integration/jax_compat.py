"""The only module that touches private JAX (`jax._src`); a JAX upgrade should change only this."""

from __future__ import annotations


def source_line(eqn) -> str:
    """'file.py:123 (fn)' for an equation, or '<unknown>'."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - best effort across JAX versions
        return "<unknown source line>"


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
