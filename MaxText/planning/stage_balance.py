"""Stage balancing: how many decoder layers each pipeline stage gets (`pipeline_stage_layers=auto`).

Input is a cost model of one stage as a function of its layer count, measured on the even split
by the planner (`MaxText.plan`):

- time: every layer costs the same per microbatch (forward + backward); the first stage also
  pays for the embedding, the last for the final norm, output head and loss (`extra_seconds`);
- memory per device: a stage's parameters, optimizer state and gradient accumulators (and, when
  its group peaks in the optimizer, their updated copies) grow by `state_bytes_per_layer[s]`
  per layer, and its activations by `activation_bytes_per_layer[s]`,
  which differs per stage because the first stages keep more microbatches in flight (1F1B: p − s);
  everything else a group holds (`fixed_bytes[s]`) does not depend on its layer count.

`balance` returns the contiguous split that minimises the slowest stage (what bounds a pipeline
step: with m microbatches a 1F1B step takes about (m + p − 1) x the slowest stage), among the
splits whose predicted bytes fit `memory_bytes` on every group; each stage keeps >= 1 layer.
An exact dynamic programme over (stages, layers): O(stages x layers^2), instant for 80 layers.

With `remat_policy=auto` the split and the remat policy of every stage are chosen together
(`balance_with_options`, as AdaPipe does): each stage may run its layers under any policy
(`LayerOption`: seconds and activation bytes per layer), and for n layers on stage s the
fastest policy whose bytes fit is the one to use, so the same programme decides both. Among the
splits whose slowest stage is as fast, a second pass takes the least total time (the least
recompute), then the most even stage times. A first stage holding p microbatches may so get
fewer layers and lighter remat rather than full remat on an equal share.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class LayerOption:
    """One way a stage can run its layers (a remat policy): per layer and microbatch, seconds
    (forward + backward, recomputation included) and activation bytes on the stage's group;
    `temp_bytes`: XLA's temporaries of the stage's tasks under this option with `temp_layers`
    layers, taken to grow in proportion with more layers and never to shrink with fewer."""

    policy: str
    seconds: float
    activation_bytes: float
    temp_bytes: float = 0.0
    temp_layers: int = 1


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per-stage linear costs; `group_of[s]` is the pipeline group that runs stage s.

    `options[s]`, when given, lists the ways stage s may run its layers (`LayerOption`, one per
    remat policy: `remat_choice.stage_options`); without it every stage runs as measured
    (`seconds_per_layer`, `activation_bytes_per_layer[s]`)."""

    seconds_per_layer: float
    extra_seconds: tuple  # per stage
    state_bytes_per_layer: tuple  # per stage
    activation_bytes_per_layer: tuple  # per stage
    fixed_bytes: tuple  # per group
    group_of: tuple  # per stage
    options: tuple = ()  # per stage: tuple of LayerOption

    def stage_options(self, stage: int) -> tuple[LayerOption, ...]:
        if self.options:
            return self.options[stage]
        return (LayerOption("", self.seconds_per_layer, self.activation_bytes_per_layer[stage]),)

    def stage_seconds(self, stage: int, layers: int, option: LayerOption | None = None) -> float:
        option = option or self.stage_options(stage)[0]
        return self.extra_seconds[stage] + layers * option.seconds

    def stage_bytes(self, stage: int, layers: int, option: LayerOption | None = None) -> float:
        option = option or self.stage_options(stage)[0]
        per_layer = self.state_bytes_per_layer[stage] + option.activation_bytes
        return layers * per_layer + option.temp_bytes * max(1.0, layers / option.temp_layers)

    def group_bytes(self, split: Sequence[int], options: Sequence | None = None) -> list[float]:
        out = list(self.fixed_bytes)
        for s, n in enumerate(split):
            out[self.group_of[s]] += self.stage_bytes(s, n, options[s] if options else None)
        return out


@dataclasses.dataclass(frozen=True)
class Balanced:
    """A split and, per stage, the option its layers run with."""

    split: tuple[int, ...]
    options: tuple[LayerOption, ...]

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(o.policy for o in self.options)


def balance(costs: StageCosts, num_layers: int, memory_bytes: float) -> tuple[int, ...] | None:
    """The split minimising the slowest stage subject to memory, or None when none fits."""
    found = balance_with_options(costs, num_layers, memory_bytes)
    return None if found is None else found.split


def balance_with_options(
    costs: StageCosts, num_layers: int, memory_bytes: float
) -> Balanced | None:
    """The split, and an option per stage, minimising the slowest stage subject to memory (among
    the splits as fast, the least total time: the least recompute); None when none fits.

    Memory is checked per stage against the group's share when a group runs one stage; with
    several stages per group (virtual stages) the whole split is checked afterwards and, if it
    does not fit, the best split under a tighter per-stage budget is searched again."""
    num_stages = len(costs.extra_seconds)
    stages_per_group: dict = {}
    for g in costs.group_of:
        stages_per_group[g] = stages_per_group.get(g, 0) + 1
    budget_fraction = 1.0
    for _ in range(20):
        found = _best_split(
            costs, num_layers, num_stages, memory_bytes, stages_per_group, budget_fraction
        )
        if found is None:
            return None
        if all(b <= memory_bytes for b in costs.group_bytes(found.split, found.options)):
            return found
        budget_fraction *= 0.9
    return None


def _best_split(costs, num_layers, num_stages, memory_bytes, stages_per_group, fraction):
    def fastest_fitting(stage: int, layers: int) -> LayerOption | None:
        g = costs.group_of[stage]
        share = (memory_bytes - costs.fixed_bytes[g]) * fraction / stages_per_group[g]
        fitting = [
            o for o in costs.stage_options(stage) if costs.stage_bytes(stage, layers, o) <= share
        ]
        return min(fitting, key=lambda o: (o.seconds, o.activation_bytes), default=None)

    # option[s][n]: how stage s runs n layers (None: n layers do not fit there, nor more)
    option = [[None] * (num_layers + 1) for _ in range(num_stages)]
    for s in range(num_stages):
        for n in range(1, num_layers - num_stages + 2):
            option[s][n] = fastest_fitting(s, n)
            if option[s][n] is None:
                break  # bytes grow with n under every option

    def seconds(s: int, n: int) -> float:
        return costs.stage_seconds(s, n, option[s][n])

    def search(combine, limit=math.inf):
        """best[s][l]: the best value (a tuple, compared in order) of stages 0..s-1 covering l
        layers, each stage at most `limit` seconds; `combine(value so far, stage seconds)`."""
        none = (math.inf,)
        best = [[none] * (num_layers + 1) for _ in range(num_stages + 1)]
        choice = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
        best[0][0] = (0.0, 0.0)
        for s in range(num_stages):
            remaining = num_stages - s - 1
            for used in range(num_layers + 1):
                if best[s][used] == none:
                    continue
                for n in range(1, num_layers - used - remaining + 1):
                    if option[s][n] is None:
                        break
                    t = seconds(s, n)
                    if t > limit:
                        continue
                    value = combine(best[s][used], t)
                    if value < best[s + 1][used + n]:
                        best[s + 1][used + n] = value
                        choice[s + 1][used + n] = n
        if best[num_stages][num_layers] == none:
            return None
        split, used = [], num_layers
        for s in range(num_stages, 0, -1):
            split.append(choice[s][used])
            used -= choice[s][used]
        return best[num_stages][num_layers], tuple(reversed(split))

    fastest = search(lambda v, t: (max(v[0], t),))
    if fastest is None:
        return None
    # Among the splits whose slowest stage is that fast: the least total time (recompute), then
    # the most even stage times (least sum of squares), so layers move only where it helps.
    _, split = search(lambda v, t: (v[0] + t, v[1] + t * t), limit=fastest[0][0] * (1 + 1e-9))
    return Balanced(split, tuple(option[s][n] for s, n in enumerate(split)))
