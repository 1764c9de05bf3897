"""Accumulators made on the device: the programs that run a program's `Fill`s.

A group with no work before the loop starts its gradient accumulators from `Fill`s (zeros, or
-inf for `Max`). Every step needs fresh buffers (the first accumulation consumes them), so
they are made by a compiled program on the group's own devices: no host array is placed on a
device in the step loop. One program per run of consecutive fills on a group (the executor
runs such a run in one call), taking no input and returning every accumulator of the run in
its layout.

Groups whose runs are alike (the same shapes, dtypes, values and specs: every group of a
uniform pipeline) share one XLA compile: the first group's executable is loaded onto the
others' devices (`jax_compat.load_compiled_on`, milliseconds), as the task programs are (from
the bytes read when the executable came from JAX's persistent compilation cache).
"""

from __future__ import annotations

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpp_integration.jax_compat import (
    load_compiled_on,
    persistent_cache_reads,
    persistent_cache_writes_here,
    without_persistent_cache,
)


class FillPrograms:
    """The fill programs of one compiled step (made by `executor.prepare`), shared between its
    groups where alike."""

    def __init__(self):
        # layout-free signature -> (executable, its devices, its bytes when read from JAX's
        # persistent compilation cache: XLA:CPU cannot serialize such an executable again)
        self._first: dict = {}

    def program(self, fills, shardings: list[NamedSharding]):
        """A compiled program returning a fresh array per fill of `fills` (one group's run of
        consecutive `Fill`s), each with the matching sharding of `shardings`."""
        made = tuple((f.shape, np.dtype(f.dtype), f.value) for f in fills)
        mesh = shardings[0].mesh
        signature = tuple(
            (shape, str(dtype), repr(v), sh.spec) for (shape, dtype, v), sh in zip(made, shardings)
        )
        key = (signature, mesh.axis_names, mesh.devices.shape)
        devices = list(mesh.devices.flat)
        first = self._first.get(key)
        if first is not None:
            exe, there, serialized = first
            moved = load_compiled_on(exe, there, devices, serialized, name="accumulator fills")
            if moved is not None:
                return moved
        # several processes: this one writes its own fill programs to JAX's persistent
        # compilation cache (JAX writes from process 0 only), as it does its task programs
        writes = persistent_cache_writes_here() if jax.process_count() > 1 else nullcontext()
        with writes, persistent_cache_reads() as reads:
            exe = _lowered(made, tuple(shardings)).compile()
        serialized = None
        if reads.hits:
            if reads.serialized:
                serialized = reads.serialized[-1]
            else:  # read, but its bytes unknown: an executable another group cannot load
                with without_persistent_cache():
                    exe = _lowered(made, tuple(shardings)).compile()
        self._first.setdefault(key, (exe, devices, serialized))
        return exe


def _lowered(fills: tuple, shardings: tuple):
    def accumulator_fills():
        return tuple(jnp.full(shape, value, dtype) for shape, dtype, value in fills)

    return jax.jit(accumulator_fills, out_shardings=shardings).lower()
