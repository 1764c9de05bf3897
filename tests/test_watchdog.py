"""The hang watchdog (`pipeline_hang_timeout_s`) with 2 local processes (gloo on CPU)."""

from __future__ import annotations

import signal
import time

import pytest
from test_multihost import _launch

from jaxpp_integration.runtime.watchdog import HANG_EXIT_CODE

HANG_TIMEOUT_S = 5.0  # tests/multihost_worker.py's value in `stop` mode


@pytest.mark.slow
def test_stopped_peer_makes_the_other_exit_with_its_position():
    """Process 1 stops itself (SIGSTOP) after compiling; process 0 runs the step and waits on a
    transfer from/to group 1 forever. Its watchdog must print where it is (instruction, task,
    microbatch, the group and process waited on) and exit with HANG_EXIT_CODE within the
    timeout + 10 s of the stop (the heartbeat timeout is 120 s, so only the watchdog can end
    it that fast)."""
    procs = _launch("1f1b", "stop")
    try:
        lines = []
        for line in procs[1].stdout:  # wait until process 1 has stopped itself
            lines.append(line)
            if "stopping myself" in line:
                break
        stopped_at = time.monotonic()
        out0 = procs[0].communicate(timeout=HANG_TIMEOUT_S + 60)[0]
        waited = time.monotonic() - stopped_at
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].communicate(timeout=30)
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == HANG_EXIT_CODE, out0[-3000:]
    assert waited < HANG_TIMEOUT_S + 10, (waited, out0[-2000:])
    line = next(x for x in out0.splitlines() if "jaxpp pipeline hang: process 0" in x)
    assert "instruction " in line and "microbatch" in line, line
    assert "waits on group 1, process 1" in line, line
    assert "pipeline_hang_timeout_s=5" in line, line
