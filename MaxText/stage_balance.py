"""Stage balancing: how many decoder layers each pipeline stage gets (`pipeline_stage_layers=auto`).

Input is a cost model of one stage as a function of its layer count, measured on the even split
by the planner (`MaxText.plan`):

- time: every layer costs the same per microbatch (forward + backward); the first stage also
  pays for the embedding, the last for the final norm, output head and loss (`extra_seconds`);
- memory per device: a stage's parameters, optimizer state and gradient accumulators grow by
  `state_bytes_per_layer` per layer, and its activations by `activation_bytes_per_layer[s]`,
  which differs per stage because the first stages keep more microbatches in flight (1F1B: p − s);
  everything else a group holds (`fixed_bytes[s]`) does not depend on its layer count.

`balance` returns the contiguous split that minimises the slowest stage (what bounds a pipeline
step: with m microbatches a 1F1B step takes about (m + p − 1) x the slowest stage), among the
splits whose predicted bytes fit `memory_bytes` on every group; each stage keeps >= 1 layer.
An exact dynamic programme over (stages, layers): O(stages x layers^2), instant for 80 layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per-stage linear costs; `group_of[s]` is the pipeline group that runs stage s."""

    seconds_per_layer: float
    extra_seconds: tuple  # per stage
    state_bytes_per_layer: float
    activation_bytes_per_layer: tuple  # per stage
    fixed_bytes: tuple  # per group
    group_of: tuple  # per stage

    def stage_seconds(self, stage: int, layers: int) -> float:
        return self.extra_seconds[stage] + layers * self.seconds_per_layer

    def stage_bytes(self, stage: int, layers: int) -> float:
        return layers * (self.state_bytes_per_layer + self.activation_bytes_per_layer[stage])

    def group_bytes(self, split: Sequence[int]) -> list[float]:
        out = list(self.fixed_bytes)
        for s, n in enumerate(split):
            out[self.group_of[s]] += self.stage_bytes(s, n)
        return out


def balance(costs: StageCosts, num_layers: int, memory_bytes: float) -> tuple[int, ...] | None:
    """The split minimising the slowest stage subject to memory, or None when none fits.

    Memory is checked per stage against the group's share when a group runs one stage; with
    several stages per group (virtual stages) the whole split is checked afterwards and, if it
    does not fit, the best split under a tighter per-stage budget is searched again."""
    num_stages = len(costs.extra_seconds)
    stages_per_group: dict = {}
    for g in costs.group_of:
        stages_per_group[g] = stages_per_group.get(g, 0) + 1
    budget_fraction = 1.0
    for _ in range(20):
        split = _best_split(
            costs, num_layers, num_stages, memory_bytes, stages_per_group, budget_fraction
        )
        if split is None:
            return None
        if all(b <= memory_bytes for b in costs.group_bytes(split)):
            return split
        budget_fraction *= 0.9
    return None


def _best_split(costs, num_layers, num_stages, memory_bytes, stages_per_group, fraction):
    def fits(stage: int, layers: int) -> bool:
        g = costs.group_of[stage]
        share = (memory_bytes - costs.fixed_bytes[g]) * fraction / stages_per_group[g]
        return costs.stage_bytes(stage, layers) <= share

    inf = math.inf
    # best[s][l]: smallest slowest-stage time of stages 0..s-1 covering l layers
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(num_stages):
        remaining = num_stages - s - 1
        for used in range(num_layers + 1):
            if best[s][used] == inf:
                continue
            for n in range(1, num_layers - used - remaining + 1):
                if not fits(s, n):
                    break  # bytes grow with n
                t = max(best[s][used], costs.stage_seconds(s, n))
                if t < best[s + 1][used + n]:
                    best[s + 1][used + n] = t
                    choice[s + 1][used + n] = n
    if best[num_stages][num_layers] == inf:
        return None
    split, used = [], num_layers
    for s in range(num_stages, 0, -1):
        n = choice[s][used]
        split.append(n)
        used -= n
    return tuple(reversed(split))


def parse_stage_layers(value: str, num_layers: int, num_stages: int) -> tuple[int, ...] | str:
    """'even' | 'auto' | '6,9,9,8' -> 'even', 'auto' or the counts; ValueError names the fix."""
    text = str(value).strip().lower()
    if text in ("even", "auto"):
        return text
    try:
        counts = tuple(int(x) for x in text.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(
            f"pipeline_stage_layers={value!r} is not 'even', 'auto' or a comma-separated list of "
            f"layer counts such as '{_example(num_layers, num_stages)}'"
        ) from None
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"pipeline_stage_layers={value!r} must list {num_stages} stage sizes (each >= 1) "
            f"summing to num_decoder_layers={num_layers}, e.g. "
            f"'{_example(num_layers, num_stages)}'"
        )
    return counts


def _example(num_layers: int, num_stages: int) -> str:
    base, extra = divmod(num_layers, num_stages)
    return ",".join(str(base + (1 if s < extra else 0)) for s in range(num_stages))
