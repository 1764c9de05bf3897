"""How the model's parameters are made: dtypes by name, initialisers, and `param` (a parameter with
its logical axis names).

Every parameter goes through `param`, which attaches logical axis names
(`nn.with_logical_partitioning`); `MaxText/sharding.py` maps those names onto mesh axes. Parameters
are stored in `weight_dtype` and cast to `dtype` for compute.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return DTYPES[name]


def fan_in_init(in_axis=-2, out_axis=-1):
    """Truncated normal with variance 1 / fan_in (fan_in over `in_axis`, possibly a tuple)."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
    )


def param(module: nn.Module, name: str, init: Callable, shape, axes, weight_dtype):
    """`module.param(name, ...)` with logical axis names `axes` (one per dimension)."""
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, weight_dtype)
