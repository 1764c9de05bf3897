"""The optimizer: global-norm clipping, then `opt_type` on a warmup + cosine learning-rate schedule.

Schedule over `learning_rate_schedule_steps` (S) with peak `learning_rate` (lr), as in MaxText:
linear warmup from 0 to lr over `warmup_steps_fraction * S` steps, cosine decay towards
`lr * learning_rate_final_fraction` at step S, and 0 from step S on.

`opt_type` (optax): `adamw` (default; `adam_b1`, `adam_b2`, `adam_eps`, `adam_weight_decay`,
first moment in `mu_dtype`), `adam` (the same without weight decay), `sgd` (plain), `adafactor`
(optax's defaults; `adam_weight_decay` as its decay rate). Weight decay applies to weight
matrices and embeddings, not to norm scales and biases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from MaxText.config import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
    total = max(config.learning_rate_schedule_steps, 1)
    warmup_cosine = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=int(config.warmup_steps_fraction * total),
        decay_steps=total,
        end_value=config.learning_rate * config.learning_rate_final_fraction,
    )
    return optax.join_schedules([warmup_cosine, optax.constant_schedule(0.0)], [total])


def _decay_mask(params):
    """True for weight matrices and embeddings; False for norm scales and biases."""

    def decays(path, _):
        # The last dict key names the parameter (flax partitioning boxes add a `.value` entry).
        name = [str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)][-1]
        return not (name == "scale" or name == "bias" or name.endswith("_bias"))

    return jax.tree_util.tree_map_with_path(decays, params)


def _base_optimizer(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
    mu_dtype = jnp.dtype(config.mu_dtype)
    if config.opt_type == "adamw":
        return optax.adamw(
            learning_rate=schedule,
            b1=config.adam_b1,
            b2=config.adam_b2,
            eps=config.adam_eps,
            weight_decay=config.adam_weight_decay,
            mu_dtype=mu_dtype,
            mask=_decay_mask,
        )
    if config.opt_type == "adam":
        return optax.adam(
            learning_rate=schedule,
            b1=config.adam_b1,
            b2=config.adam_b2,
            eps=config.adam_eps,
            mu_dtype=mu_dtype,
        )
    if config.opt_type == "sgd":
        return optax.sgd(learning_rate=schedule)
    if config.opt_type == "adafactor":
        return optax.adafactor(
            learning_rate=schedule,
            weight_decay_rate=config.adam_weight_decay or None,
            weight_decay_mask=_decay_mask,
        )
    raise AssertionError(f"opt_type {config.opt_type} passed config validation")


def make_optimizer(config: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(config)
    parts = []
    if config.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
    parts.append(_base_optimizer(config, schedule))
    return optax.chain(*parts), schedule
