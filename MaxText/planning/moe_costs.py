"""What a mixture-of-experts model costs, as the planner sees it (`MaxText/model/moe.py` is what
runs). Per device and per MoE layer unless said otherwise; T = the tokens of one microbatch on one
device (its rows x max_target_length), E experts, k per token, G = E / ep on a device, D = emb_dim,
F = moe_mlp_dim, b = bytes of `dtype`.

- Parameters: total, and active per token (the router, k of the E experts of every layer, and
  everything else): `param_counts`.
- FLOPs, forward, balanced routing (each expert gets T x k / E of every device's slots):
  router 2·T·D·E + experts k·T·(2·D·F·2 + 2·F·D); backward twice that (`layer_flops`). The
  compiled programs count the experts' work at the dispatch capacity instead (the `blocks`
  kernel's padded blocks; `ragged_dot` not at all: its rows depend on the routing), so the
  planner replaces what `counted_expert_flops` finds in a task by these (`flops_correction`).
- Memory: the device's experts, 3·G·D·F (÷ tensor) in `weight_dtype` per layer of its stages
  (`expert_bytes`, in the plan's parameters already); the dispatch buffers of one layer, the send
  and receive buffers [ep, C, D + 1] and the returned outputs [ep, C, D] twice, C = T·min(k, G):
  the most one device can send another, so dropless (`dispatch_bytes`, in XLA's temporaries).
- All-to-all: 2 per MoE layer forward and 2 backward (+2 recomputed under full remat), launches
  per step read off the compiled programs' HLO, each moving one buffer, [ep, C, D + 1] or
  [ep, C, D] in `dtype` (`all_to_all_bytes`: the pair's mean per launch; XLA:CPU carries
  bfloat16 all-to-alls as float32, which a GPU does not, so the HLO's own bytes would double a
  GPU plan's); (ep - 1) / ep of it crosses the links inside the group (`Hardware.ici_gbps`):
  `all_to_all_seconds`. The planner adds
  it to the task's time (no overlap with compute: the forward/backward overlap of DualPipe-style
  schedules is a later issue), and reports its share of the step.
"""

from __future__ import annotations

import functools
import math

from MaxText.planning.hardware import GB, Hardware


def tokens_per_device(config) -> float:
    """T: one microbatch's tokens on one device (the batch is split over data x fsdp x expert)."""
    return config.microbatch_size / config.data_parallel_devices * config.max_target_length


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def param_counts(config) -> tuple[int, int]:
    """(total, active per token) parameters of a MoE config's model."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from MaxText.model import Decoder, canonical_init_config

    model = Decoder(canonical_init_config(config))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes["params"])))
    if not config.is_moe:
        return total, total
    per_expert = 3 * config.emb_dim * config.moe_mlp_dim
    idle = config.num_experts - config.num_experts_per_tok
    return total, total - config.num_decoder_layers * idle * per_expert


def layer_flops(config) -> tuple[float, float]:
    """(forward, backward) FLOPs of one MoE layer's router and experts on one device's tokens of
    one microbatch, routing balanced."""
    t, d, f = tokens_per_device(config), config.emb_dim, config.moe_mlp_dim
    e, k = config.num_experts, config.num_experts_per_tok
    forward = 2 * t * d * e + k * t * (2 * d * f * 2 + 2 * f * d) / config.mesh_tensor
    return forward, 2 * forward


@functools.lru_cache(maxsize=32)
def counted_expert_flops(config) -> tuple[float, float]:
    """(forward, backward) matmul FLOPs the engine's count (`matmul_flops`) finds in one MoE
    layer's grouped expert compute on one device: what the compiled programs hold at the
    dispatch capacity, traced on its own at the device's shapes."""
    import jax
    import jax.numpy as jnp

    from jaxpp_integration.tools.report import matmul_flops
    from MaxText.model import moe

    t, d, f = int(tokens_per_device(config)), config.emb_dim, config.moe_mlp_dim
    ep, k = config.mesh_expert, config.num_experts_per_tok
    groups = config.num_experts // ep
    rows = t * k if ep == 1 else ep * moe.capacity(t, k, groups)
    dtype = jnp.dtype(config.dtype)
    f_tp = f // config.mesh_tensor
    x = jax.ShapeDtypeStruct((rows, d), dtype)
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    w_in = jax.ShapeDtypeStruct((groups, d, f_tp), dtype)
    w_out = jax.ShapeDtypeStruct((groups, f_tp, d), dtype)
    matmul = moe.resolve_matmul(config.moe_matmul)

    def ffn(x, sizes, wg, wu, wd):
        return moe.expert_ffn(x, sizes, wg, wu, wd, matmul)

    def grads(x, sizes, wg, wu, wd):
        y, vjp = jax.vjp(lambda *a: ffn(a[0], sizes, *a[1:]), x, wg, wu, wd)
        return vjp(y)

    forward = matmul_flops(jax.make_jaxpr(ffn)(x, sizes, w_in, w_in, w_out).jaxpr)
    both = matmul_flops(jax.make_jaxpr(grads)(x, sizes, w_in, w_in, w_out).jaxpr)
    return forward, both - forward


def flops_correction(config, phase: str, layers: int, recompute: bool) -> float:
    """FLOPs per device to add to a loop task of `layers` MoE layers in `phase` ("fwd", "bwd",
    "bwdI", "bwdW": `Phase.value`): the balanced routing's expert work in place of the dispatch
    capacity's (only the experts: the router's matmul is in the program as it will run)."""
    t, d, f = tokens_per_device(config), config.emb_dim, config.moe_mlp_dim
    k = config.num_experts_per_tok
    active = k * t * (2 * d * f * 2 + 2 * f * d) / config.mesh_tensor
    counted_fwd, counted_bwd = counted_expert_flops(config)
    fwd, bwd = active - counted_fwd, 2 * active - counted_bwd
    per_layer = {"fwd": fwd, "bwd": bwd + (fwd if recompute else 0.0)}
    per_layer["bwdI"] = per_layer["bwdW"] = per_layer["bwd"] / 2
    return layers * per_layer[phase]


def expert_bytes(config, layers: int) -> float:
    """The experts' weights one device holds for `layers` MoE layers."""
    per_layer = 3 * config.num_experts // config.mesh_expert * config.emb_dim * config.moe_mlp_dim
    return layers * per_layer / config.mesh_tensor * _bytes(config.weight_dtype)


def dispatch_bytes(config) -> float:
    """One MoE layer's dispatch buffers on one device (see the module docstring); 0 without
    expert parallelism (the slots are then sorted in place)."""
    from MaxText.model import moe

    ep = config.mesh_expert
    if ep == 1:
        return 0.0
    t, d, k = int(tokens_per_device(config)), config.emb_dim, config.num_experts_per_tok
    cap = moe.capacity(t, k, config.num_experts // ep)
    return ep * cap * (2 * (d + 1) + 2 * d) * _bytes(config.dtype)


def all_to_all_bytes(config) -> float:
    """Bytes per device of one all-to-all of a MoE layer: the mean of the dispatch buffer
    [ep, C, D + 1] and the returned one [ep, C, D] in `dtype` (they come in pairs)."""
    from MaxText.model import moe

    ep = config.mesh_expert
    t, d, k = int(tokens_per_device(config)), config.emb_dim, config.num_experts_per_tok
    cap = moe.capacity(t, k, config.num_experts // ep)
    return ep * cap * (d + 0.5) * _bytes(config.dtype)


def all_to_all_seconds(nbytes: float, ep: int, hardware: Hardware) -> float:
    """Time of all-to-alls whose results total `nbytes` on one device: (ep - 1) / ep of it
    crosses the group's links."""
    return nbytes * (ep - 1) / ep / (hardware.ici_gbps * GB) if ep > 1 else 0.0
