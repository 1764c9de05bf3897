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

    def fill_value(self, aval):
        """The one value `init` fills its array with (the engine makes such arrays on the
        device: `runtime/fills.py`)."""
        return np.zeros((), aval.dtype)[()]

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

    def fill_value(self, aval):
        return np.zeros((), aval.dtype)[()]

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

    def fill_value(self, aval):
        return np.asarray(self._fill(aval), aval.dtype)[()]

    def update(self, acc, value, index):
        return jnp.maximum(acc, value)


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
