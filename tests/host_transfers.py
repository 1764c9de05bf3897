"""Counting host-to-device copies exactly (for tests/test_device_side_state.py and
tests/test_trainer_memory.py).

`host_to_device_bytes()` patches `jax.device_put` to add up the bytes of every host array it is
given, and runs the block under `jax.transfer_guard_host_to_device("disallow")`, which refuses
the implicit copies the patch cannot see (a numpy array handed to a compiled program). Expected
figures come from shapes and shardings alone: a value placed with sharding S costs its shard on
every device of S (`placed_bytes`).
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np


@contextlib.contextmanager
def host_to_device_bytes(implicit: str = "disallow"):
    """Yields a list whose sum is the bytes of the host arrays `jax.device_put` was given in the
    block; implicit host-to-device copies raise (with `implicit="allow"`: they are let through,
    e.g. the 4-byte layer indices `x[k]` of a checkpoint's per-layer split)."""
    put = jax.device_put
    seen: list[int] = []

    def counted(x, *args, **kwargs):
        leaves = jax.tree.leaves(x)
        seen.extend(np.asarray(a).nbytes for a in leaves if not isinstance(a, jax.Array))
        return put(x, *args, **kwargs)

    jax.device_put = counted
    try:
        with jax.transfer_guard_host_to_device(implicit):
            yield seen
    finally:
        jax.device_put = put


def placed_bytes(shape, dtype, shardings) -> int:
    """Bytes a value of `shape` takes once placed with each of `shardings` (its shard on every
    device, replicas included)."""
    item = np.dtype(dtype).itemsize
    return sum(
        int(np.prod(sh.shard_shape(tuple(shape)))) * item * len(sh.device_set) for sh in shardings
    )


def batch_bytes(step, leaves_at: range, values) -> int:
    """What placing a batch costs a compiled pipelined `step`: each batch leaf (flat step inputs
    `leaves_at`) on every group that reads it, in that group's layout."""
    total = 0
    for j, value in zip(leaves_at, values, strict=True):
        slots = step.program.inputs[j]
        assert slots, f"step input {j} is read by no group"
        shardings = [step.slot_sharding[s] for s in slots.values()]
        total += placed_bytes(value.shape, value.dtype, shardings)
    return total
