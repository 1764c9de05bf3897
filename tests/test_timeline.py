"""Timeline pictures: a real, non-trivial PNG from a simulated schedule, and the CLI."""

import numpy as np
import pytest
from matplotlib.image import imread

from jaxpp_integration.schedules import DualPipeV, Interleaved1F1B
from jaxpp_integration.schedules.simulate import Costs, Event, simulate
from jaxpp_integration.tools.timeline import KIND_COLORS, draw_timeline, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def distinct_colours(path):
    pixels = imread(path)[..., :3]
    return len(np.unique((pixels * 255).round().astype(np.uint8).reshape(-1, 3), axis=0))


def test_draw_simulated_timeline(tmp_path):
    sim = simulate(Interleaved1F1B(8, 4), 8, Costs(fwd=1.0, bwd=2.0))
    out = draw_timeline(sim.events, 4, tmp_path / "interleaved.png", title="interleaved")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000
    assert distinct_colours(out) > 10


def test_split_backward_kinds_have_their_own_colours(tmp_path):
    sim = simulate(DualPipeV(2, fuse_overlap=True), 4)
    kinds = {ev.kind for ev in sim.events}
    assert {"fwd", "bwdI", "bwdW", "fused"} <= kinds
    assert len({KIND_COLORS[k] for k in ("fwd", "bwd", "bwdI", "bwdW", "fused")}) == 5
    out = draw_timeline(sim.events, 2, tmp_path / "dualpipev.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_measured_events_and_bad_rank(tmp_path):
    events = [
        Event(0, "fwd_0__0", "fwd", 0.0, 0.003),
        Event(1, "fwd_1__0", "fwd", 0.004, 0.007),
        Event(1, "transfer", "other", 0.007, 0.008),
    ]
    assert draw_timeline(events, 2, tmp_path / "measured.png").exists()
    with pytest.raises(ValueError, match="on rank 2, outside 0..1"):
        draw_timeline([Event(2, "fwd_2__0", "fwd", 0.0, 1.0)], 2, tmp_path / "bad.png")


def test_cli(tmp_path, capsys):
    out = tmp_path / "timeline.png"
    code = main(
        [
            "--schedule",
            "interleaved_1f1b",
            "--stages",
            "8",
            "--ranks",
            "4",
            "--microbatches",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "makespan:  57" in printed  # (v m + p - 1)(F + B) with v=2, m=8, p=4, F=1, B=2
    assert "bubble:    15.79%" in printed  # (p-1)/(v m + p-1) = 3/19
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_cli_rejects_impossible_settings(tmp_path, capsys):
    code = main(
        ["--schedule", "dualpipev", "--ranks", "4", "--microbatches", "4"]
        + ["--out", str(tmp_path / "x.png")]
    )
    assert code == 2
    assert "needs at least 2 * mpmd_dim = 8 microbatches" in capsys.readouterr().err
