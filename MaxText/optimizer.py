"""The optimizer: global-norm clipping, then AdamW on a warmup + cosine learning-rate schedule.

Schedule over `learning_rate_schedule_steps` (S) with peak `learning_rate` (lr):
linear warmup from 0 to lr over `warmup_steps_fraction * S` steps, cosine decay to
`lr * learning_rate_final_fraction` at step S, then that final value for any later step.
Weight decay applies to weight matrices and embeddings, not to norm scales and biases.
"""

from __future__ import annotations

import jax
import optax

from MaxText.config import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
    total = max(config.learning_rate_schedule_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=int(config.warmup_steps_fraction * total),
        decay_steps=total,
        end_value=config.learning_rate * config.learning_rate_final_fraction,
    )


def _decay_mask(params):
    """True for weight matrices and embeddings; False for norm scales and biases."""

    def decays(path, _):
        # The last dict key names the parameter (flax partitioning boxes add a `.value` entry).
        name = [str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)][-1]
        return not (name == "scale" or name == "bias" or name.endswith("_bias"))

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(config)
    parts = []
    if config.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
    parts.append(
        optax.adamw(
            learning_rate=schedule,
            b1=config.adam_b1,
            b2=config.adam_b2,
            eps=config.adam_eps,
            weight_decay=config.adam_weight_decay,
            mask=_decay_mask,
        )
    )
    return optax.chain(*parts), schedule
