"""The DPO step (`use_dpo=true`): preference pairs, a frozen reference model, one pipelined step.

    step(state, batch, reference) -> (state, metrics)

`batch` rows come in pairs (`prepare --format preference`, `doc_packing.pack_pairs`): row 2k is
pair k's chosen side, row 2k + 1 its rejected side, each masked to its response tokens. The
microbatches keep pairs whole (`pair_microbatches`; `use_dpo` needs an even microbatch size).

`reference` is the starting checkpoint's parameters (`Checkpoints.starting_params`), never
updated: no optimizer state, no gradient (it is not an argument of the differentiated function),
not donated, not checkpointed (a resumed run reads it again from `load_parameters_path`). In each
microbatch its log-probabilities come first, from a forward pass through the same model inside
`jaxpp.forward_pass()`: pipelined, that pass's stage-s work joins the `fwd_s` task, so each
stage's reference weights are read on the group of that stage's policy weights and the pass adds
no task and no backward work (tests/test_dpo.py counts the task instances); under `jax.jit` it
is the same function, unpipelined.

Loss (Rafailov et al. 2023, conservative form with label smoothing eps = `dpo_label_smoothing`),
with log-probabilities summed over each response's tokens:

    d = beta * ((pi(chosen) - ref(chosen)) - (pi(rejected) - ref(rejected)))
    loss = -(1 - eps) * log sigmoid(d) - eps * log sigmoid(-d)     (mean over the batch's pairs)

Metrics (besides the step's usual ones; `tokens` counts scored response tokens):
`dpo_chosen_reward` and `dpo_rejected_reward` (beta * (pi - ref), means over pairs),
`dpo_reward_margin` (their difference's mean) and `dpo_reward_accuracy` (share of pairs whose
chosen reward is higher). At the first step the policy is the reference: loss log 2, rewards 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxpp_integration as jaxpp

DPO_METRIC_KEYS = (
    "dpo_chosen_reward",
    "dpo_rejected_reward",
    "dpo_reward_margin",
    "dpo_reward_accuracy",
)


def pair_microbatches(x_BxL, num_microbatches: int):
    """[B, L] -> [M, B/M, L] keeping rows 2k and 2k + 1 together: microbatch i holds pairs
    i, M + i, 2M + i, ... (the trainer's interleaving, over pairs instead of rows)."""
    b = x_BxL.shape[0]
    pairs = x_BxL.reshape(b // 2 // num_microbatches, num_microbatches, 2, *x_BxL.shape[1:])
    pairs = jnp.swapaxes(pairs, 0, 1)  # [M, B/2M, 2, L]
    return pairs.reshape(num_microbatches, b // num_microbatches, *x_BxL.shape[1:])


def sequence_logprobs(logits_BxLxV, targets_BxL, mask_BxL):
    """Per row: the sum over the masked positions of log p(target), float32 [B]."""
    logits = logits_BxLxV.astype(jnp.float32)
    log_z_BxL = jax.nn.logsumexp(logits, axis=-1)
    target_BxL = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
    return jnp.sum((target_BxL - log_z_BxL) * mask_BxL.astype(jnp.float32), axis=-1)


def dpo_loss(policy_c, policy_r, ref_c, ref_r, beta: float, label_smoothing: float):
    """(per-pair loss, chosen reward, rejected reward); see the module doc."""
    chosen = beta * (policy_c - ref_c)
    rejected = beta * (policy_r - ref_r)
    d = chosen - rejected
    loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(d) - label_smoothing * jax.nn.log_sigmoid(
        -d
    )
    return loss, chosen, rejected


def make_logprob_fn(model, packed: bool) -> Callable:
    """(params, microbatch) -> per-row summed log-probabilities of the masked targets."""

    def logprobs(params, mb):
        if packed:
            logits = model.apply(
                {"params": params}, mb["inputs"], mb["inputs_position"], mb["inputs_segmentation"]
            )
        else:
            logits = model.apply({"params": params}, mb["inputs"])
        return sequence_logprobs(logits, mb["targets"], mb["targets_mask"])

    return logprobs


def make_dpo_train_step(
    config,
    model,
    optimizer: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    keys: tuple[str, ...],
    schedule: Any = None,
    grad_specs: Any = None,
) -> Callable:
    """The pure DPO step `(state, batch, reference) -> (state, metrics)`; `keys` are the batch
    keys (packed rows carry segment ids); `schedule`/`grad_specs` as for `make_train_step`."""
    logprobs = make_logprob_fn(model, "inputs_segmentation" in keys)
    beta, eps = config.dpo_beta, config.dpo_label_smoothing
    m = config.num_pipeline_microbatches

    def train_step(state, batch, reference):
        params = state["params"]
        microbatches = {k: pair_microbatches(batch[k], m) for k in keys}

        def microbatch(mb):
            with jaxpp.forward_pass():  # the reference's pass: forward only, same stages
                ref = jax.lax.stop_gradient(logprobs(reference, mb))

            def loss_fn(p):
                pi = logprobs(p, mb)
                loss, chosen, rejected = dpo_loss(
                    pi[0::2], pi[1::2], ref[0::2], ref[1::2], beta, eps
                )
                return jnp.sum(loss), (chosen, rejected)

            (loss_sum, (chosen, rejected)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params
            )
            sums = (
                jnp.asarray(chosen.size, jnp.float32),
                jnp.sum(mb["targets_mask"].astype(jnp.float32)),
                jnp.sum(chosen),
                jnp.sum(rejected),
                jnp.sum((chosen > rejected).astype(jnp.float32)),
            )
            return loss_sum, sums, grads

        loss_sum, sums, grads = jaxpp.treduce(
            microbatch,
            microbatches,
            schedule=schedule,
            operation=jaxpp.Add,
            out_specs=None if grad_specs is None else (None, None, grad_specs),
        )
        pairs, tokens, chosen, rejected, correct = sums
        pairs = jnp.maximum(pairs, 1.0)
        grads = jax.tree.map(lambda g: g / pairs, grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
        }
        raw_grad_norm = optax.tree.norm(grads)
        threshold = config.gradient_clipping_threshold
        metrics = {
            "loss": loss_sum / pairs,
            "grad_norm": jnp.minimum(raw_grad_norm, threshold) if threshold > 0 else raw_grad_norm,
            "raw_grad_norm": raw_grad_norm,
            "learning_rate": jnp.asarray(lr_schedule(state["step"]), jnp.float32),
            "tokens": tokens,
            "dpo_chosen_reward": chosen / pairs,
            "dpo_rejected_reward": rejected / pairs,
            "dpo_reward_margin": (chosen - rejected) / pairs,
            "dpo_reward_accuracy": correct / pairs,
        }
        return new_state, metrics

    return train_step


class ReferenceStep:
    """The compiled DPO step with its reference parameters bound: called as `step(state,
    batch, **kwargs)` like the trainer's other steps; every other attribute is the compiled
    step's (`report()`, `compile_stats`, `last_device_bytes`, ...).

    Pipelined, `place_like(params)` puts the reference where the policy's parameters are after
    the first step (each leaf on its stage's group, with its sharding), so later steps read it
    in place; until then it lives on the first group and the engine moves it."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.reference = None
        self._placed = False

    def set_reference(self, params) -> None:
        self.reference, self._placed = params, False

    def __call__(self, state, batch, **kwargs):
        assert self.reference is not None, "set the reference parameters first"
        state, metrics = self.compiled(state, batch, self.reference, **kwargs)
        if not self._placed:
            self.reference = place_like(self.reference, state["params"])
            self._placed = True
        return state, metrics

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def place_like(reference, params):
    """`reference` with each leaf where the matching leaf of `params` lives: the same groups and
    sharding for a pipelined step's `MpmdArray`s, the same sharding for `jax.Array`s."""

    def put(ref, like):
        if isinstance(ref, jaxpp.MpmdArray):  # read from a checkpoint straight onto its group
            if ref.mpmd_idxs == like.mpmd_idxs:
                return ref
            ref = ref.first_array
        if isinstance(like, jaxpp.MpmdArray):
            groups = {g: jax.device_put(ref, a.sharding) for g, a in like.arrays.items()}
            return jaxpp.MpmdArray(like.mpmd_mesh, groups, mpmd_idxs=like.mpmd_idxs)
        return jax.device_put(ref, like.sharding)

    return jax.tree.map(put, reference, params)
