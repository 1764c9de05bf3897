"""The decoder-only language model and its loss.

`Decoder(config)(tokens_BxL) -> logits_BxLxV` (float32): token embedding (plus learned positions for
the gpt block), `num_decoder_layers` decoder layers, final norm, output head (its own kernel, or the
transposed token embedding with `logits_via_embedding=true`). Packed rows pass `positions_BxL`
(restarting at 0 in every document) and `segment_ids_BxL` (1, 2, ... per document, 0 for padding):
attention then stays inside each document (`MaxText/model/attention.py`).

The only pipeline knowledge here is where stages end: when `config.num_stages > 1` the model calls
`jaxpp.pipeline_enter_stage` on the hidden state right after the last layer of every stage but the
last (`config.stage_layers` says how many layers each stage has). So the embedding lands in the
first stage and final norm, logits and the loss in the last. The markers sit between layers, at the
top level of the model, never inside a rematerialised layer; outside pipelined tracing they are the
identity. The hidden state between layers carries logical axis names (`activation_batch`, ...);
they constrain sharding only when the trainer activates the rules (SPMD), no-ops otherwise.
Layers are unrolled (`layers_0`, `layers_1`, ...) unless `scan_layers=true`: then each stage's
layers run as one `nn.scan` over weights stacked with a leading layer axis, `layers` (no stages)
or `layers_stage_<s>` (one per stage, see `scanned_blocks`), and the markers sit between the stage
scans. Remat wraps the scanned layer, so the policy applies inside the scan; each stage has its
own policy (`config.stage_remat`). `init_params` gives
every layout the same initial values (sliced from one stacked initialisation), and
`MaxText/checkpoint/layout.py` maps every layout to one on-disk tree.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxpp_integration as jaxpp
from MaxText.config import Config
from MaxText.model import layers
from MaxText.model.attention import soft_capped
from MaxText.model.params import dtype_of, fan_in_init
from MaxText.model.registry import family_of


class Decoder(nn.Module):
    """`Decoder(config)(tokens_BxL) -> logits_BxLxV`. Decoding with a KV cache (`init_cache`;
    unrolled layers only): `(tokens_BxL, positions_BxL, cache=cache) -> (logits, new cache)`,
    the tokens being the ones at `positions_BxL` (consecutive within a row)."""

    config: Config

    @nn.compact
    def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None, cache=None):
        c = self.config
        if cache is not None and c.scan_layers:
            raise ValueError("decoding with a KV cache needs scan_layers=false (unrolled layers)")
        family = family_of(c)
        dtype, wdtype = dtype_of(c.dtype), dtype_of(c.weight_dtype)
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)

        embedding_VxE = self.param(
            "token_embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            (c.vocab_size, c.emb_dim),
            wdtype,
        )
        # FSDP: gather the table's embed axis before the lookup (as for every other weight).
        table_VxE = nn.with_logical_constraint(
            embedding_VxE, ("activation_vocab", "activation_embed")
        )
        x_BxLxE = jnp.take(table_VxE, tokens_BxL, axis=0).astype(dtype)
        if family.scale_embedding:  # Gemma: x sqrt(E), the factor rounded to the activation dtype
            x_BxLxE = x_BxLxE * jnp.asarray(c.emb_dim**0.5, dtype)
        if not family.rope:  # a learned position table instead
            position_PxE = self.param(
                "position_embedding",
                nn.with_logical_partitioning(nn.initializers.normal(0.02), ("position", "embed")),
                (c.max_target_length, c.emb_dim),
                wdtype,
            )
            x_BxLxE = x_BxLxE + jnp.take(position_PxE, positions_BxL, axis=0).astype(dtype)
        x_BxLxE = _constrain(x_BxLxE)

        stage_ends = set(_stage_ends(c.stage_layers)) if c.num_stages > 1 else set()
        windows = family.layer_windows(c)
        if c.scan_layers:
            for stage, (name, first, count) in enumerate(scanned_blocks(c)):
                x_BxLxE = _constrain(
                    self._scan(name, stage, windows[first : first + count], x_BxLxE,
                               positions_BxL, segment_ids_BxL)
                )  # fmt: skip
                if first + count - 1 in stage_ends:
                    x_BxLxE = jaxpp.pipeline_enter_stage(x_BxLxE)
        else:
            stage = 0
            new_cache = []
            for i in range(c.num_decoder_layers):
                layer_cls = layers.layer_class(c, stage=stage)
                layer = layer_cls(c, window=windows[i], name=f"layers_{i}")
                if cache is not None:
                    x_BxLxE, layer_cache = layer(x_BxLxE, positions_BxL, segment_ids_BxL, cache[i])
                    new_cache.append(layer_cache)
                    continue
                x_BxLxE = _constrain(layer(x_BxLxE, positions_BxL, segment_ids_BxL))
                if i in stage_ends:
                    x_BxLxE = jaxpp.pipeline_enter_stage(x_BxLxE)
                    stage += 1

        x_BxLxE = layers.norm_for(c, "decoder_norm")(x_BxLxE)
        if c.logits_via_embedding:
            head_ExV = embedding_VxE.T
        else:
            head_ExV = self.param(
                "logits_kernel",
                nn.with_logical_partitioning(fan_in_init(), ("embed", "vocab")),
                (c.emb_dim, c.vocab_size),
                wdtype,
            )
        logits_BxLxV = jnp.einsum(
            "ble,ev->blv", x_BxLxE, head_ExV.astype(dtype), preferred_element_type=jnp.float32
        )
        logits_BxLxV = soft_capped(logits_BxLxV, c.final_logits_soft_cap)  # Gemma 2
        return logits_BxLxV if cache is None else (logits_BxLxV, new_cache)

    def _scan(self, name: str, stage: int, windows, x_BxLxE, *per_token_args):
        """The layers of `stage` as one `nn.scan` over weights stacked under `name` (leading
        axis = layer). `per_token_args` (positions, segment ids) are broadcast to every layer.
        `windows` (one per layer): when the model's layers differ (Gemma 2's local and global
        layers), a scanned int32 input of the one layer program; else the layers' attribute."""
        per_layer = len(set(family_of(self.config).layer_windows(self.config))) > 1
        scanned = nn.scan(
            layers.layer_class(self.config, scanned=True, stage=stage),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast,) * len(per_token_args) + ((0,) if per_layer else ()),
            length=len(windows),
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        extra = (jnp.asarray(windows, jnp.int32),) if per_layer else ()
        layer = scanned(self.config, window=0 if per_layer else windows[0], name=name)
        x_BxLxE, _ = layer(x_BxLxE, *per_token_args, *extra)
        return x_BxLxE


def init_cache(config: Config, batch: int, length: int) -> list[dict[str, jax.Array]]:
    """An empty KV cache of `length` slots per row, one {"key", "value"} [B, T, K, D] per layer
    (in `dtype`, as the keys and values the layers compute)."""
    shape = (batch, length, config.num_kv_heads, config.head_dim)
    dtype = dtype_of(config.dtype)
    return [
        {"key": jnp.zeros(shape, dtype), "value": jnp.zeros(shape, dtype)}
        for _ in range(config.num_decoder_layers)
    ]


def scanned_blocks(config: Config) -> list[tuple[str, int, int]]:
    """(parameter name, first layer, layer count) of each scan of a `scan_layers=true` model:
    one `layers` scan over all layers without stages; with stages one `layers_stage_<s>` per
    stage, so that each stage's stacked weights are leaves of their own (on their own group)."""
    if config.num_stages <= 1:
        return [("layers", 0, config.num_decoder_layers)]
    blocks, first = [], 0
    for s, count in enumerate(config.stage_layers):
        blocks.append((f"layers_stage_{s}", first, count))
        first += count
    return blocks


def canonical_init_config(config: Config) -> Config:
    """The config whose model initialises parameters for every layout of `config`: all layers
    in one scan (`layers`, leading axis = layer), no stages, no remat (none change values)."""
    return dataclasses.replace(
        config,
        scan_layers=True,
        remat_policy="none",
        stage_remat=("none",),
        ici_pipeline_parallelism=1,
        dcn_pipeline_parallelism=1,
        mesh_pipeline=1,
        num_pipeline_repeats=1,
        num_stages=1,
        stage_layers=(config.num_decoder_layers,),
    )


def canonical_init(config: Config, rng, tokens_BxL):
    """Boxed initial parameters with every layer stacked under `layers`, the same program for
    every layout of `config` (so the same values: compile it on its own, see `init_params`)."""
    return Decoder(canonical_init_config(config)).init(rng, tokens_BxL)["params"]


def init_params(model: Decoder, rng, tokens_BxL, canonical=None):
    """The model's boxed parameters for `rng`, the same values in every layer layout.

    Every layout starts from `canonical_init` (layers stacked, one scan: its cost does not grow
    with depth) and takes its leaves from there: layer i as `layers_i` (unrolled), or stage s's
    slice of the stack as `layers_stage_<s>`. Pass `canonical` (unboxed) computed by a program of
    its own when the values must be bitwise equal across layouts: XLA:CPU fuses the random
    number generation with whatever consumes it, and the slicing differs by layout.
    """
    c = model.config
    if canonical is None:
        canonical = nn.unbox(canonical_init(c, rng, tokens_BxL))
    boxes = dict(jax.eval_shape(model.init, rng, tokens_BxL)["params"])
    if c.scan_layers:
        blocks = {name: slice(first, first + n) for name, first, n in scanned_blocks(c)}
    else:
        blocks = {f"layers_{i}": i for i in range(c.num_decoder_layers)}
    out = {}
    for name, box in boxes.items():
        if name in blocks:
            index = blocks[name]
            values = jax.tree.map(lambda x, index=index: x[index], canonical["layers"])
        else:
            values = canonical[name]
        out[name] = jax.tree.map(_rebox, box, values, is_leaf=_is_box)
    return out


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _rebox(box, value):
    return box.replace_boxed(value) if _is_box(box) else value


def _constrain(x_BxLxE):
    """Names the hidden state's axes; a sharding constraint only where rules are active (SPMD)."""
    return nn.with_logical_constraint(
        x_BxLxE, ("activation_batch", "activation_length", "activation_embed")
    )


def _stage_ends(stage_layers: tuple[int, ...]) -> list[int]:
    """Index of the last layer of every stage except the last one."""
    ends, total = [], 0
    for n in stage_layers[:-1]:
        total += n
        ends.append(total - 1)
    return ends


def cross_entropy_sums(logits_BxLxV, targets_BxL, mask_BxL):
    """(sum of masked token losses, number of counted tokens), both float32 scalars.

    Sums rather than means, so microbatched sums add up to the full-batch sum and the loss is
    normalised once by the total token count.
    """
    logits = logits_BxLxV.astype(jnp.float32)
    log_z_BxL = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BxL = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
    mask = mask_BxL.astype(jnp.float32)
    return jnp.sum((log_z_BxL - target_logit_BxL) * mask), jnp.sum(mask)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
