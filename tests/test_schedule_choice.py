"""Schedule and microbatch choice: predictions against the closed forms of 1F1B and GPipe, and
the choice under a memory limit."""

from __future__ import annotations

import pytest

from MaxText.config import CONFIGS_DIR, load_config
from MaxText.planning.schedule_choice import Baseline, candidates, choose, predict


def baseline(**kw):
    values = dict(
        num_groups=4,
        num_layers=8,
        microbatches=8,
        global_batch=64,
        data_parallel=1,
        seconds_per_layer=1.0,
        first_extra_s=0.0,
        last_extra_s=0.0,
        fwd_fraction=1 / 3,
        transfer_s=0.0,
        outside_s=0.5,
        activation_bytes_per_layer=10.0,
        other_bytes=(100.0,) * 4,
        temp_bytes=(0.0,) * 4,
    )
    values.update(kw)
    return Baseline(**values)


@pytest.mark.parametrize("m", [4, 8, 16])
def test_1f1b_time_and_memory_follow_the_closed_form(m):
    """Uniform stages of 2 layers, t = 2 s per planned microbatch (8), so t * 8 / m per
    microbatch: a 1F1B step takes (m + p - 1) t, and rank 0 holds p microbatches."""
    b = baseline()
    c = predict(b, "1f1b", 1, m, memory_bytes=1e9)
    t = 2.0 * 8 / m
    assert c.step_time_s == pytest.approx((m + 4 - 1) * t + 0.5)
    assert c.bubble == pytest.approx(3 / (m + 3))
    assert c.peak_bytes[0] == int(100 + 4 * 2 * 10.0 * 8 / m)


def test_gpipe_holds_every_microbatch():
    c = predict(baseline(), "gpipe", 1, 16, memory_bytes=1e9)
    assert c.peak_bytes[0] == int(100 + 16 * 2 * 10.0 * 8 / 16)


def test_choice_prefers_the_fastest_that_fits():
    b = baseline()
    ranked = choose(b, 1e9, ["gpipe", "1f1b", "zero_bubble"], [4, 8, 16, 32])
    assert all(r.fits for r in ranked)
    times = [r.step_time_s for r in ranked]
    assert times == sorted(times)
    # more microbatches shrink the bubble; ZeroBubble's split backward fills it further
    assert ranked[0].microbatches == 32
    assert ranked[0].schedule == "zero_bubble"
    # a memory limit of 200 bytes excludes GPipe at 32 microbatches (100 + 32 x 2 x 10 / 4)
    tight = choose(b, 200.0, ["gpipe", "1f1b"], [32])
    assert [(r.schedule, r.fits) for r in tight] == [("1f1b", True), ("gpipe", False)]


def test_candidates_respect_the_batch_and_the_schedules_rules():
    b = baseline(global_batch=24, num_layers=8)
    found = candidates(b, ["1f1b", "interleaved_1f1b", "dualpipev"], [4, 8, 12, 16])
    assert ("1f1b", 1, 16) not in found  # 24 is not a multiple of 16
    assert ("interleaved_1f1b", 2, 12) in found
    assert ("dualpipev", 2, 4) not in found  # needs m >= 8 stages
    assert ("dualpipev", 2, 8) in found


def test_auto_keys_load():
    base = [str(CONFIGS_DIR / "base.yml"), "pipeline_parallelism=2", "num_decoder_layers=4"]
    c = load_config([*base, "pipeline_schedule=auto", "num_pipeline_microbatches=auto"])
    assert c.schedule_auto and c.microbatches_auto
    assert c.pipeline_schedule == "1f1b" and c.num_pipeline_microbatches == 4
    c = load_config(base)
    assert not c.schedule_auto and not c.microbatches_auto
