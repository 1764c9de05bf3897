"""A stage transfer across two nodes: the engine's own cross-process transfer, timed against
the link. The two-node companion of `gpu_smoke.py` (`scripts/gpu_smoke_two_nodes.sbatch`).

    python benchmarks/gpu_transfer.py --coordinator HOST:PORT --num-processes 2 --process-id I \\
        [--link-gbps 400] [--mib 1,16,64,256] [--repeats 10]
    python benchmarks/gpu_transfer.py --local 2 [--mib 1,4]      (2 processes here, CPU: a check)

Each process is one pipeline group holding every local GPU (as the trainer runs: one process per
node). For each size, a bfloat16 hidden state of that many MiB, sharded over the group's devices
along its rows, goes from group 0 to group 1 and back with `runtime.transfer.CrossBatch` (the
engine's pair program, NCCL between the nodes), `--repeats` times each way after one warm-up.
Printed per size and direction: the median time and the bandwidth (bytes / time) next to the
link's (`--link-gbps`: the node's inter-node bandwidth in gigabits per second, all its NICs
together), as a percentage. Process 0 writes `benchmarks/results/gpu_transfer.json` (`--out`).
What a result means: docs/cluster.md, "First run on a GPU node".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "gpu_transfer.json"
MIB = 1 << 20


def measure(args) -> int:
    import jax

    if args.cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxpp_integration.runtime.transfer import CrossBatch, Link

    per_process = [[d for d in jax.devices() if d.process_index == p] for p in range(2)]
    n = min(len(p) for p in per_process)
    mesh = Mesh(np.array([p[:n] for p in per_process]), ("stage", "fsdp"))
    groups = [Mesh(mesh.devices[g : g + 1], mesh.axis_names) for g in range(2)]
    me = jax.process_index()
    rows_spec = PartitionSpec("fsdp")
    rows = []
    for mib in args.mib:
        width = 4096
        shape = ((mib * MIB // (2 * width)) // n * n, width)  # bfloat16: 2 bytes per value
        for src, dst in ((0, 1), (1, 0)):
            link = Link(
                NamedSharding(groups[src], rows_spec),
                NamedSharding(groups[dst], rows_spec),
                shape,
                np.dtype(jnp.bfloat16),
            )
            batch = CrossBatch([link], me == src, "stage")
            value = None
            if me == src:
                value = jax.jit(
                    lambda shape=shape: jnp.ones(shape, jnp.bfloat16), out_shardings=link.src
                )()
            times = []
            for k in range(args.repeats + 1):
                t0 = time.perf_counter()
                received, issued = batch([value] if me == src else None)
                jax.block_until_ready(received if received is not None else issued)
                if k:
                    times.append(time.perf_counter() - t0)
            if received is not None:  # the receiver checks what arrived
                assert float(jnp.sum(received[0].astype(jnp.float32))) == shape[0] * shape[1]
            seconds = statistics.median(times)
            nbytes = shape[0] * shape[1] * 2
            rows.append(
                {
                    "mib": nbytes / MIB,
                    "from": src,
                    "to": dst,
                    "side": "send" if me == src else "receive",
                    "median_s": seconds,
                    "gbps": nbytes * 8 / seconds / 1e9,
                }
            )
    if me == 0:
        _report(args, rows, n)
    return 0


def _report(args, rows: list[dict], devices_per_group: int) -> None:
    lines = ["| MiB | direction | median ms | Gb/s | % of link |", "|---|---|---|---|---|"]
    for r in rows:
        share = f"{100 * r['gbps'] / args.link_gbps:.0f} %" if args.link_gbps else "-"
        lines.append(
            f"| {r['mib']:.0f} | group {r['from']} -> {r['to']} | {1e3 * r['median_s']:.2f} "
            f"| {r['gbps']:.1f} | {share} |"
        )
    print("\n".join(lines), flush=True)
    from benchmarks.machine import machine_info

    result = {
        "command": "python benchmarks/gpu_transfer.py " + " ".join(sys.argv[1:]),
        "link_gbps": args.link_gbps,
        "devices_per_group": devices_per_group,
        "machine": machine_info(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)


def local(args) -> int:
    """Starts `args.local` processes of this script here (CPU, gloo): checks the script."""
    from MaxText.launch import free_port

    port = free_port()
    base = ["--mib", ",".join(map(str, args.mib)), "--repeats", str(args.repeats)]
    base += ["--link-gbps", str(args.link_gbps), "--out", str(args.out)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *base,
                "--cpu",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                str(args.local),
                "--process-id",
                str(i),
            ],
            env=env,
        )  # fmt: skip
        for i in range(args.local)
    ]
    return max(p.wait() for p in procs)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_transfer.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--link-gbps", type=float, default=0.0, help="the node's link, Gb/s")
    parser.add_argument("--mib", default="1,16,64,256", help="payload sizes in MiB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local", type=int, default=0, help="start this many processes here")
    args = parser.parse_args(argv)
    args.mib = [int(m) for m in args.mib.split(",") if m.strip()]
    if args.local:
        return local(args)
    if args.num_processes != 2 or not args.coordinator:
        print("gpu_transfer: give --coordinator HOST:PORT and --num-processes 2", file=sys.stderr)
        return 2
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
