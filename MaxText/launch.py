"""Local multi-process launcher: N trainer processes on 127.0.0.1, for development and tests.

    python -m MaxText.launch --num_processes 2 -- configs/base.yml pipeline_parallelism=2 ...

Picks a free port, starts `python train.py ARGS coordinator_address=127.0.0.1:PORT
num_processes=N process_id=i` for each i, prefixes every output line with `[pI]`, and, when one
process fails, stops the others and exits with that process's code. On a cluster, run `train.py`
once per host yourself with the same three keys instead (see README, "Running on several hosts").
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(proc: subprocess.Popen, prefix: str, sink) -> None:
    for line in proc.stdout:
        sink.write(f"{prefix} {line}")
        sink.flush()


def launch(num_processes: int, train_args: list[str], *, timeout: float | None = None) -> int:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = []
    for i in range(num_processes):
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            *train_args,
            f"coordinator_address=127.0.0.1:{port}",
            f"num_processes={num_processes}",
            f"process_id={i}",
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    pumps = [
        threading.Thread(target=_pump, args=(p, f"[p{i}]", sys.stdout), daemon=True)
        for i, p in enumerate(procs)
    ]
    for t in pumps:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or (deadline is not None and time.monotonic() > deadline):
            code = failed[0].returncode if failed else 124
            who = f"process {procs.index(failed[0])} exited with {code}" if failed else "timeout"
            print(f"[launch] {who}; stopping the others", flush=True)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=5)
    if code == 0:
        code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m MaxText.launch --num_processes N -- CONFIG.yml [key=value ...]")
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m MaxText.launch")
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before stopping all")
    opts = parser.parse_args(argv[:split])
    if opts.num_processes < 1:
        print("--num_processes must be at least 1")
        return 2
    return launch(opts.num_processes, argv[split + 1 :], timeout=opts.timeout)


if __name__ == "__main__":
    sys.exit(main())
