"""The per-layer bound: what one decoder layer at a time needs, for judging a plan whose XLA
temporaries come from another compiler than the one that will run it.

A plan's temporaries are the compiling backend's: on a CPU host planning for GPUs, XLA:CPU's, a
proxy. For a scanned stage the proxy holds up: the layer scan's `while` body runs one layer at a
time on every backend, so its temporaries are one layer's working set (Llama 2 70B, pp=8 x
fsdp=8, 1 row of 4096 tokens per device: 20.6 GB, mostly the dot-product attention's f32 scores
and probabilities, 4.3 GB each, plus one layer's gathered weights and full-size gradient). An
unrolled stage (`scan_layers=false`) is one straight-line program, and XLA:CPU's scheduler
overlaps its layers: for the same stage of 10 layers it holds 170 GB of temporaries (many
layers' attention scores and gathered weights at once, read off XLA's buffer assignment), while
XLA:GPU schedules against the device's memory limit (and rematerialises to meet it).

The bound, `layer_bound(config, policy)`: one decoder layer's forward and backward (under the
stage's remat policy) compiled alone on one device for one device's rows of a microbatch (the
microbatch's rows over the data-parallel devices, data x fsdp), with its weights full size as
an FSDP device holds them while the layer runs: XLA's temporaries of that program (the layer's
working set) + the layer's weights (gathered) + their gradients (full size, before the
reduce-scatter). Tensor parallelism is ignored (the bound errs towards more memory). A mixture of
experts layer counts its device's E / ep experts and its dispatch buffers (`_expert_parallel`).
It does not cover the embedding's or the head's work, which run before or after a stage's
layers.

Used by `cost_model.plan_compiled` for a plan that does not fit by the compiling backend's
temporaries when that backend is not the one that will run it: a group whose temporaries exceed
the bound is judged by the bound instead, and the printed plan says so (`describe`).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class LayerBound:
    """Bytes per device of one decoder layer run alone (see the module docstring)."""

    policy: str  # the remat policy it was compiled with
    rows: int  # batch rows per device
    working_bytes: int  # XLA's temporaries of the layer's forward + backward
    weight_bytes: int  # the layer's weights, full size
    grad_bytes: int  # their gradients, full size

    @property
    def total_bytes(self) -> int:
        return self.working_bytes + self.weight_bytes + self.grad_bytes


def layer_bound(config, policy: str) -> LayerBound:
    """`LayerBound` of `config`'s decoder layer under remat `policy` (compiled on one device,
    on abstract inputs: nothing is allocated)."""
    import jax
    import jax.numpy as jnp

    from MaxText.model import layers

    one = config.replace(remat_policy=policy, pipeline_stage_remat="")
    if config.is_moe:  # see `_expert_parallel`
        one = one.replace(moe_matmul="blocks")
    rows = max(1, config.microbatch_size // config.data_parallel_devices)
    length = config.max_target_length
    x = jax.ShapeDtypeStruct((rows, length, config.emb_dim), layers.dtype_of(config.dtype))
    positions = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    layer = layers.layer_class(one)(one)
    params = jax.eval_shape(layer.init, jax.random.key(0), x, positions)

    def loss(p, h, pos):
        out = layer.apply(p, h, pos)
        if config.is_moe:  # (hidden, routing statistics): the statistics feed the lb loss
            out, stats = out
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(stats)
        return jnp.sum(out.astype(jnp.float32))

    device = jax.devices()[0]
    with jax.default_device(device):
        exe = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, positions).compile()
    size = lambda tree: sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
    weights = size(params)
    working = int(exe.memory_analysis().temp_size_in_bytes)
    if config.is_moe:
        weights, working = _expert_parallel(config, params, weights, working, size)
    return LayerBound(policy, rows, working, weights, weights)


def _expert_parallel(config, params, weights: int, working: int, size) -> tuple[int, int]:
    """A MoE layer on one device of an expert-parallel group: it holds E / ep of the layer's
    experts (split over expert, gathered over fsdp only) and the layer's dispatch buffers, which
    the one-device program (no all-to-all) does not have. Its experts' per-row intermediates stay
    counted at the device's own T x k slots, where under expert parallelism it computes up to
    ep x C rows (`moe_costs.dispatch_bytes`' C): low there by up to ep x min(k, E / ep) / k.
    The experts run the `blocks` kernel here whatever the target's `moe_matmul`: its temporaries
    are a block of rows at a time, as a GPU's grouped GEMM (`ragged_dot`) holds little beyond its
    operands, while XLA:CPU lowers `ragged_dot` to a masked dense matmul holding E x the rows
    (Qwen3-30B-A3B, 128 experts, 2 rows of 4096 per device: a 330 GB "layer")."""
    from MaxText.planning import moe_costs

    mlp = params["params"]["mlp"]
    experts = size([mlp[n] for n in ("wi_0", "wi_1", "wo")])
    ep = config.mesh_expert
    return weights - experts + experts // ep, working + int(moe_costs.dispatch_bytes(config))


def judged_temp(xla_temp: float, bound: LayerBound | None) -> float:
    """A group's temporaries as the plan judges them: the compiler's own, or the per-layer
    bound where that is smaller."""
    return xla_temp if bound is None else min(xla_temp, bound.total_bytes)


def describe(bound: LayerBound, hardware: str, xla_temps, fmt) -> list[str]:
    """Lines for the printed plan: the bound, and each group judged by it."""
    lines = [
        f"temporaries: this host's compiler's, a proxy for {hardware}'s; per-layer bound "
        f"{fmt(bound.total_bytes)} (one layer's forward + backward compiled alone, remat "
        f"{bound.policy}, {bound.rows} row(s) per device: {fmt(bound.working_bytes)}, plus its "
        f"weights gathered {fmt(bound.weight_bytes)} and full-size gradients "
        f"{fmt(bound.grad_bytes)})"
    ]
    for group, temp in enumerate(xla_temps):
        if temp > bound.total_bytes:
            lines.append(
                f"  group {group}: this host's temporaries {fmt(temp)} are "
                f"{temp / bound.total_bytes:.1f}x the per-layer bound (its schedule holds "
                "several layers' work at once); judged by the bound"
            )
    return lines
