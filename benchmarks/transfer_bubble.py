"""What blocking stage transfers cost across nodes: the simulator's bubble per schedule.

    python benchmarks/transfer_bubble.py [--link-gbps 10,25,50,100,400] [--out PATH]

A simulator figure (`jaxpp_integration.schedules.simulate`), deterministic: no device runs. For
8 pipeline ranks, one per node (stage boundaries cross the inter-node link), each built-in
schedule is replayed with two transfer models (`simulate(..., transfers=...)`):

- `blocking`: a transfer is a collective both ranks run on their compute streams, issued in the
  engine's dispatch order (what `runtime/transfer.py`'s pair programs are on GPUs): a sender waits
  for a busy receiver and holds its own stream meanwhile;
- `overlapped`: sends and receives on streams of their own (JaxPP's `dime2.py`, or cross-host
  `jax.device_put` where the PJRT plugin does it off the compute stream): a transfer only delays
  the task that reads it.

Task costs come from a Llama-2-7B-sized model on H100s, stated in `MODEL` (FLOPs at an assumed
efficiency; backward = 2 x forward; a zero-bubble schedule's two backward halves = 1 x forward
each); a transfer moves one microbatch's hidden state, bf16, at the link speed. Bubble % =
idle compute time / (ranks x step time), transfer time counting as idle.

Writes `benchmarks/results/transfer_bubble.json` and prints the markdown table the README shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import jaxpp_integration as jaxpp  # noqa: E402
from jaxpp_integration.schedules.simulate import Costs, simulate  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "transfer_bubble.json"
RANKS = 8
MICROBATCHES = 32

# Llama 2 7B shapes, one 4096-token row per microbatch, on H100s (dense bf16 peak 989 TFLOP/s)
MODEL = {
    "layers": 32,
    "emb_dim": 4096,
    "mlp_dim": 11008,
    "tokens_per_microbatch": 4096,
    "peak_tflops": 989.0,
    "efficiency": 0.45,  # fraction of peak a stage's task achieves (a typical MFU)
    "activation_bytes_per_value": 2,  # bf16 hidden state
}


def schedules() -> dict:
    """The built-in schedules at 8 ranks (interleaved and DualPipeV with 2 stages per rank)."""
    return {
        "gpipe": jaxpp.GPipe(RANKS),
        "1f1b": jaxpp.Std1F1B(RANKS),
        "eager_1f1b": jaxpp.Eager1F1B(RANKS),
        "interleaved_1f1b": jaxpp.Interleaved1F1B(2 * RANKS, RANKS),
        "zero_bubble": jaxpp.ZeroBubble(RANKS),
        "dualpipev": jaxpp.DualPipeV(RANKS),
    }


def stage_seconds(num_stages: int) -> float:
    """Forward time of one stage for one microbatch: 2 FLOPs per weight per token for the
    attention and MLP matmuls, plus causal attention's scores and values (2 x 2 x L/2 x E per
    token and layer), over the stage's layers, at the assumed efficiency."""
    m = MODEL
    e, f, tokens = m["emb_dim"], m["mlp_dim"], m["tokens_per_microbatch"]
    weights = 4 * e * e + 3 * e * f  # q, k, v, o; gate, up, down
    per_token_layer = 2 * weights + 2 * tokens * e  # causal: half of 2 x 2 x L x E
    layers = m["layers"] / num_stages
    flops = per_token_layer * tokens * layers
    return flops / (m["peak_tflops"] * 1e12 * m["efficiency"])


def transfer_seconds(link_gbps: float) -> float:
    """One microbatch's hidden state over a link of `link_gbps` gigabits per second."""
    m = MODEL
    nbytes = m["tokens_per_microbatch"] * m["emb_dim"] * m["activation_bytes_per_value"]
    return nbytes * 8 / (link_gbps * 1e9)


def rows(links: list[float]) -> list[dict]:
    out = []
    for name, schedule in schedules().items():
        fwd = stage_seconds(schedule.num_stages)
        for gbps in links:
            t = transfer_seconds(gbps)
            costs = Costs(fwd=fwd, bwd=2 * fwd, bwd_i=fwd, bwd_w=fwd, transfer=t)
            row = {"schedule": name, "link_gbps": gbps, "fwd_s": fwd, "transfer_s": t}
            for mode in ("overlapped", "blocking"):
                sim = simulate(schedule, MICROBATCHES, costs, transfers=mode)
                row[f"{mode}_bubble"] = sim.bubble
                row[f"{mode}_step_s"] = sim.makespan
            ideal = simulate(
                schedule, MICROBATCHES, Costs(fwd=fwd, bwd=2 * fwd, bwd_i=fwd, bwd_w=fwd)
            )
            row["free_transfer_bubble"] = ideal.bubble
            out.append(row)
    return out


def table(result_rows: list[dict], links: list[float]) -> str:
    """Bubble per schedule: free transfers, then overlapped / blocking at each link speed."""
    lines = [
        "| schedule | free transfers | " + " | ".join(f"{g:g} Gb/s" for g in links) + " |",
        "|---" * (2 + len(links)) + "|",
    ]
    for name in dict.fromkeys(r["schedule"] for r in result_rows):
        mine = {r["link_gbps"]: r for r in result_rows if r["schedule"] == name}
        first = next(iter(mine.values()))
        cells = [
            f"{100 * mine[g]['overlapped_bubble']:.1f} % / {100 * mine[g]['blocking_bubble']:.1f} %"
            for g in links
        ]
        lines.append(
            f"| {name} | {100 * first['free_transfer_bubble']:.1f} % | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/transfer_bubble.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--link-gbps", default="10,25,100,400", help="inter-node link speeds")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    links = [float(g) for g in args.link_gbps.split(",") if g.strip()]
    result_rows = rows(links)
    result = {
        "command": "python benchmarks/transfer_bubble.py " + " ".join(argv or sys.argv[1:]),
        "ranks": RANKS,
        "microbatches": MICROBATCHES,
        "model": MODEL,
        "rows": result_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("bubble, overlapped / blocking transfers:")
    print(table(result_rows, links))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
