"""Reduction operations for `treduce`: how one microbatch's output folds into the accumulator."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Add:
    """Sums the outputs over microbatches (in microbatch order)."""

    def init(self, n: int, aval) -> jax.Array:
        return jnp.zeros(aval.shape, aval.dtype)

    def host_init(self, n: int, aval) -> np.ndarray:
        """`init` computed on the host (no XLA compile): a read-only view of one zero, so
        building the program allocates nothing (an accumulator can be as large as the
        unsharded gradient of a stage); each device's shard is made when it is placed."""
        return _filled(aval.shape, aval.dtype, 0)

    def out_aval(self, n: int, aval):
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)

    def update(self, acc, value, index):
        return acc + value


@dataclasses.dataclass(frozen=True)
class Concat:
    """Stacks the outputs along a new dimension `axis` of size n_microbatches."""

    axis: int = 0

    def out_aval(self, n: int, aval):
        shape = list(aval.shape)
        shape.insert(self.axis, n)
        return jax.ShapeDtypeStruct(tuple(shape), aval.dtype)

    def init(self, n: int, aval) -> jax.Array:
        out = self.out_aval(n, aval)
        return jnp.zeros(out.shape, out.dtype)

    def host_init(self, n: int, aval) -> np.ndarray:
        out = self.out_aval(n, aval)
        return _filled(out.shape, out.dtype, 0)

    def update(self, acc, value, index):
        return lax.dynamic_update_index_in_dim(acc, jnp.asarray(value, acc.dtype), index, self.axis)


@dataclasses.dataclass(frozen=True)
class Max:
    """Keeps the elementwise maximum over microbatches."""

    def out_aval(self, n: int, aval):
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)

    def _fill(self, aval):
        if jnp.issubdtype(aval.dtype, jnp.floating):
            return -np.inf
        return jnp.iinfo(aval.dtype).min

    def init(self, n: int, aval) -> jax.Array:
        return jnp.full(aval.shape, self._fill(aval), aval.dtype)

    def host_init(self, n: int, aval) -> np.ndarray:
        return _filled(aval.shape, aval.dtype, self._fill(aval))

    def update(self, acc, value, index):
        return jnp.maximum(acc, value)


def _filled(shape, dtype, value) -> np.ndarray:
    """`shape` filled with `value`, as a read-only broadcast of one element (no memory)."""
    return np.broadcast_to(np.asarray(value, dtype), tuple(shape))


def _as_instance(op):
    """Accepts both `Add` and `Add()` as the seeds do."""
    return op() if isinstance(op, type) else op


def is_operation(x) -> bool:
    return isinstance(_as_instance(x) if isinstance(x, type) else x, Add | Concat | Max)


def broadcast_operations(operation, out_tree_example):
    """Expands `operation` (a pytree prefix of the output) into one op per output leaf."""
    leaves = []

    def expand(op, sub):
        n = len(jax.tree.leaves(sub))
        leaves.extend([_as_instance(op)] * n)

    try:
        jax.tree.map(expand, operation, out_tree_example, is_leaf=is_operation)
    except ValueError as e:
        raise ValueError(
            f"treduce operation {operation!r} is not a pytree prefix of the function's output "
            f"{jax.tree.structure(out_tree_example)}; pass one op per output subtree"
        ) from e
    return tuple(leaves)
