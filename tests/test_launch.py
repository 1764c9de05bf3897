"""The trainer under 2 processes (MaxText.launch) equals the single-process run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from small_model import SMALL_MODEL

ROOT = Path(__file__).resolve().parent.parent
ARGS = [
    "configs/base.yml",
    "pipeline_parallelism=2",
    "steps=3",
    "log_period=1",
    "eval_interval=3",
    "eval_steps=2",
    "enable_tensorboard=false",
    "enable_progress_bar=false",
]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer emulates the devices each process needs itself
    return env


def _losses(out_dir: Path, run: str, key: str = "loss") -> dict[int, float]:
    """step -> loss (or another metric) from a run's metrics.jsonl (log_period=1)."""
    lines = (out_dir / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


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
    # the forward-only eval pipeline: its sums live on process 1's group and are broadcast
    assert _losses(tmp_path, "two", "eval_loss") == _losses(tmp_path, "one", "eval_loss")
    assert list(_losses(tmp_path, "one", "eval_loss")) == [3]


def test_launch_usage_errors():
    out = subprocess.run(
        [sys.executable, "-m", "MaxText.launch", "--num_processes", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "usage" in out.stdout


# tests/test_checkpointing.py's run: the small model, 20-step schedule, checkpoints every 5.
SMALL = [
    "configs/base.yml",
    *SMALL_MODEL,
    "dataset_type=synthetic",
    "num_pipeline_microbatches=4",
    "learning_rate_schedule_steps=20",
    "steps=10",
    "log_period=1",
    "eval_interval=0",
    "enable_tensorboard=false",
    "enable_progress_bar=false",
    "enable_checkpointing=true",
    "checkpoint_period=5",
]


def _train(out: Path, run: str, processes: int, *overrides: str) -> str:
    args = [*SMALL, f"base_output_directory={out}", f"run_name={run}", *overrides]
    if processes == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        launch = ["-m", "MaxText.launch", "--num_processes", str(processes), "--timeout", "600"]
        cmd = [sys.executable, *launch, "--", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_checkpoints_move_between_process_counts(tmp_path):
    """Written by 2 processes (pp=2, one group each), step 5 resumes in 1 process, and a
    single-process checkpoint resumes in 2: steps 6-10 equal the uninterrupted 2-process run
    bitwise (the checkpoint holds the canonical tree; only where it is read from changes). A
    resume at the same process count is the in-process tests' case (tests/test_checkpointing.py)."""
    _train(tmp_path, "two", 2, "pipeline_parallelism=2")
    full = _losses(tmp_path, "two")
    assert sorted(full) == list(range(1, 11))
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["10", "5"]
    _train(tmp_path, "one", 1, "pipeline_parallelism=2", "steps=5")
    one = _losses(tmp_path, "one")
    assert [one[s] for s in range(1, 6)] == [full[s] for s in range(1, 6)]
    for run, processes, source in [("2to1", 1, "two"), ("1to2", 2, "one")]:
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        shutil.copytree(
            tmp_path / source / "checkpoints" / "5", tmp_path / run / "checkpoints" / "5"
        )
        log = _train(tmp_path, run, processes, "pipeline_parallelism=2")
        assert f"resuming run {run} from checkpoint step 5" in log
        got = _losses(tmp_path, run)
        assert [got[s] for s in range(6, 11)] == [full[s] for s in range(6, 11)], run
