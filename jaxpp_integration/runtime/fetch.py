"""Reading pipelined values on the host: `fetch(tree)` gives every process numpy copies.

On one host an `MpmdArray` is read from any group that holds it. Under multi-controller JAX the
process owning the first holding group broadcasts it to all processes (one collective per source
process, leaves batched), so loss logging, NaN checks and evaluation see the same numbers
everywhere. Every process must call `fetch` on the same tree in the same order.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxpp_integration.frontend.array import MpmdArray


def _source_process(a: MpmdArray) -> int:
    return next(iter(a.mpmd_mesh.devices_of(a.mpmd_idxs[0]))).process_index


def fetch(tree):
    """`tree` with every `MpmdArray` / `jax.Array` leaf replaced by a numpy array, on every
    process."""
    leaves, treedef = jax.tree.flatten(tree)
    if jax.process_count() == 1:
        return jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
    from jax.experimental import multihost_utils

    out = [None] * len(leaves)
    by_source: dict[int, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, MpmdArray):
            by_source.setdefault(_source_process(x), []).append(i)
        else:
            out[i] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    me = jax.process_index()
    for src in sorted(by_source):
        idx = by_source[src]
        values = [
            np.asarray(leaves[i]) if me == src else np.zeros(leaves[i].shape, leaves[i].dtype)
            for i in idx
        ]
        got = multihost_utils.broadcast_one_to_all(values, is_source=me == src)
        for i, v in zip(idx, got):
            out[i] = np.asarray(v)
    return jax.tree.unflatten(treedef, out)
