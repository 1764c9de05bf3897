"""Pipeline timeline pictures: one row per rank, one box per task, idle time visible as gaps.

This module owns ``draw_timeline``, which renders ``simulate.Event`` records (simulated, or
measured by the engine's runtime in the same format) to a PNG, and the command line::

    python -m jaxpp_integration.tools.timeline --schedule interleaved_1f1b --stages 8 --ranks 4 \\
        --microbatches 8 --out timeline.png [--fwd-cost 1 --bwd-cost 2 --transfer 0]

which simulates a built-in schedule, prints its makespan and bubble, and writes the picture.
Rendering uses matplotlib's Agg canvas directly, so importing this module never changes the
global matplotlib backend.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from jaxpp_integration.schedules import SCHEDULE_NAMES, ScheduleError, schedule_from_name
from jaxpp_integration.schedules.simulate import Costs, Event, simulate

__all__ = ["KIND_COLORS", "draw_timeline", "main"]

KIND_COLORS = {
    "fwd": "#4C72B0",  # blue
    "bwd": "#DD8452",  # orange
    "bwdI": "#C44E52",  # red
    "bwdW": "#8172B3",  # purple
    "fused": "#55A868",  # green
    "other": "#8C8C8C",  # grey
}
IDLE_COLOR = "#EDEDED"
_MB_RE = re.compile(r"__(\d+)")


def _label(name: str) -> str:
    """Microbatch id(s) of an event name: ``fwd_3__0`` -> ``0``, a fused pair -> ``0/1``."""
    mbs = list(dict.fromkeys(_MB_RE.findall(name)))
    return "/".join(mbs) if mbs else name


def draw_timeline(
    events: Sequence[Event], num_ranks: int, path: str | Path, title: str | None = None
) -> Path:
    """Write a PNG Gantt chart of ``events`` to ``path`` and return the path.

    Rank 0 is the top row; boxes are coloured by ``kind`` (see ``KIND_COLORS``) and labelled
    with their microbatch where the box is wide enough; the light background is idle time.
    """
    for ev in events:
        if not 0 <= ev.rank < num_ranks:
            raise ValueError(f"event {ev.name!r} is on rank {ev.rank}, outside 0..{num_ranks - 1}")
    t0 = min((ev.start for ev in events), default=0.0)
    t1 = max((ev.end for ev in events), default=1.0)
    span = max(t1 - t0, 1e-12)

    width_in, dpi = 14.0, 110
    fig = Figure(figsize=(width_in, 1.2 + 0.55 * num_ranks), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lane = 0.8
    for rank in range(num_ranks):
        ax.broken_barh([(t0, span)], (rank - lane / 2, lane), facecolors=IDLE_COLOR)
    px_per_unit = width_in * dpi * 0.8 / span  # the axes take roughly 80% of the width
    for ev in events:
        color = KIND_COLORS.get(ev.kind, KIND_COLORS["other"])
        ax.broken_barh(
            [(ev.start, ev.end - ev.start)],
            (ev.rank - lane / 2, lane),
            facecolors=color,
            edgecolors="white",
            linewidth=0.6,
        )
        label = _label(ev.name)
        if (ev.end - ev.start) * px_per_unit >= 6.5 * len(label) + 4:
            ax.text(
                (ev.start + ev.end) / 2,
                ev.rank,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_ylim(num_ranks - 0.5, -0.5)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.set_xlim(t0, t0 + span)
    ax.set_xlabel("time")
    kinds = [k for k in KIND_COLORS if any(ev.kind == k for ev in events)]
    handles = [Patch(facecolor=KIND_COLORS[k], label=k) for k in kinds]
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpp_integration.tools.timeline",
        description="Simulate a pipeline schedule and draw its timeline.",
    )
    parser.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    parser.add_argument("--ranks", type=int, required=True, help="pipeline ranks (mpmd_dim)")
    parser.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages (default: ranks, or 2 * ranks for dualpipev)",
    )
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--out", default="timeline.png")
    parser.add_argument("--fwd-cost", type=float, default=1.0)
    parser.add_argument("--bwd-cost", type=float, default=2.0, help="full backward")
    parser.add_argument(
        "--bwd-i-cost", type=float, default=None, help="split backward, input part (bwd-cost/2)"
    )
    parser.add_argument(
        "--bwd-w-cost", type=float, default=None, help="split backward, weight part (bwd-cost/2)"
    )
    parser.add_argument("--transfer", type=float, default=0.0)
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)

    stages = args.stages
    if stages is None:
        stages = 2 * args.ranks if args.schedule == "dualpipev" else args.ranks
    try:
        costs = Costs(
            fwd=args.fwd_cost,
            bwd=args.bwd_cost,
            bwd_i=args.bwd_i_cost if args.bwd_i_cost is not None else args.bwd_cost / 2,
            bwd_w=args.bwd_w_cost if args.bwd_w_cost is not None else args.bwd_cost / 2,
            transfer=args.transfer,
        )
        schedule = schedule_from_name(args.schedule, stages, args.ranks)
        sim = simulate(schedule, args.microbatches, costs)
    except (ScheduleError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    title = args.title or (
        f"{schedule!r}, {args.microbatches} microbatches: "
        f"makespan {sim.makespan:g}, bubble {sim.bubble:.1%}"
    )
    out = draw_timeline(sim.events, schedule.mpmd_dim, args.out, title=title)
    print(f"schedule:  {schedule!r}, {args.microbatches} microbatches")
    print(f"makespan:  {sim.makespan:g}")
    print(f"bubble:    {sim.bubble:.2%}")
    print(f"peak live activations per rank: {list(sim.peak_live_activations)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
