"""Schedule and microbatch choice (`pipeline_schedule=auto`, `num_pipeline_microbatches=auto`).

From one planned configuration (`MaxText.plan`: the trainer's step compiled on abstract inputs)
this predicts, without compiling again, the step time and per-group peak bytes of every
candidate (schedule, virtual stages per group, microbatch count) and picks the fastest candidate
that fits memory. The model, all of it read off the planned configuration:

- a layer costs the same time per token in every candidate: a task's time scales with its
  stage's layers and with the microbatch size (m0 / m of the planned one); the first stage adds
  the embedding, the last the output head and loss (`stage_balance.StageCosts`); the forward /
  backward ratio is the planned one's, and a split backward (ZeroBubble) halves the backward into
  input- and weight-gradient parts;
- the simulator (`jaxpp_integration.schedules.simulate`) replays each candidate's schedule with
  those task times; work outside the loop (the optimizer) does not depend on the schedule;
- memory per group = what the planned group holds besides activations and temporaries, plus
  temporaries scaled by the microbatch size, plus forward activations: the simulator's peak
  in-flight (stage, microbatch) count on that group x bytes per layer per microbatch token x the
  layers of a stage there.

It ignores that small microbatches run below the peak's efficiency (so it favours many
microbatches less than a GPU would disfavour them only when they are tiny) and it does not model
the DualPipeV overlap of forward and backward; the planned candidate itself is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpp_integration.schedules import Phase, schedule_from_name
from jaxpp_integration.schedules.simulate import Costs, simulate

ONE_STAGE_PER_GROUP = ("gpipe", "1f1b", "eager_1f1b", "zero_bubble")


@dataclasses.dataclass(frozen=True)
class Candidate:
    schedule: str
    repeats: int  # virtual stages per group
    microbatches: int
    step_time_s: float
    bubble: float
    peak_bytes: tuple  # per group
    fits: bool

    def describe(self) -> str:
        v = f", {self.repeats} stages per group" if self.repeats > 1 else ""
        return (
            f"{self.schedule}{v}, {self.microbatches} microbatches: predicted step "
            f"{self.step_time_s:.3g} s, bubble {100 * self.bubble:.1f}%, largest peak "
            f"{max(self.peak_bytes) / 1e9:.3g} GB" + ("" if self.fits else " (does not fit)")
        )


@dataclasses.dataclass(frozen=True)
class Baseline:
    """What a planned configuration tells about per-layer costs (see the module docstring)."""

    num_groups: int
    num_layers: int
    microbatches: int
    global_batch: int
    data_parallel: int  # data x fsdp: a microbatch must split over them
    seconds_per_layer: float  # forward + backward, per planned microbatch
    first_extra_s: float
    last_extra_s: float
    fwd_fraction: float  # forward share of a stage's time
    transfer_s: float  # one stage boundary, per planned microbatch
    outside_s: float  # before/after-loop work (slowest group)
    activation_bytes_per_layer: float  # one (layer, planned microbatch)
    other_bytes: tuple  # per group: peak minus activations and temporaries
    temp_bytes: tuple  # per group, planned microbatch


def stage_layer_split(num_layers: int, num_stages: int) -> list[int]:
    from MaxText.config import stage_layer_counts

    return list(stage_layer_counts(num_layers, num_stages))


def predict(base: Baseline, name: str, repeats: int, m: int, memory_bytes: float) -> Candidate:
    p = base.num_groups
    num_stages = p * repeats
    schedule = schedule_from_name(name, num_stages, p)
    layers = stage_layer_split(base.num_layers, num_stages)
    scale = base.microbatches / m  # task time and activations per microbatch
    per_task = {}
    for s, n in enumerate(layers):
        t = n * base.seconds_per_layer
        t += base.first_extra_s if s == 0 else 0.0
        t += base.last_extra_s if s == num_stages - 1 else 0.0
        t *= scale
        fwd, bwd = t * base.fwd_fraction, t * (1 - base.fwd_fraction)
        per_task[(Phase.FWD, s)] = fwd
        per_task[(Phase.BWD, s)] = bwd
        per_task[(Phase.BWD_I, s)] = bwd / 2
        per_task[(Phase.BWD_W, s)] = bwd / 2
    costs = Costs(transfer=base.transfer_s * scale, per_task=per_task)
    sim = simulate(schedule, m, costs)
    peaks = []
    for r in range(p):
        stages = [s for s in range(num_stages) if schedule.stage_to_rank(s) == r]
        mean_layers = sum(layers[s] for s in stages) / len(stages)
        act = sim.peak_live_activations[r] * mean_layers * base.activation_bytes_per_layer * scale
        peaks.append(base.other_bytes[r] + base.temp_bytes[r] * scale + act)
    return Candidate(
        schedule=name,
        repeats=repeats,
        microbatches=m,
        step_time_s=sim.makespan + base.outside_s,
        bubble=sim.bubble,
        peak_bytes=tuple(int(b) for b in peaks),
        fits=all(b <= memory_bytes for b in peaks),
    )


def candidates(base: Baseline, schedules: Sequence[str], microbatches: Sequence[int]):
    """(schedule, repeats, m) triples the trainer accepts for this batch and depth."""
    p = base.num_groups
    out = []
    for name in schedules:
        for repeats in (1,) if name in ONE_STAGE_PER_GROUP else (2,):
            if base.num_layers < p * repeats:
                continue
            for m in microbatches:
                if base.global_batch % (m * base.data_parallel):
                    continue
                if name == "interleaved_1f1b" and m % p:
                    continue
                if name == "dualpipev" and m < p * repeats:
                    continue
                out.append((name, repeats, m))
    return out


def choose(
    base: Baseline, memory_bytes: float, schedules: Sequence[str], microbatches: Sequence[int]
) -> list[Candidate]:
    """Every candidate, best first: those that fit by predicted step time, then the rest."""
    found = [predict(base, *c, memory_bytes) for c in candidates(base, schedules, microbatches)]
    return sorted(found, key=lambda c: (not c.fits, c.step_time_s))


def microbatch_options(base: Baseline) -> list[int]:
    """p, 2p, 4p, 8p and 16p microbatches (the usual range), as the batch allows."""
    return [k * base.num_groups for k in (1, 2, 4, 8, 16)]
