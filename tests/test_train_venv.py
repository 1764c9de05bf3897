"""`python train.py ...` and every documented `python -m MaxText.<tool> ...` work as typed with a
python that lacks the dependencies (#11 defect 8, #22 item 5).

The python without dependencies is a fresh, empty virtual environment made from this
interpreter's base python (`python -m venv --without-pip`): it sees the standard library only, so
`import jax` fails there whatever is installed system-wide.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from small_model import ONE_STEP

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("bare") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    probe = subprocess.run([python, "-c", "import jax"], capture_output=True, timeout=60)
    assert probe.returncode != 0  # the premise: this python has no jax
    return python


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user gets
    return env


def _run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "train.py", "configs/base.yml", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_reruns_itself_under_the_venv(bare_python, tmp_path):
    proc = _run(
        bare_python,
        REPO,
        *ONE_STEP,
        f"base_output_directory={tmp_path}",
        "run_name=venv",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1/1 | loss" in proc.stdout
    assert (tmp_path / "venv" / "metrics.jsonl").is_file()


def _copy_entry_point(dst: Path) -> None:
    """train.py and the standard-library-only code it runs first, without any .venv."""
    (dst / "MaxText").mkdir(parents=True)
    (dst / "configs").mkdir()
    shutil.copy(REPO / "train.py", dst / "train.py")
    for name in ("__init__.py", "venv.py"):
        shutil.copy(REPO / "MaxText" / name, dst / "MaxText" / name)


def test_without_venv_says_run_setup_first(bare_python, tmp_path):
    _copy_entry_point(tmp_path)
    proc = _run(bare_python, tmp_path, "pipeline_parallelism=4")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: jax is not installed for {bare_python} and there is no {tmp_path / '.venv'}; "
        f"run ./setup.sh first"
    ]


def test_a_venv_without_the_packages_does_not_loop(bare_python, tmp_path):
    _copy_entry_point(tmp_path)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(bare_python)
    proc = _run(bare_python, tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: jax is not installed in {tmp_path / '.venv' / 'bin' / 'python'}; "
        f"run ./setup.sh first"
    ]


# Every documented `python -m MaxText.<tool>`, with arguments that stop early with a user error
# (exit 2) only after the tool's module is imported: that module imports jax (or yaml) at the
# top, which the bare python cannot, so the expected line proves the command ran under `.venv`.
# A new tool (e.g. a checkpoint converter) gets the re-exec from `MaxText/__init__.py` for free:
# add a row here.
TOOLS = {
    "train": (["configs/base.yml", "not_a_key=1"], "config error: unknown config key 'not_a_key'"),
    "plan": (["configs/base.yml", "not_a_key=1"], "config error: unknown config key 'not_a_key'"),
    "generate": (
        ["configs/base.yml", "not_a_key=1"],
        "config error: unknown config key 'not_a_key'",
    ),
    "launch": (
        ["--num_processes", "1", "--", "configs/base.yml", "not_a_key=1"],
        # the launcher checks the config itself before starting any process: no [p0] prefix
        "config error: unknown config key 'not_a_key'",
    ),
    "data.prepare": (["--input", "{tmp}/missing", "--out", "{tmp}/out"], "data error: "),
    "to_maxtext": (["configs/base.yml"], "config error: to_maxtext needs hf_model_path="),
    "to_huggingface": (
        ["configs/base.yml", "not_a_key=1"],
        "config error: unknown config key 'not_a_key'",
    ),
}


def _run_module(python: Path, cwd: Path, tool: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", f"MaxText.{tool}", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("tool", TOOLS)
def test_module_reruns_itself_under_the_venv(bare_python, tmp_path, tool):
    args, expected = TOOLS[tool]
    proc = _run_module(bare_python, REPO, tool, [a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = (proc.stdout + proc.stderr).splitlines()
    assert any(line.startswith(expected) for line in output), output[-20:]
    assert "No module named" not in proc.stderr


@pytest.mark.parametrize("tool", TOOLS)
def test_module_without_venv_says_run_setup_first(bare_python, tmp_path, tool):
    """Only MaxText/__init__.py and venv.py exist here: the line comes before the tool's module
    (or its subpackage, `MaxText.data`) is even looked up, so before anything imports jax."""
    _copy_entry_point(tmp_path)
    proc = _run_module(bare_python, tmp_path, tool, TOOLS[tool][0])
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        f"error: jax is not installed for {bare_python} and there is no {tmp_path / '.venv'}; "
        f"run ./setup.sh first"
    ]
