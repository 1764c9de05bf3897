"""The mixture-of-experts feed-forward block: routing, dropless grouped expert compute, and
expert parallelism (token-slots dispatched to their experts' devices with `all_to_all`).

Routing (Mixtral's and Qwen3-MoE's): router logits `x W_gate` in float32 over all E experts,
softmax over all E, the top k probabilities (`num_experts_per_tok`) and their experts;
`normalize` (`norm_topk_prob`: Qwen3-MoE's flag; Mixtral always does) divides the k weights by
their sum.
Each of the T tokens makes k token-slots; slot (t, j) goes to expert `ids[t, j]` and the output
is `sum_j weight[t, j] * expert_j(x_t)`, expert e a SwiGLU `(silu(x Wg_e) * (x Wu_e)) Wd_e`.

**Dropless**: every token-slot reaches its expert, whatever the routing. The slots are sorted by
expert and the experts run on their own rows only ("grouped"), never a dense einsum of every
token through every expert. `matmul` picks the grouped kernel:

- `blocks` (CPU): each expert's sorted rows are padded to whole blocks of `block` rows, and one
  `scan` over the blocks multiplies each block by its expert's weights, skipping the blocks past
  the last used one; a custom VJP accumulates the weight gradients in place, block by block.
  Work is (slots + experts x block) rows x FLOPs per row. (`jax.lax.ragged_dot` on XLA:CPU is
  a masked dense matmul over every expert, E/k times the work.)
- `ragged_dot` (GPU): three `jax.lax.ragged_dot`s on the sorted rows (XLA's grouped GEMM).

**Expert parallelism** (`moe_ffn`): when the active logical-axis rules map `exp` to a mesh axis
of size ep > 1, the experts are split over it (E / ep per device) and token rows over the batch
axes (`activation_batch`, which include it). Inside a `shard_map` over the mesh each device
routes its own T tokens, sorts its S = T x k slots by expert and writes them to a fixed send
buffer [ep, C, d + 1] per destination device, C = T x min(k, E / ep): the most slots one device
can ever send to another, so nothing is dropped (on average a pair carries T x k / ep, so the
buffer is ep x min(k, E/ep) / k times the mean; ep x for k <= E/ep). The extra column carries each
slot's expert on the destination (as a float, exact for ids up to 256 in bfloat16), so the
dispatch is ONE `all_to_all`; the destination sorts what it received by expert, runs the grouped
experts and sends the outputs back with a second `all_to_all` into the same slots. Gradients
flow back through the same two collectives (their transposes), so a MoE layer costs 2
all-to-alls forward and 2 backward.

The expert weights enter the `shard_map` broadcast over the non-expert batch axes (data, fsdp),
so each device returns its own partial weight gradient [D, ...] and the sum over D is an
ordinary `reduce_sum` outside: the pipeline engine defers it to once per step like any other
gradient sum over data rows (`gradient_reduction`), and plain `jax.jit` all-reduces it. The
router's logits are computed outside on rows (an SPMD einsum with a replicated weight); softmax,
top-k and the load-balancing statistics inside, per token (XLA's SPMD top-k would gather the
rows), the statistics summed over the devices there (one all-reduce of 2 x E floats). Without
active rules (a single device, the `jax.jit` reference) the same per-device code runs on all
tokens, with no collectives.

**Load balancing** (Switch Transformer; Hugging Face's Mixtral `load_balancing_loss_func`):
each MoE layer returns `stats` [2, E] float32: token-slots routed to expert i (row 0) and the sum
over tokens of its router probability (row 1). The model adds them over its MoE layers (pooled
over layers, as Hugging Face concatenates every layer's router logits), and
`load_balance_loss(stats, tokens x layers)` = E * sum_i f_i P_i with f_i = slots_i / (T L) (the
f_i sum to k) and P_i = prob_sum_i / (T L). It is a product of means, so it is computed per
microbatch (T = the microbatch's tokens); the train step averages it over microbatches.

Shapes: T tokens, S slots (T x k), E experts (G on one device), D model width, F expert width,
R rows of a grouped call, N blocks of B rows.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

MOE_MATMULS = ("blocks", "ragged_dot")
MAX_BLOCK_ROWS = 512


# ------------------------------------------------------------------ routing and its statistics


def route(logits_TxE, k: int, normalize: bool):
    """(weights [T, k] float32, ids [T, k] int32, probs [T, E] float32) from router logits:
    softmax over all experts in float32, the top k, renormalised to sum 1 if `normalize`."""
    probs_TxE = jax.nn.softmax(logits_TxE.astype(jnp.float32), axis=-1)
    weights_TxK, ids_TxK = jax.lax.top_k(probs_TxE, k)
    if normalize:
        weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
    return weights_TxK, ids_TxK.astype(jnp.int32), probs_TxE


def routing_stats(probs_TxE, ids_TxK):
    """[2, E] float32: token-slots routed to each expert, and each expert's summed probability."""
    num_experts = probs_TxE.shape[-1]
    one_hot_SxE = jax.nn.one_hot(ids_TxK.reshape(-1), num_experts, dtype=jnp.float32)
    counts_E = jnp.sum(one_hot_SxE, axis=0)
    probs_E = jnp.sum(probs_TxE.reshape(-1, num_experts), axis=0)
    return jnp.stack([jax.lax.stop_gradient(counts_E), probs_E])


def load_balance_loss(stats_2xE, routed_tokens):
    """E * sum_i f_i P_i, f_i = slots_i / n, P_i = prob_sum_i / n, n = `routed_tokens` (tokens x
    MoE layers the stats were added over). Balanced routing gives k; all on k experts gives E."""
    num_experts = stats_2xE.shape[-1]
    f_E = stats_2xE[0] / routed_tokens
    p_E = stats_2xE[1] / routed_tokens
    return num_experts * jnp.sum(f_E * p_E)


# ------------------------------------------------------------------ grouped expert compute


def block_rows(rows: int, groups: int) -> int:
    """Rows per block of the `blocks` kernel: a power of two near half the mean group (so the
    padding, at most a block per group, stays under half the rows), between 8 and 512."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(max(8, 1 << max((mean // 2).bit_length() - 1, 0)), MAX_BLOCK_ROWS))


def _block_layout(group_sizes_G, rows: int, block: int):
    """Where each sorted row goes in the padded block buffer: (position [R] (N x B for rows past
    the groups: dropped), group of each block [N], blocks in use) with N = ceil(R / B) + G."""
    groups = group_sizes_G.shape[0]
    n_blocks = -(-rows // block) + groups
    ends = jnp.cumsum(group_sizes_G)
    padded = (group_sizes_G + block - 1) // block * block
    padded_ends = jnp.cumsum(padded)
    row = jnp.arange(rows)
    group = jnp.searchsorted(ends, row, side="right", method="compare_all")
    g = jnp.minimum(group, groups - 1)
    offset = row - (ends[g] - group_sizes_G[g])
    position = jnp.where(group < groups, padded_ends[g] - padded[g] + offset, n_blocks * block)
    starts = jnp.arange(n_blocks) * block
    block_group = jnp.searchsorted(padded_ends, starts, side="right", method="compare_all")
    return position, jnp.minimum(block_group, groups - 1), padded_ends[-1] // block


def resolve_matmul(name: str) -> str:
    """`moe_matmul`: auto -> ragged_dot on GPU, blocks elsewhere."""
    if name == "auto":
        return "ragged_dot" if jax.default_backend() == "gpu" else "blocks"
    return name


def _swiglu(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


@jax.custom_vjp
def _blocks_swiglu(x_NxBxD, group_N, used, wg_GxDxF, wu_GxDxF, wd_GxFxD):
    """Block j (j < used) through expert group_N[j]'s SwiGLU; later blocks stay zero.

    A skipped block holds only padding (zeros), so `x * w[0, 0]` is its zero output, and it
    varies over the same manual mesh axes as the computed one (inside a `shard_map` both
    branches of the `cond` must)."""

    def step(_, xs):
        j, x, g = xs
        y = jax.lax.cond(
            j < used,
            lambda: _swiglu(x, wg_GxDxF[g], wu_GxDxF[g], wd_GxFxD[g]),
            lambda: x * wd_GxFxD[g][0, 0],
        )
        return None, y

    n = x_NxBxD.shape[0]
    return jax.lax.scan(step, None, (jnp.arange(n), x_NxBxD, group_N))[1]


def _blocks_swiglu_fwd(x, group, used, wg, wu, wd):
    return _blocks_swiglu(x, group, used, wg, wu, wd), (x, group, used, wg, wu, wd)


def _blocks_swiglu_bwd(residuals, dy_NxBxD):
    """Recomputes each used block's hidden values and adds its weight gradients into its
    expert's slice of the accumulators (in place in the scan's carry)."""
    x_NxBxD, group_N, used, wg, wu, wd = residuals

    def step(carry, xs):
        j, x, g, dy = xs

        def grads(carry):
            dwg, dwu, dwd = carry
            a, b, c = wg[g], wu[g], wd[g]
            gate, up = x @ a, x @ b
            sig = jax.nn.sigmoid(gate)
            act = gate * sig
            dh = dy @ c.T
            dup = dh * act
            dgate = dh * up * (sig * (1 + gate * (1 - sig)))
            dwd = dwd.at[g].add((act * up).T @ dy)
            dwg = dwg.at[g].add(x.T @ dgate)
            dwu = dwu.at[g].add(x.T @ dup)
            return (dwg, dwu, dwd), dgate @ a.T + dup @ b.T

        skip = lambda c: (c, x * (dy[0, 0] * wg[g][0, 0]))  # noqa: E731  (zeros: see forward)
        return jax.lax.cond(j < used, grads, skip, carry)

    n = x_NxBxD.shape[0]
    zeros = (jnp.zeros_like(wg), jnp.zeros_like(wu), jnp.zeros_like(wd))
    (dwg, dwu, dwd), dx = jax.lax.scan(step, zeros, (jnp.arange(n), x_NxBxD, group_N, dy_NxBxD))
    return dx, None, None, dwg, dwu, dwd


_blocks_swiglu.defvjp(_blocks_swiglu_fwd, _blocks_swiglu_bwd)


def expert_ffn(x_RxD, group_sizes_G, wg_GxDxF, wu_GxDxF, wd_GxFxD, matmul: str, block=None):
    """SwiGLU of each expert on its rows: `x_RxD` sorted by group, group g holding the next
    `group_sizes_G[g]` rows; rows past the groups come out zero. `matmul`: blocks | ragged_dot."""
    if matmul == "ragged_dot":
        gate = jax.lax.ragged_dot(x_RxD, wg_GxDxF, group_sizes_G)
        up = jax.lax.ragged_dot(x_RxD, wu_GxDxF, group_sizes_G)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, wd_GxFxD, group_sizes_G)
    if matmul != "blocks":
        raise ValueError(f"moe_matmul={matmul} is not one of {' | '.join(MOE_MATMULS)}")
    rows, d = x_RxD.shape
    groups = group_sizes_G.shape[0]
    block = block or block_rows(rows, groups)
    position_R, group_N, used = _block_layout(group_sizes_G, rows, block)
    n_blocks = group_N.shape[0]
    x_flat = jnp.zeros((n_blocks * block, d), x_RxD.dtype).at[position_R].set(x_RxD, mode="drop")
    y_NxBxD = _blocks_swiglu(
        x_flat.reshape(n_blocks, block, d), group_N, used, wg_GxDxF, wu_GxDxF, wd_GxFxD
    )
    return jnp.take(y_NxBxD.reshape(-1, d), position_R, axis=0, mode="fill", fill_value=0)


# ------------------------------------------------------------------ one device's tokens


def _inverse(order_S):
    """The permutation undoing `order_S` (x[order][inverse] == x)."""
    return jnp.argsort(order_S)


def _counts(ids, length: int):
    """How many of `ids` equal 0, 1, ..., length - 1 (ids >= length are not counted)."""
    return jnp.sum(ids[:, None] == jnp.arange(length, dtype=ids.dtype), axis=0, dtype=jnp.int32)


def capacity(tokens: int, k: int, local_experts: int) -> int:
    """Slots one device's buffer for one destination holds: the most it can ever send there
    (each token sends at most one slot to an expert, and k in all)."""
    return tokens * min(k, local_experts)


def experts_local(x_TxD, weights_TxK, ids_TxK, wg, wu, wd, *, matmul, expert_axis=None, ep=1):
    """The MoE output [T, D] for one device's T tokens (all tokens without parallelism).

    `wg`/`wu` [G, D, F], `wd` [G, F, D] are this device's G experts; with `expert_axis` (inside a
    `shard_map`, ep devices) expert e lives on device e // G and the slots travel there and back
    by `all_to_all` in fixed [ep, C, D + 1] buffers (see the module docstring)."""
    tokens, k = ids_TxK.shape
    d = x_TxD.shape[-1]
    local = wg.shape[0]
    slots_S = ids_TxK.reshape(-1)
    order_S = jnp.argsort(slots_S, stable=True)  # by expert, so by destination device too
    sorted_ids_S = slots_S[order_S]
    x_SxD = jnp.take(x_TxD, order_S // k, axis=0)
    if ep == 1:
        sizes_G = _counts(slots_S, local)
        y_SxD = expert_ffn(x_SxD, sizes_G, wg, wu, wd, matmul)
    else:
        y_SxD = _dispatched(x_SxD, sorted_ids_S, wg, wu, wd, matmul, expert_axis, ep, tokens, k)
    y_TxKxD = jnp.take(y_SxD, _inverse(order_S), axis=0).reshape(tokens, k, d)
    out = jnp.einsum("tk,tkd->td", weights_TxK, y_TxKxD.astype(jnp.float32))
    return out.astype(x_TxD.dtype)


def _dispatched(x_SxD, sorted_ids_S, wg, wu, wd, matmul, axis, ep, tokens, k):
    """Sorted slots -> their experts' devices -> expert outputs back in the same order."""
    slots, d = x_SxD.shape
    local = wg.shape[0]
    cap = capacity(tokens, k, local)
    dest_S = sorted_ids_S // local
    per_dest = _counts(dest_S, ep)
    starts = jnp.cumsum(per_dest) - per_dest
    pos_S = jnp.arange(slots) - starts[dest_S]
    expert_col = (sorted_ids_S % local).astype(x_SxD.dtype)[:, None]
    send = jnp.zeros((ep, cap, d + 1), x_SxD.dtype).at[:, :, d].set(local)  # pad: no expert
    send = send.at[dest_S, pos_S].set(jnp.concatenate([x_SxD, expert_col], axis=1))
    recv = jax.lax.all_to_all(send, axis, split_axis=0, concat_axis=0, tiled=True)
    recv = checkpoint_name(recv, "moe_dispatch")
    rows = recv.reshape(ep * cap, d + 1)
    rid_R = rows[:, d].astype(jnp.int32)
    order_R = jnp.argsort(rid_R, stable=True)
    y_R = expert_ffn(rows[order_R, :d], _counts(rid_R, local), wg, wu, wd, matmul)
    y_back = jnp.take(y_R, _inverse(order_R), axis=0).reshape(ep, cap, d)
    back = jax.lax.all_to_all(y_back, axis, split_axis=0, concat_axis=0, tiled=True)
    back = checkpoint_name(back, "moe_return")
    return back[dest_S, pos_S]


# ------------------------------------------------------------------ over the mesh


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """How the active rules and mesh split a MoE block: the mesh axes token rows are split over
    (`batch`), the expert axis among them (or None), the axis the expert width is split over
    (`tensor`, or None), and their sizes."""

    batch: tuple
    expert: str | None
    tensor: str | None
    sizes: dict

    @property
    def ep(self) -> int:
        return self.sizes[self.expert] if self.expert else 1

    @property
    def replica_axes(self) -> tuple:
        """Batch axes that are not the expert axis: the weights' partial gradients' axes."""
        return tuple(a for a in self.batch if a != self.expert)


def _mesh_axes(logical: str) -> tuple:
    entry = tuple(nn.logical_to_mesh_axes((logical,)))[0]
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def expert_split() -> ExpertSplit | None:
    """The split of the current trace (active logical-axis rules and `jax.set_mesh` mesh), or
    None when nothing is split (no mesh, no rules, or every axis of size 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    sizes = dict(mesh.shape)
    batch = tuple(a for a in _mesh_axes("activation_batch") if a in sizes)
    expert = [a for a in _mesh_axes("exp") if a in sizes and sizes[a] > 1]
    tensor = [a for a in _mesh_axes("mlp") if a in sizes and sizes[a] > 1]
    if len(expert) > 1 or len(tensor) > 1:
        raise ValueError(f"the MoE block splits experts over one axis, got {expert}, {tensor}")
    if expert and expert[0] not in batch:
        raise ValueError(f"the expert axis {expert[0]} must also split the batch ({batch})")
    split = ExpertSplit(batch, expert[0] if expert else None, tensor[0] if tensor else None, sizes)
    if math.prod(sizes[a] for a in batch) == 1 and split.tensor is None:
        return None
    return split


def moe_ffn(x_BxLxD, logits_BxLxE, wg, wu, wd, *, k: int, normalize: bool, matmul: str):
    """(output [B, L, D], routing statistics [2, E]) of the MoE block from its router logits:
    `route` and `experts_local` on every device's rows, the experts split over the expert axis
    and the rows over the batch axes of the current mesh (a `shard_map`), or on all rows when
    nothing is split. `wg`/`wu` [E, D, F], `wd` [E, F, D] in the compute dtype."""
    d = x_BxLxD.shape[-1]
    split = expert_split()

    def local(x, logits, wg, wu, wd, axis=None, ep=1, tensor=None):
        rows = x.shape[0] * x.shape[1]
        weights, ids, probs = route(logits.reshape(rows, -1), k, normalize)
        stats = routing_stats(probs, ids)
        if tensor is not None:  # tokens meet width slices: their gradient is summed over them
            x = jax.lax.pcast(x, (tensor,), to="varying")
        out = experts_local(
            x.reshape(rows, d), weights, ids, wg, wu, wd, matmul=matmul, expert_axis=axis, ep=ep
        )
        if tensor is not None:  # each device holds a slice of every expert's width
            out = jax.lax.psum(out, tensor)
        return out.reshape(x.shape), stats

    if split is None:
        return local(x_BxLxD, logits_BxLxE, wg, wu, wd)
    replicas = split.replica_axes
    n = math.prod(split.sizes[a] for a in replicas)
    rows = PartitionSpec(split.batch)
    first = (replicas,) if replicas else ()
    up_spec = PartitionSpec(*first, split.expert, None, split.tensor)
    down_spec = PartitionSpec(*first, split.expert, split.tensor, None)
    if replicas:  # one copy per replica: each returns its own partial weight gradient
        wg, wu, wd = (jnp.broadcast_to(w, (n, *w.shape)) for w in (wg, wu, wd))

    def body(x, logits, wg, wu, wd):
        if replicas:
            wg, wu, wd = wg[0], wu[0], wd[0]
        out, stats = local(x, logits, wg, wu, wd, split.expert, split.ep, split.tensor)
        return out, jax.lax.psum(stats, split.batch)  # over every device's tokens

    return jax.shard_map(
        body,
        in_specs=(rows, rows, up_spec, up_spec, down_spec),
        out_specs=(rows, PartitionSpec()),
    )(x_BxLxD, logits_BxLxE, wg, wu, wd)


# ------------------------------------------------------------------ the flax block


def _expert_init():
    """Truncated normal with variance 1 / fan_in per expert ([E, in, out], E a batch axis)."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
    )


class MoeBlock(nn.Module):
    """`(x_BxLxD) -> (y_BxLxD, stats_2xE)`: router `gate` [D, E] and experts `wi_0` (gate) and
    `wi_1` (up) [E, D, F], `wo` (down) [E, F, D] (MaxText's names and logical axes). Config:
    `num_experts`, `num_experts_per_tok`, `moe_mlp_dim`, `norm_topk_prob`,
    `moe_matmul`, `dtype`, `weight_dtype`."""

    config: object
    input_kernels = 2  # gate and up kernels before the activation (the planner's FLOPs count)

    @nn.compact
    def __call__(self, x_BxLxD):
        c = self.config
        dtype, wdtype = jnp.dtype(c.dtype), jnp.dtype(c.weight_dtype)
        e, d, f, k = c.num_experts, c.emb_dim, c.moe_mlp_dim, c.num_experts_per_tok

        def param(name, init, shape, axes):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, wdtype)

        router_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        gate_DxE = param("gate", router_init, (d, e), ("embed", None))
        wg = param("wi_0", _expert_init(), (e, d, f), ("exp", "embed", "mlp"))
        wu = param("wi_1", _expert_init(), (e, d, f), ("exp", "embed", "mlp"))
        wd = param("wo", _expert_init(), (e, f, d), ("exp", "mlp", "embed"))

        x = x_BxLxD.astype(dtype)
        logits_BxLxE = jnp.einsum(
            "bld,de->ble", x.astype(jnp.float32), gate_DxE.astype(jnp.float32)
        )  # the router in float32
        logits_BxLxE = nn.with_logical_constraint(
            logits_BxLxE, ("activation_batch", "activation_length", None)
        )
        out, stats = moe_ffn(
            x,
            logits_BxLxE,
            wg.astype(dtype),
            wu.astype(dtype),
            wd.astype(dtype),
            k=k,
            normalize=c.norm_topk_prob,
            matmul=resolve_matmul(c.moe_matmul),
        )
        return checkpoint_name(out, "mlpwo"), stats
