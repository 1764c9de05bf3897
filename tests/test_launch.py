"""The trainer under 2 processes (started as `srun` would, and by MaxText.launch) equals the
single-process run, and its checkpoints move between process counts."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from small_model import SMALL_MODEL, merged

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the trainer emulates the devices each process needs itself
    return env


def _losses(out_dir: Path, run: str, key: str = "loss") -> dict[int, float]:
    """step -> loss (or another metric) from a run's metrics.jsonl (log_period=1)."""
    lines = (out_dir / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


def test_launch_usage_errors():
    out = subprocess.run(
        [sys.executable, "-m", "MaxText.launch", "--num_processes", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "usage error: no `--` before the trainer's arguments; see python -m MaxText.launch --help\n"
    )


def test_auto_pipeline_keys_refused_under_several_processes(tmp_path):
    """The planner needs every group's compiled programs, which no process has when each
    compiles only its own: `auto` pipeline keys stop at exit 2 with the fix, before compiling."""
    args = [*SMALL_MODEL, "dataset_type=synthetic", "steps=1", f"base_output_directory={tmp_path}"]
    cmd = [sys.executable, "-m", "MaxText.launch", "--num_processes", "2", "--timeout", "120"]
    cmd += ["--", "configs/base.yml", *args, "pipeline_parallelism=2", "pipeline_stage_layers=auto"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    for p in range(2):
        assert f"[p{p}] config error: 'auto' pipeline keys need the planner" in done.stdout
    assert "run `python -m MaxText.plan` with the same arguments on one host" in done.stdout


# tests/test_checkpointing.py's run: the small model, 20-step schedule, checkpoints every 5.
SMALL = [
    "configs/base.yml",
    *SMALL_MODEL,
    "dataset_type=synthetic",
    "num_pipeline_microbatches=4",
    "learning_rate_schedule_steps=20",
    "steps=10",
    "log_period=1",
    "eval_interval=5",
    "eval_steps=2",
    "enable_tensorboard=false",
    "enable_progress_bar=false",
    "enable_checkpointing=true",
    "checkpoint_period=5",
]


def _srun_env(num_processes: int) -> list[dict]:
    """The environment `srun --ntasks=N` gives its N tasks on one node (127.0.0.1), with a job id
    whose coordinator port (61440 + id % 4096, see MaxText/cluster/processes.py) is free."""
    for port in random.sample(range(61440, 65536), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        break
    common = {
        "SLURM_JOB_ID": str(port - 61440),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NTASKS": str(num_processes),
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": str(num_processes),
        "SLURM_NODEID": "0",
    }
    return [
        {**_env(), **common, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
        for i in range(num_processes)
    ]


def _srun(args: list[str], num_processes: int) -> str:
    """`train.py ARGS num_processes=-1` in each task of a faked srun step; their output, each
    line prefixed with [pI] as MaxText.launch does."""
    procs = [
        subprocess.Popen(
            [sys.executable, "train.py", *args, "num_processes=-1"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in _srun_env(num_processes)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    log = "".join(f"[p{i}] {line}\n" for i, out in enumerate(outs) for line in out.splitlines())
    assert all(p.returncode == 0 for p in procs), log[-3000:]
    return log


def _compiled_here(log: str, process: int, groups: list[int]) -> tuple[int, int]:
    """(task programs one process compiled, programs it loaded onto another of its groups),
    from the trainer's log line; compiled counts XLA compiles plus programs read from the
    session's compilation cache instead."""
    found = re.search(
        rf"process {process}: task programs of groups {re.escape(str(groups))} compiled here: "
        r"(\d+) XLA compiles, (\d+) read from jax_cache_dir, (\d+) loaded onto another group",
        log,
    )
    assert found, log[-3000:]
    return int(found.group(1)) + int(found.group(2)), int(found.group(3))


def _train(out: Path, run: str, processes: int, *overrides: str, srun: bool = False) -> str:
    args = merged(*SMALL, f"base_output_directory={out}", f"run_name={run}", *overrides)
    if srun:
        return _srun(args, processes)
    if processes == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        launch = ["-m", "MaxText.launch", "--num_processes", str(processes), "--timeout", "600"]
        cmd = [sys.executable, *launch, "--", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoints_move_between_them(tmp_path):
    """2 processes (pp=2, one group each) train and evaluate bitwise like 1 process, each
    compiling only its own group's task programs (5 each, none loaded; one process compiles 11
    and loads one onto its second group); a checkpoint
    written by 2 processes resumes in 1, and a single-process checkpoint resumes in 2: steps 6-10
    equal the uninterrupted 2-process run bitwise (the checkpoint holds the canonical tree; only
    where it is read from changes). The first 2-process run is started as `srun` starts its
    tasks (SLURM's variables, `num_processes=-1`), the resume by MaxText.launch (explicit keys).
    A resume at the same process count is the in-process tests' case
    (tests/test_checkpointing.py)."""
    log = _train(tmp_path, "two", 2, "pipeline_parallelism=2", srun=True)
    assert "[p0] srun: process 0 of 2, coordinator 127.0.0.1:" in log
    assert "[p1] srun: process 1 of 2, coordinator 127.0.0.1:" in log
    # each process compiles only its own group's task programs
    for p in range(2):
        assert _compiled_here(
            "\n".join(x for x in log.splitlines() if x.startswith(f"[p{p}]")), p, [p]
        ) == (5, 0)
    full = _losses(tmp_path, "two")
    assert sorted(full) == list(range(1, 11))
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["10", "5"]
    log = _train(tmp_path, "one", 1, "pipeline_parallelism=2", "steps=5")
    # one process holds both groups: the work after the loop is cut into parts the groups share
    # (`compiler/blocks.py`): 11 programs compiled, one of them loaded onto the other group
    assert _compiled_here(log, 0, [0, 1]) == (11, 1)
    one = _losses(tmp_path, "one")
    assert [one[s] for s in range(1, 6)] == [full[s] for s in range(1, 6)]
    # the forward-only eval pipeline: its sums live on process 1's group and are broadcast
    evals = _losses(tmp_path, "two", "eval_loss")
    assert list(evals) == [5, 10]
    assert _losses(tmp_path, "one", "eval_loss") == {5: evals[5]}
    for run, processes, source in [("2to1", 1, "two"), ("1to2", 2, "one")]:
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        shutil.copytree(
            tmp_path / source / "checkpoints" / "5", tmp_path / run / "checkpoints" / "5"
        )
        log = _train(tmp_path, run, processes, "pipeline_parallelism=2")
        assert f"resuming run {run} from checkpoint step 5" in log
        got = _losses(tmp_path, run)
        assert [got[s] for s in range(6, 11)] == [full[s] for s in range(6, 11)], run
        assert _losses(tmp_path, run, "eval_loss") == {10: evals[10]}, run
