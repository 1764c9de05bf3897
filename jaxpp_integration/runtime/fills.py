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

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxpp_integration.jax_compat import (
    load_compiled_on,
    persistent_cache_reads,
    without_persistent_cache,
)


class FillPrograms:
    """The fill programs of one compiled step, shared between its groups where alike."""

    def __init__(self):
        # layout-free signature -> (executable, its devices, its bytes if read from JAX's
        # persistent compilation cache: XLA:CPU cannot serialize such an executable again)
        self._made: dict = {}

    def program(self, fills, shardings: list[NamedSharding]):
        """A compiled program returning a fresh array per fill of `fills` (one group's run of
        consecutive `Fill`s), each with the matching sharding of `shardings`."""
        mesh = shardings[0].mesh
        signature = tuple(
            (f.shape, str(f.dtype), repr(f.value), sh.spec) for f, sh in zip(fills, shardings)
        )
        key = (signature, mesh.axis_names, mesh.devices.shape)
        devices = list(mesh.devices.flat)
        made = self._made.get(key)
        if made is not None:
            exe, there, serialized = made
            moved = load_compiled_on(exe, there, devices, serialized, name="accumulator fills")
            if moved is not None:
                return moved
        lowered = _lowered(tuple((f.shape, f.dtype, f.value) for f in fills), tuple(shardings))
        with persistent_cache_reads() as reads:
            exe = lowered.compile()
        if reads.hits and not reads.serialized:  # read, but its bytes unknown: compile anew
            with without_persistent_cache():
                exe = _lowered(
                    tuple((f.shape, f.dtype, f.value) for f in fills), tuple(shardings)
                ).compile()
        serialized = reads.serialized[-1] if reads.hits and reads.serialized else None
        self._made.setdefault(key, (exe, devices, serialized))
        return exe


def _lowered(fills: tuple, shardings: tuple):
    def make():
        return tuple(jnp.full(shape, value, dtype) for shape, dtype, value in fills)

    return jax.jit(make, out_shardings=shardings).lower()
