"""The trainer under 2 processes (MaxText.launch) equals the single-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARGS = [
    "configs/base.yml",
    "pipeline_parallelism=2",
    "steps=3",
    "log_period=1",
    "eval_interval=0",
    "enable_tensorboard=false",
    "enable_progress_bar=false",
]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer emulates the devices each process needs itself
    return env


def _losses(out_dir: Path, run: str) -> list[float]:
    lines = (out_dir / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
def test_two_process_training_equals_one_process(tmp_path):
    common = [*ARGS, f"base_output_directory={tmp_path}"]
    multi = subprocess.run(
        [
            sys.executable,
            "-m",
            "MaxText.launch",
            "--num_processes",
            "2",
            "--timeout",
            "900",
            "--",
            *common,
            "run_name=two",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1000,
    )
    assert multi.returncode == 0, multi.stdout[-3000:]
    assert "[p0]" in multi.stdout and "[p1]" in multi.stdout
    single = subprocess.run(
        [sys.executable, "train.py", *common, "run_name=one"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    two, one = _losses(tmp_path, "two"), _losses(tmp_path, "one")
    assert len(one) == 3
    assert two == one  # bitwise: same programs, same order of float operations


def test_launch_usage_errors():
    out = subprocess.run(
        [sys.executable, "-m", "MaxText.launch", "--num_processes", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "usage" in out.stdout


def test_multiprocess_checkpointing_is_a_config_error():
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "configs/base.yml",
            "num_processes=2",
            "coordinator_address=127.0.0.1:1",
            "enable_checkpointing=true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("config error: enable_checkpointing")
