"""Stage balancing (`pipeline_stage_layers=auto`): the dynamic programme against brute force over
every contiguous split, and the `pipeline_stage_layers` key."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.config.pipeline import parse_stage_layers
from MaxText.planning.stage_balance import (
    LayerOption,
    StageCosts,
    balance,
    balance_with_options,
)


def compositions(total, parts):
    """Every split of `total` layers into `parts` stages of >= 1 layer."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def brute_force(costs: StageCosts, num_layers, memory):
    best = None
    for split in compositions(num_layers, len(costs.extra_seconds)):
        if any(b > memory for b in costs.group_bytes(split)):
            continue
        slowest = max(costs.stage_seconds(s, n) for s, n in enumerate(split))
        if best is None or slowest < best[0]:
            best = (slowest, split)
    return best


def costs(extra, act, state=1.0, fixed=None, per_layer=1.0, group_of=None):
    n = len(extra)
    group_of = tuple(range(n)) if group_of is None else tuple(group_of)
    groups = max(group_of) + 1
    return StageCosts(
        per_layer, tuple(extra), (state,) * n, tuple(act), tuple(fixed or [0.0] * groups), group_of
    )


def slowest(c, split):
    return max(c.stage_seconds(s, n) for s, n in enumerate(split))


def test_uniform_stages_split_evenly():
    c = costs([0, 0, 0, 0], [0, 0, 0, 0])
    assert balance(c, 16, memory_bytes=1e9) == (4, 4, 4, 4)


def test_output_head_moves_layers_off_the_last_stage():
    # the head costs two layers' time: 16 layers + 2 over 4 stages -> the slowest stage takes 5
    c = costs([0, 0, 0, 2.0], [0, 0, 0, 0])
    split = balance(c, 16, memory_bytes=1e9)
    assert sum(split) == 16 and slowest(c, split) == 5.0
    assert split[-1] <= 3
    assert slowest(c, split) == brute_force(c, 16, 1e9)[0]


@pytest.mark.parametrize("memory", [14.0, 16.0, 20.0, 40.0])
@pytest.mark.parametrize(
    "extra,act",
    [
        ([0.5, 0, 0, 3.0], [3.0, 2.0, 1.0, 0.0]),  # 1F1B: first stages hold more microbatches
        ([0, 1.0, 0, 1.5], [1.0, 1.0, 1.0, 1.0]),
        ([2.0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5]),
    ],
)
def test_optimal_under_memory_matches_brute_force(extra, act, memory):
    c = costs(extra, act, state=1.0, fixed=[1.0, 0.0, 0.0, 2.0])
    want = brute_force(c, 12, memory)
    got = balance(c, 12, memory)
    if want is None:
        assert got is None
        return
    assert got is not None and sum(got) == 12 and min(got) >= 1
    assert all(b <= memory for b in c.group_bytes(got)), (got, c.group_bytes(got))
    assert slowest(c, got) == pytest.approx(want[0])


def test_virtual_stages_share_their_group_memory():
    # 4 stages on 2 groups (interleaved: stage s on group s % 2); group 0 is tight
    c = costs(
        [0, 0, 0, 1.0], [2.0, 1.0, 1.0, 0.5], state=1.0, fixed=[0.0, 0.0], group_of=[0, 1, 0, 1]
    )
    for memory in (12.0, 16.0, 30.0):
        want = brute_force(c, 10, memory)
        got = balance(c, 10, memory)
        assert (got is None) == (want is None)
        if got is not None:
            assert all(b <= memory for b in c.group_bytes(got))
            # the per-stage budget heuristic may give up a little time for memory, never fit
            assert slowest(c, got) >= want[0]


def test_nothing_fits_returns_none():
    assert balance(costs([0, 0], [1.0, 1.0]), 8, memory_bytes=3.0) is None


def test_parse_stage_layers():
    assert parse_stage_layers("even", 8, 4) == "even"
    assert parse_stage_layers("AUTO", 8, 4) == "auto"
    assert parse_stage_layers("1, 3,3,1", 8, 4) == (1, 3, 3, 1)
    with pytest.raises(ValueError, match="must list 4 stage sizes .* e.g. '2,2,2,2'"):
        parse_stage_layers("1,3,3", 8, 4)
    with pytest.raises(ValueError, match="summing to num_decoder_layers=8"):
        parse_stage_layers("1,3,3,2", 8, 4)
    with pytest.raises(ValueError, match="not 'even', 'auto' or a comma-separated"):
        parse_stage_layers("uneven", 8, 4)


def test_config_key_sets_the_stage_split():
    base = [
        str(CONFIGS_DIR / "base.yml"),
        "num_decoder_layers=6",
        "pipeline_parallelism=3",
        "num_pipeline_microbatches=4",
    ]
    config = load_config([*base, "pipeline_stage_layers=1,3,2"])
    assert config.stage_layers == (1, 3, 2)
    assert load_config(base).stage_layers == (2, 2, 2)
    assert load_config([*base, "pipeline_stage_layers=auto"]).pipeline_stage_layers == "auto"
    with pytest.raises(ConfigError, match="pipeline_stage_layers='1,3,3' must list 3"):
        load_config([*base, "pipeline_stage_layers=1,3,3"])


def test_memory_pushes_layers_off_the_first_stage():
    """Stage 0 holds 4 bytes per layer (state + in-flight activations), the others 1: with 8
    bytes per device the even split (3,3,3,3) does not fit, so stage 0 gets 2 layers and the
    slowest stage takes 4 layers' time instead of 3."""
    c = costs([0, 0, 0, 0], [3.0, 0, 0, 0])
    assert balance(c, 12, memory_bytes=100.0) == (3, 3, 3, 3)
    split = balance(c, 12, memory_bytes=8.0)
    assert split[0] == 2 and slowest(c, split) == 4.0 == brute_force(c, 12, 8.0)[0]


# ------------------------------------------------------------------ split and remat together


def with_options(c: StageCosts, table):
    """`c` with the same remat options on every stage: table = [(policy, seconds, act/layer)]
    scaled per stage by `c.activation_bytes_per_layer[s]` (the in-flight microbatches)."""
    options = tuple(
        tuple(LayerOption(p, t, a * c.activation_bytes_per_layer[s]) for p, t, a in table)
        for s in range(len(c.extra_seconds))
    )
    return dataclasses.replace(c, options=options)


def brute_force_with_options(c: StageCosts, num_layers, memory):
    """Every split x every assignment of options to stages: the smallest slowest stage, then the
    least total time, among those that fit."""
    best = None
    for split in compositions(num_layers, len(c.extra_seconds)):
        for chosen in itertools.product(*(c.stage_options(s) for s in range(len(split)))):
            if any(b > memory for b in c.group_bytes(split, chosen)):
                continue
            times = [c.stage_seconds(s, n, o) for s, (n, o) in enumerate(zip(split, chosen))]
            key = (max(times), sum(times))
            if best is None or key < best[0]:
                best = (key, split, chosen)
    return best


REMAT = [("none", 1.0, 1.0), ("minimal", 1.1, 0.4), ("full", 1.3, 0.1)]


@pytest.mark.parametrize("memory", [9.0, 12.0, 16.0, 24.0, 60.0])
@pytest.mark.parametrize(
    "extra,act",
    [
        ([0.2, 0, 0, 0.6], [4.0, 3.0, 2.0, 1.0]),  # 1F1B on 4 groups: p - s in flight
        ([0, 0, 0, 2.0], [4.0, 3.0, 2.0, 1.0]),  # a heavy output head
        ([0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_split_and_remat_together_match_brute_force(extra, act, memory):
    c = with_options(costs(extra, act, state=0.5, fixed=[1.0, 0.0, 0.0, 1.5]), REMAT)
    want = brute_force_with_options(c, 12, memory)
    got = balance_with_options(c, 12, memory)
    assert (got is None) == (want is None), (got, want)
    if got is None:
        return
    assert sum(got.split) == 12 and min(got.split) >= 1
    assert all(b <= memory for b in c.group_bytes(got.split, got.options))
    times = [c.stage_seconds(s, n, o) for s, (n, o) in enumerate(zip(got.split, got.options))]
    assert max(times) == pytest.approx(want[0][0])
    assert sum(times) == pytest.approx(want[0][1])
    assert got.policies == tuple(o.policy for o in got.options)


def test_fewer_layers_beat_heavier_remat_on_the_first_stage():
    """Worked by hand. 16 layers on 4 stages holding 4, 3, 2, 1 microbatches (1F1B); a layer
    costs 1 s and 1 byte per microbatch without remat, 1.3 s and 0.1 byte with full remat; 13
    bytes per device. Even (4,4,4,4): stage 0 needs 16 bytes without remat, so full remat: 5.2 s.
    Three layers on stage 0 fit without remat (12 bytes): (3,4,5,4) or (3,4,4,5), slowest 5 s.
    With `minimal` (1.1 s, 0.4 byte) available, even with minimal on stage 0 (4.4 s) is best."""
    two = [("none", 1.0, 1.0), ("full", 1.3, 0.1)]
    c = with_options(costs([0, 0, 0, 0], [4.0, 3.0, 2.0, 1.0], state=0.0), two)
    got = balance_with_options(c, 16, memory_bytes=13.0)
    assert got.split[0] == 3 and sorted(got.split[1:]) == [4, 4, 5]
    assert got.policies == ("none",) * 4
    assert max(c.stage_seconds(s, n, o) for s, (n, o) in enumerate(zip(*astuple(got)))) == 5.0
    # the alternative the joint choice beats: the even split with full remat on stage 0
    even_full = [c.stage_seconds(0, 4, c.stage_options(0)[1])] + [4.0] * 3
    assert max(even_full) == pytest.approx(5.2)

    c = with_options(costs([0, 0, 0, 0], [4.0, 3.0, 2.0, 1.0], state=0.0), REMAT)
    got = balance_with_options(c, 16, memory_bytes=13.0)
    assert got.split == (4, 4, 4, 4) and got.policies == ("minimal", "none", "none", "none")


def astuple(b):
    return b.split, b.options


def test_temporaries_grow_with_more_layers_and_never_shrink():
    """An option's temporaries, measured at 4 layers, by hand: 2 bytes up to 4 layers, then in
    proportion (3 bytes at 6 layers)."""
    option = LayerOption("p", 1.0, 0.5, temp_bytes=2.0, temp_layers=4)
    c = dataclasses.replace(costs([0, 0], [0.5, 0.5], state=1.0), options=((option,), (option,)))
    assert c.stage_bytes(0, 2, option) == 2 * 1.5 + 2.0
    assert c.stage_bytes(0, 4, option) == 4 * 1.5 + 2.0
    assert c.stage_bytes(0, 6, option) == 6 * 1.5 + 3.0
