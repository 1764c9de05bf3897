"""Local multi-process launcher: N trainer processes on 127.0.0.1, for development and tests.

    python -m MaxText.launch --num_processes 2 -- configs/base.yml pipeline_parallelism=2 ...

Picks a free port, checks the config once (every rule that does not depend on the host's devices;
a refusal is one `config error:` line on stderr, exit 2, and no process starts), starts
`python train.py ARGS coordinator_address=127.0.0.1:PORT num_processes=N process_id=i` for each i,
prefixes every output line with `[pI]`, and, when one process fails, stops the others and exits
with that process's code. Usage errors are one line on stderr, exit 2. On a cluster, run `train.py`
once per host yourself with the same three keys instead (see docs/cluster.md, "Running on several
hosts").

Signals: each trainer runs in its own session, so a Ctrl-C at the terminal reaches the launcher
only, and the launcher forwards SIGINT and SIGTERM to every trainer exactly once per signal it
receives (a second Ctrl-C is a second SIGINT: the trainers stop at once). The trainers then save
the same step and exit 143 / 130, which the launcher returns. A trainer killed by signal N is
reported as exit code 128 + N (137 for SIGKILL), as a shell does. On Linux each trainer gets
SIGTERM if the launcher itself dies (`PR_SET_PDEATHSIG`), so none outlives it unsaved.
Exit codes: `MaxText/exit_codes.py`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from MaxText import exit_codes

_STOPPED_AFTER_SIGNAL = (
    exit_codes.after_signal(signal.SIGTERM),
    exit_codes.after_signal(signal.SIGINT),
)

ROOT = Path(__file__).resolve().parent.parent
FORWARDED = (signal.SIGINT, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(proc: subprocess.Popen, prefix: str, sink) -> None:
    for line in proc.stdout:
        sink.write(f"{prefix} {line}")
        sink.flush()


def _parent_death_signal():
    """A function that, run in a child between fork and exec, makes the kernel send it SIGTERM
    when this process dies (Linux `prctl(PR_SET_PDEATHSIG)`); None elsewhere. libc is loaded
    here, before the fork, so the child only makes the call."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def trainer_args(train_args: list[str], port: int, num_processes: int, i: int) -> list[str]:
    """The arguments of trainer `i`: the user's, then the three keys of the launch."""
    return [
        *train_args,
        f"coordinator_address=127.0.0.1:{port}",
        f"num_processes={num_processes}",
        f"process_id={i}",
    ]


def launch(
    num_processes: int,
    train_args: list[str],
    *,
    timeout: float | None = None,
    script: Path = ROOT / "train.py",
    port: int | None = None,
) -> int:
    """Runs `script` (the trainer) N times; returns the exit code (see the module docstring)."""
    port = port or free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        print(f"[launch] {signal.Signals(signum).name}: forwarded to the trainers", flush=True)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    die_with_parent = _parent_death_signal()
    try:
        for i in range(num_processes):
            cmd = [sys.executable, str(script), *trainer_args(train_args, port, num_processes, i)]
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            )
        return _supervise(procs, received, timeout)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(procs: list[subprocess.Popen], received: list[int], timeout: float | None) -> int:
    pumps = [
        threading.Thread(target=_pump, args=(p, f"[p{i}]", sys.stdout), daemon=True)
        for i, p in enumerate(procs)
    ]
    for t in pumps:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    while any(p.poll() is None for p in procs):
        # A trainer that handled SIGTERM/SIGINT (exit 143/130) saved and stopped; its peers are
        # stopping at the same step (JAX's preemption notice): let them save too.
        failed = [p for p in procs if p.poll() not in (None, 0, *_STOPPED_AFTER_SIGNAL)]
        # After a forwarded signal every trainer is stopping on its own: let them save.
        if (failed and not received) or (deadline is not None and time.monotonic() > deadline):
            code = exit_codes.from_returncode(failed[0].returncode) if failed else 124
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
    if code == 0:  # every process ended by itself: the first failure is the launcher's code
        failed = [p for p in procs if p.returncode]
        if failed:
            code = exit_codes.from_returncode(failed[0].returncode)
            print(f"[launch] process {procs.index(failed[0])} exited with {code}", flush=True)
    return code


def check_config(train_args: list[str], port: int, num_processes: int) -> int:
    """The trainers' config, checked once here before any process starts: every rule that does
    not depend on the host's devices (`load_config` starts no backend), with the keys the
    trainers will get. A refusal is one `config error:` line, not one per process."""
    from MaxText.config import load_config

    for i in range(num_processes):  # the keys differ only by process_id
        load_config(trainer_args(train_args, port, num_processes, i))
    return exit_codes.OK


def _parser() -> exit_codes.ArgumentParser:
    from MaxText.config import tool_help

    parser = exit_codes.ArgumentParser(
        prog="python -m MaxText.launch",
        usage=tool_help.usage("MaxText.launch"),
        description=tool_help.TOOLS["MaxText.launch"].about,
    )
    parser.add_argument(
        "--num_processes", type=int, required=True, help="trainer processes to start (>= 1)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before stopping all")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from MaxText.config import tool_help

    parser = _parser()
    if (words := tool_help.requested(argv)) is not None:  # --help before `--`: its own options
        return tool_help.show("MaxText.launch", words, parser.format_help())
    if "--" not in argv:
        parser.error("no `--` before the trainer's arguments")
    split = argv.index("--")
    opts = parser.parse_args(argv[:split])
    if opts.num_processes < 1:
        parser.error(f"--num_processes must be at least 1, got {opts.num_processes}")
    train_args = argv[split + 1 :]
    if not train_args:
        parser.error("nothing after `--`; give the trainer's CONFIG.yml [key=value ...]")
    port = free_port()
    code = exit_codes.run(lambda: check_config(train_args, port, opts.num_processes))
    if code != exit_codes.OK:
        return code
    return launch(opts.num_processes, train_args, timeout=opts.timeout, port=port)


if __name__ == "__main__":
    sys.exit(main())
