"""`benchmarks/gpu_smoke.py` on a host without usable GPUs: one line, exit 2 (#25 item 6).

Without `nvidia-smi` the command stops before starting JAX; with an `nvidia-smi` that lists GPUs
(faked here) but a jaxlib that runs on CPU, the row's process stops once JAX has started. The
smoke itself needs GPUs; `--cpu` runs its whole path on CPU devices (not in CI: the planner's
`auto` keys compile the step several times).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _smoke(path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PATH"] = path
    return subprocess.run(
        [sys.executable, "benchmarks/gpu_smoke.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_gpu_host_gets_one_line():
    proc = _smoke("/usr/bin:/bin")  # no nvidia-smi there
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "gpu_smoke: no GPU on this host (nvidia-smi lists none); run it on a GPU node"
    ]


def test_gpu_host_with_cpu_jax_gets_one_line(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3'\n" for i in range(8))
    )
    smi.chmod(0o755)
    proc = _smoke(f"{tools}:/usr/bin:/bin")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "gpu_smoke: JAX runs on CPU on this host with 8 GPUs (nvidia-smi); run ./setup.sh here "
        "(it installs jax[cuda12]), then run this again"
    ]
