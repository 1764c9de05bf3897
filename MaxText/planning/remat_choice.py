"""Rematerialisation per pipeline stage under a memory budget (`remat_policy=auto`).

The first stages of a pipeline keep more microbatches in flight than the last (1F1B: p - s), so
one policy for every stage either wastes recompute on the last stages or does not fit on the
first. `remat_policy=auto` picks a policy per stage: on every group, the assignment with the least
recomputed FLOPs whose predicted peak fits the device.

Two inputs:

- `layer_profile(config)`: per policy, what one decoder layer saves for its backward pass (the
  residuals JAX keeps, `jax_compat.saved_residuals`, plus the layer's input, which the next
  layer's backward needs whatever the policy) and the FLOPs of its forward + backward including
  recomputation (the matmuls of the gradient's jaxpr, where recomputed forward work appears),
  for one sequence of `max_target_length` tokens. Abstract: nothing is allocated or compiled.
- a plan measured with known policies (`MaxText.plan`): each group's peak and activation bytes.

Group g's activations change by what its stages save per microbatch row:
    act_g(P) = act_g(B) + live_g x rows x mean over its stages s of n_s (a(P_s) - a(B_s))
(B = the policies the plan was measured with, n_s layers of stage s, live_g the microbatches
(x stages) in flight on g at its peak from the simulator, rows = one microbatch's rows per
device); its predicted peak is peak_g(B) - act_g(B) + act_g(P). Tensor parallelism, which
shards part of a layer's residuals, is ignored: the prediction errs towards more memory. The
planner compiles the chosen policies again to check them (`MaxText.planning.auto.plan_remat_auto`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from MaxText.config.pipeline import REMAT_POLICIES

# Beyond this many assignments for one group (5 ** stages), its stages share one policy.
MAX_ASSIGNMENTS = 4096


@dataclasses.dataclass(frozen=True)
class PolicyCost:
    """One decoder layer under one policy, per sequence (one batch row)."""

    saved_bytes: int  # kept from forward to backward, the layer's input included
    flops: float  # forward + backward, recomputation included


@dataclasses.dataclass(frozen=True)
class RematChoice:
    policies: tuple[str, ...]  # per stage
    peak_bytes: tuple[float, ...]  # predicted, per group
    fits: bool
    recompute_fraction: float  # extra layer FLOPs over remat_policy=none
    step_s: float = 0.0  # the plan's predicted step with these policies
    full_step_s: float = 0.0  # ... and with remat full on every stage (0: not planned)


def layer_profile(config) -> dict[str, PolicyCost]:
    """`PolicyCost` of every remat policy for `config`'s decoder layer (abstract evaluation)."""
    import jax
    import jax.numpy as jnp

    from jaxpp_integration.jax_compat import saved_residuals
    from MaxText.model import layers
    from MaxText.planning.flops import matmul_flops

    length = config.max_target_length
    x = jax.ShapeDtypeStruct((1, length, config.emb_dim), layers.dtype_of(config.dtype))
    positions = jax.ShapeDtypeStruct((1, length), jnp.int32)
    x_bytes = length * config.emb_dim * x.dtype.itemsize  # the layer's input
    out = {}
    for policy in REMAT_POLICIES:
        one = config.replace(remat_policy=policy, pipeline_stage_remat="")
        layer = layers.layer_class(one)(one)
        params = jax.eval_shape(layer.init, jax.random.key(0), x, positions)

        def apply(p, h, pos, layer=layer):
            return layer.apply(p, h, pos)

        def loss(p, h, pos, apply=apply):
            return jnp.sum(apply(p, h, pos).astype(jnp.float32))

        saved = sum(
            math.prod(aval.shape) * aval.dtype.itemsize
            for aval, is_argument in saved_residuals(apply, params, x, positions)
            if not is_argument
        )
        grad = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x, positions)
        out[policy] = PolicyCost(saved + x_bytes, matmul_flops(grad.jaxpr))
    return out


def by_recompute(profile: dict[str, PolicyCost]) -> list[str]:
    """Policies from the least recompute to the most (ties: the one saving less first)."""
    return sorted(profile, key=lambda p: (profile[p].flops, profile[p].saved_bytes))


def predict_activation(
    measured: float,
    units: float,
    layers_of: Sequence[int],
    measured_policies: Sequence[str],
    policies: Sequence[str],
    profile: dict[str, PolicyCost],
) -> float:
    """One group's activation bytes under `policies` from `measured` under `measured_policies`
    (`units` = microbatch rows in flight per stage: live x rows; see the module doc)."""
    delta = sum(
        n * (profile[p].saved_bytes - profile[b].saved_bytes)
        for n, b, p in zip(layers_of, measured_policies, policies)
    )
    return measured + units * delta / len(layers_of)


def choose(
    profile: dict[str, PolicyCost],
    stage_layers: Sequence[int],
    group_of: Sequence[int],
    measured_policies: Sequence[str],
    peak_bytes: Sequence[float],
    activation_bytes: Sequence[float],
    units: Sequence[float],
    memory_bytes: float,
) -> RematChoice:
    """Per group, the policies of its stages with the least recompute that fit `memory_bytes`
    (the most memory-saving ones if none does; `fits` is then False)."""
    order = by_recompute(profile)
    policies = list(measured_policies)
    peaks = list(peak_bytes)
    fits = True
    for g in range(len(peak_bytes)):
        stages = [s for s, owner in enumerate(group_of) if owner == g]
        n = [stage_layers[s] for s in stages]
        base = [measured_policies[s] for s in stages]
        if len(order) ** len(stages) <= MAX_ASSIGNMENTS:
            options = list(itertools.product(order, repeat=len(stages)))
        else:
            options = [(p,) * len(stages) for p in order]
        best = None
        for option in options:
            act = predict_activation(activation_bytes[g], units[g], n, base, option, profile)
            peak = peak_bytes[g] - activation_bytes[g] + act
            extra = sum(k * profile[p].flops for k, p in zip(n, option))
            key = (peak > memory_bytes, extra if peak <= memory_bytes else peak, peak)
            if best is None or key < best[0]:
                best = (key, option, peak)
        _, option, peak = best
        fits = fits and peak <= memory_bytes
        peaks[g] = peak
        for s, p in zip(stages, option):
            policies[s] = p
    none = profile["none"].flops * sum(stage_layers)
    spent = sum(n * profile[p].flops for n, p in zip(stage_layers, policies))
    return RematChoice(tuple(policies), tuple(peaks), fits, spent / none - 1.0)


def with_policy_options(
    costs,
    profile: dict[str, PolicyCost],
    stage_layers: Sequence[int],
    measured_policies: Sequence[str],
    units: Sequence[float],
    group_temp_bytes: Sequence[float],
    temp_bytes: dict[str, float] | None = None,
    activation_scale: dict[str, float] | None = None,
):
    """`costs` (a `stage_balance.StageCosts` measured on `stage_layers` with `measured_policies`)
    with a `LayerOption` per remat policy on every stage, for choosing split and remat together.

    Seconds per layer scale with the policy's FLOPs (`seconds_per_layer` was measured on the
    middle stages, or on the first of two); activation bytes per layer are the policy's saved
    bytes x the microbatch rows in flight on the stage (`units[g]`, its group's, shared by the
    group's stages); what a group's measured activations hold beyond its layers' (the
    embedding's output, the logits) moves to its fixed bytes, so at the measured split and
    policies the bytes are the measured ones. XLA's temporaries differ by policy (a lighter
    policy may need more: XLA:CPU's for Llama 2 70B are 9 GB larger under `minimal` than under
    `full`) and are taken to grow with a stage's layers (they did by ~2 GB a layer there before
    issue 37; a scanned stage's are now flat, so this errs towards more memory):
    `temp_bytes[policy]` holds those measured so far (a group's largest task), a policy not
    measured counts as the largest of them, and a stage's option carries its group's measured
    temporaries plus the policy's excess over the measured policy's, growing in proportion with
    more layers. Likewise XLA
    may keep more per layer than the residuals JAX names: `activation_scale[policy]` is measured
    / predicted activation bytes of the plans compiled so far (`activation_scales`), the largest
    for a policy not measured."""
    from MaxText.planning.stage_balance import LayerOption

    num_stages = len(stage_layers)
    policies = by_recompute(profile)
    temp_bytes = dict(temp_bytes or {})
    unknown = max(temp_bytes.values(), default=0.0)
    scale = dict(activation_scale or {})
    unknown_scale = max(scale.values(), default=1.0)

    def saved(policy: str) -> float:
        return profile[policy].saved_bytes * scale.get(policy, unknown_scale)

    reference = range(1, num_stages - 1) if num_stages > 2 else range(1)
    ref_flops = sum(stage_layers[s] * profile[measured_policies[s]].flops for s in reference)
    seconds_per_flop = costs.seconds_per_layer * sum(stage_layers[s] for s in reference) / ref_flops
    stages_on = [costs.group_of.count(g) for g in range(len(costs.fixed_bytes))]
    extra, fixed, options = list(costs.extra_seconds), list(costs.fixed_bytes), []
    for g, temp in enumerate(group_temp_bytes):  # the options carry the temporaries now
        fixed[g] -= temp
    for s, (n, b) in enumerate(zip(stage_layers, measured_policies)):
        g = costs.group_of[s]
        rows = units[g] / stages_on[g]
        # the stage's layers under b cost n * flops(b), not n * seconds_per_layer
        extra[s] = max(
            0.0, extra[s] + n * (costs.seconds_per_layer - seconds_per_flop * profile[b].flops)
        )
        fixed[g] += n * (costs.activation_bytes_per_layer[s] - rows * saved(b))
        own = group_temp_bytes[g] / stages_on[g]
        excess = {
            p: max(0.0, temp_bytes.get(p, unknown) - temp_bytes.get(b, own)) for p in policies
        }
        options.append(
            tuple(
                LayerOption(
                    p, seconds_per_flop * profile[p].flops, rows * saved(p), own + excess[p], n
                )
                for p in policies
            )
        )
    return dataclasses.replace(
        costs, extra_seconds=tuple(extra), fixed_bytes=tuple(fixed), options=tuple(options)
    )


def activation_scales(profile: dict[str, PolicyCost], plans) -> dict[str, float]:
    """Per policy, a compiled plan's activation bytes over what `profile` predicts for them
    (layers x microbatch rows in flight x saved bytes), the largest over the groups whose
    stages all ran that policy; groups holding no first or last stage only, where there are
    such (the embedding's output and the logits are not a layer's)."""
    out: dict[str, float] = {}
    for plan in plans:
        costs, rows = plan.stage_costs, plan.rows_per_microbatch
        edge = {costs.group_of[0], costs.group_of[-1]}
        groups = [g for g in plan.groups if g.group not in edge] or plan.groups
        for g in groups:
            stages = [s for s, owner in enumerate(costs.group_of) if owner == g.group]
            policies = {plan.stage_remat[s] for s in stages}
            layers = sum(plan.stage_layers[s] for s in stages)
            units = plan.live_microbatches[g.group] * rows / len(stages)
            if len(policies) != 1 or not units or not g.activation_bytes:
                continue
            (p,) = policies
            ratio = g.activation_bytes / (layers * units * profile[p].saved_bytes)
            out[p] = max(out.get(p, 0.0), ratio)
    return out


def heavier(policy: str, profile: dict[str, PolicyCost]) -> str:
    """The next policy saving less than `policy` (itself when none does)."""
    saved = profile[policy].saved_bytes
    less = [p for p in by_recompute(profile) if profile[p].saved_bytes < saved]
    return min(less, key=lambda p: profile[p].flops) if less else policy
