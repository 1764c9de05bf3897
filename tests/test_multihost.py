"""The engine under JAX's multi-controller runtime: 2 local processes, gloo collectives on CPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(schedule: str, *extra: str):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent}{os.pathsep}{HERE}")
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "multihost_worker.py"),
                str(pid),
                str(port),
                schedule,
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "swapped"])
def test_two_processes_equal_single_process_bitwise(schedule):
    """Tied embedding + global-norm clipping, 3 steps; each process checks its own groups.
    `swapped`: a user schedule whose second rank runs its forwards in another order than the
    first rank sends their inputs; every process walks one global instruction order, so the
    cross-process transfers pair up whatever order each rank's list has."""
    procs = _launch(schedule)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "OK" in outs[0] and "groups here: [0]" in outs[0]
    assert "OK" in outs[1] and "groups here: [1]" in outs[1]


@pytest.mark.slow
def test_peer_death_makes_the_other_exit():
    """Process 1 dies after compiling; process 0, blocked on a transfer, must exit non-zero
    with a message within the heartbeat timeout (10 s) plus slack, never hang."""
    procs = _launch("1f1b", "die")
    start = time.monotonic()
    out0 = procs[0].communicate(timeout=180)[0]
    procs[1].communicate(timeout=30)
    assert procs[1].returncode != 0
    assert procs[0].returncode != 0
    assert time.monotonic() - start < 180
    assert "another task died" in out0 or "distributed service detected fatal errors" in out0, out0[
        -2000:
    ]
