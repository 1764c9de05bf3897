"""The decoder-only language model and its loss.

`Decoder(config)(tokens_BxL) -> logits_BxLxV` (float32): token embedding (plus learned positions for
the gpt block), `num_decoder_layers` decoder layers, final norm, output head (its own kernel, or the
transposed token embedding with `logits_via_embedding=true`). Packed rows pass `positions_BxL`
(restarting at 0 in every document) and `segment_ids_BxL` (1, 2, ... per document, 0 for padding):
attention then stays inside each document (`MaxText/attention.py`).

The only pipeline knowledge here is where stages end: when `config.num_stages > 1` the model calls
`jaxpp.pipeline_enter_stage` on the hidden state right after the last layer of every stage but the
last (`config.stage_layers` says how many layers each stage has). So the embedding lands in the
first stage and final norm, logits and the loss in the last. The markers sit between layers, at the
top level of the model, never inside a rematerialised layer; outside pipelined tracing they are the
identity. The hidden state between layers carries logical axis names (`activation_batch`, ...);
they constrain sharding only when the trainer activates the rules (SPMD), no-ops otherwise.
Layers are unrolled (`layers_0`, `layers_1`, ...) unless `scan_layers=true`, which stacks them
under `layers` with a leading layer axis (SPMD only; config validation enforces that).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import jaxpp_integration as jaxpp
from MaxText import layers
from MaxText.config import Config


class Decoder(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
        c = self.config
        dtype, wdtype = layers.dtype_of(c.dtype), layers.dtype_of(c.weight_dtype)
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
        if c.decoder_block == "gpt":
            position_PxE = self.param(
                "position_embedding",
                nn.with_logical_partitioning(nn.initializers.normal(0.02), ("position", "embed")),
                (c.max_target_length, c.emb_dim),
                wdtype,
            )
            x_BxLxE = x_BxLxE + jnp.take(position_PxE, positions_BxL, axis=0).astype(dtype)
        x_BxLxE = _constrain(x_BxLxE)

        if c.scan_layers:
            x_BxLxE = self._scanned_layers(x_BxLxE, positions_BxL, segment_ids_BxL)
        else:
            layer_cls = layers.layer_class(c)
            stage_ends = set(_stage_ends(c.stage_layers)) if c.num_stages > 1 else set()
            for i in range(c.num_decoder_layers):
                x_BxLxE = _constrain(
                    layer_cls(c, name=f"layers_{i}")(x_BxLxE, positions_BxL, segment_ids_BxL)
                )
                if i in stage_ends:
                    x_BxLxE = jaxpp.pipeline_enter_stage(x_BxLxE)

        x_BxLxE = layers.norm_for(c, "decoder_norm")(x_BxLxE)
        if c.logits_via_embedding:
            head_ExV = embedding_VxE.T
        else:
            head_ExV = self.param(
                "logits_kernel",
                nn.with_logical_partitioning(layers.fan_in_init(), ("embed", "vocab")),
                (c.emb_dim, c.vocab_size),
                wdtype,
            )
        return jnp.einsum(
            "ble,ev->blv", x_BxLxE, head_ExV.astype(dtype), preferred_element_type=jnp.float32
        )

    def _scanned_layers(self, x_BxLxE, positions_BxL, segment_ids_BxL):
        c = self.config
        scanned = nn.scan(
            layers.layer_class(c, scanned=True),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=c.num_decoder_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x_BxLxE, _ = scanned(c, name="layers")(x_BxLxE, positions_BxL, segment_ids_BxL)
        return x_BxLxE


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
