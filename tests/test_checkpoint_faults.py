"""Checkpoint faults: damage is found (checksums) and skipped; unavailability and a full disk stop
the run with one line and touch no checkpoint.

- a checkpoint file altered in place (4 KiB of 0xFF, same size) is damage: found by its checksum,
  moved aside, the previous checkpoint used, training continues bitwise;
- a mode-000 file (read by a process without root's permission override) is not damage: one
  line, exit 1, nothing moved;
- a disk that fills up during a save (a real tmpfs): one line naming the step, the errno and the
  newest checkpoint on disk, exit 1, older checkpoints byte for byte untouched; after space is
  freed the run resumes from that checkpoint. The default (async) save in a subprocess, whose
  whole stderr is checked; the synchronous one in this process;
- a checkpoints folder that turns read-only before an async save: the same one line;
- a process that printed its one-line error exits at once (`EXIT_AFTER_ERROR_S`): no background
  thread of orbax keeps it alive;
- the classification itself on the errors measured for each case (`integrity.classify`);
- `load_parameters_path` to another run's damaged checkpoint: a config error that moves nothing
  and does not advise moving the other run's folder.

Runs use the trainer's default keys (scanned layers, async checkpointing) with the small model.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from checkpoint_worker import fill
from fs_faults import remount, tmpfs, without_file_permission_override
from small_model import SMALL_MODEL_SHAPE

from MaxText import generate
from MaxText.checkpoint import integrity
from MaxText.checkpoint import manager as checkpointing
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.errors import CheckpointError
from MaxText.train import main

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "tests" / "checkpoint_worker.py")
MODEL = SMALL_MODEL_SHAPE  # the default layout: scanned layers
COMMON = [
    *MODEL,
    "dataset_type=synthetic",
    "learning_rate_schedule_steps=10",
    "log_period=1",
    "eval_interval=0",
    "enable_progress_bar=false",
    "enable_tensorboard=false",
    "checkpoint_period=5",
]


def argv(base: Path, run: str, *overrides: str) -> list[str]:
    return [
        str(CONFIGS_DIR / "base.yml"),
        *COMMON,
        f"base_output_directory={base}",
        f"run_name={run}",
        *overrides,
    ]


def losses(base: Path, run: str) -> dict[int, float]:
    lines = (base / run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes): a listing and contents together."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """10 uninterrupted steps; checkpoints at 5 and 10."""
    base = tmp_path_factory.mktemp("full")
    assert main(argv(base, "full", "steps=10")) == 0
    return base, losses(base, "full")


@pytest.fixture
def logs():
    logger = logging.getLogger("MaxText")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# The process must exit within this many seconds of printing its one-line error. A clean exit
# (orbax's writes end, the interpreter shuts down) takes about 1 s here; a commit thread left
# waiting for orbax's signal that the step's folder exists waits orbax's coordination timeout
# (300 s) before the interpreter can exit. 60 s leaves room for a loaded CI box and stays far
# below that timeout.
EXIT_AFTER_ERROR_S = 60.0


@dataclasses.dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    exit_after_last_line_s: float  # from the last stderr line read to the process's exit


def run_trainer(*args: str, permissions_apply: bool = False) -> Finished:
    """`python <args>` from the repository, stderr read line by line as it is written so that the
    time between the last line (the error) and the process's exit is measured; with
    `permissions_apply`, run where file permissions apply to it (as a normal user's would)."""
    cmd = [sys.executable, *args]
    if permissions_apply:
        cmd = without_file_permission_override(cmd)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.PIPE, text=True
        )
        lines, last = [], time.monotonic()
        timer = threading.Timer(900, proc.kill)  # a hung run fails the test, not the CI job
        timer.start()
        try:
            for line in proc.stderr:  # ends when the process has exited (its pipe end closed)
                lines.append(line)
                last = time.monotonic()
            returncode = proc.wait()
            exited = time.monotonic()
        finally:
            timer.cancel()
        out.seek(0)
        return Finished(returncode, out.read(), "".join(lines), exited - last)


def assert_one_line_save_failure(done: Finished, step: int, error: str, ckpts: Path) -> None:
    """`done` failed saving `step` with `error` ("No space left on device (ENOSPC)"): exit 1, its
    stderr's last line says so and names step 5 as the newest on disk, nothing else in stderr
    looks like an error, and the process exited at once after that line."""
    assert done.returncode == 1, done.stderr[-3000:]
    err = done.stderr.splitlines()
    head = f"I/O error: saving checkpoint step {step} failed: {error} at "
    assert err[-1].startswith(head), err[-3:]
    assert err[-1].endswith(
        f"; the newest checkpoint on disk is step 5 ({ckpts / '5'}), a restart resumes from "
        f"it; free space or fix the permissions of {ckpts} and run again"
    )
    # the rest of stderr is the trainer's own log lines: no traceback, no orbax noise
    assert "Traceback" not in done.stderr and "Error" not in "\n".join(err[:-1])
    assert done.exit_after_last_line_s < EXIT_AFTER_ERROR_S, done.exit_after_last_line_s


def _biggest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_flipped_bytes_are_damage_and_the_previous_checkpoint_is_used(full_run, tmp_path, logs):
    base, full = full_run
    shutil.copytree(base / "full" / "checkpoints", tmp_path / "run" / "checkpoints")
    bad = tmp_path / "run" / "checkpoints" / "10"
    target = _biggest_file(bad / "state")
    size = target.stat().st_size
    assert size > 8192
    with open(target, "r+b") as f:
        f.seek(size // 2 - 2048)
        f.write(b"\xff" * 4096)
    assert target.stat().st_size == size

    assert main(argv(tmp_path, "run", "steps=10")) == 0
    warnings = [r.getMessage() for r in logs if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"checkpoint {bad} is incomplete or corrupt, skipping it (UnreadableCheckpointError: "
        f"{target.relative_to(bad)} does not match its checksum (crc32 "
    ), warnings[0]
    resumes = [r.getMessage() for r in logs if r.getMessage().startswith("resuming run")]
    assert resumes[0].startswith("resuming run run from checkpoint step 5 (")
    got = losses(tmp_path, "run")
    assert [got[s] for s in range(6, 11)] == [full[s] for s in range(6, 11)]  # bitwise
    moved = list((tmp_path / "run" / checkpointing.CORRUPT_DIR).iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["10"]


def test_a_mode_000_file_is_not_damage_and_moves_nothing(full_run, tmp_path):
    """Read by a process that file permissions apply to: one line, exit 1, nothing moved."""
    base, _ = full_run
    shutil.copytree(base / "full" / "checkpoints", tmp_path / "run" / "checkpoints")
    locked = _biggest_file(tmp_path / "run" / "checkpoints" / "10" / "state")
    before = snapshot(tmp_path / "run")
    locked.chmod(0o000)
    try:
        done = run_trainer(
            "-m", "MaxText.train", *argv(tmp_path, "run", "steps=12"), permissions_apply=True
        )
    finally:
        locked.chmod(0o644)
    err = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert err[-1] == (
        f"I/O error: cannot read checkpoint {tmp_path / 'run' / 'checkpoints' / '10'}: Permission "
        f"denied (EACCES) at {locked}; it is not damaged, so nothing was moved: fix the storage "
        f"or its permissions and run again"
    ), err[-3:]
    assert done.exit_after_last_line_s < EXIT_AFTER_ERROR_S, done.exit_after_last_line_s
    assert not (tmp_path / "run" / checkpointing.CORRUPT_DIR).exists()
    assert snapshot(tmp_path / "run") == before  # no checkpoint moved, written or removed


def test_disk_full_during_an_async_save_is_one_line_and_the_run_resumes(full_run, tmp_path):
    """The default async save of step 10 on a disk that filled up; then space is freed."""
    _, full = full_run
    with tmpfs(tmp_path / "disk", 20) as disk:
        done = run_trainer(WORKER, f"fill:10:{disk}", *argv(disk, "run", "steps=10"))
        ckpts = disk / "run" / "checkpoints"
        assert_one_line_save_failure(done, 10, "No space left on device (ENOSPC)", ckpts)
        assert "FILLED 10" in done.stdout
        assert integrity.verify_checksums(ckpts / "5")
        before = snapshot(ckpts / "5")

        (disk / "filler").unlink()  # space freed
        remount(disk, 40)
        assert main(argv(disk, "run", "steps=10")) == 0
        assert snapshot(ckpts / "5") == before
        got = losses(disk, "run")
        assert [got[s] for s in range(6, 11)] == [full[s] for s in range(6, 11)]
        assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [5, 10]


def test_permission_denied_during_an_async_save_is_one_line(full_run, tmp_path):
    """The checkpoints folder turns read-only to the trainer (mode 555, file permissions applying
    to it) before the default async save of step 10: one line naming the step, EACCES and the
    newest checkpoint on disk (step 5, untouched), exit 1."""
    shutil.copytree(full_run[0] / "full" / "checkpoints" / "5", tmp_path / "run/checkpoints/5")
    ckpts = tmp_path / "run" / "checkpoints"
    before = snapshot(ckpts / "5")
    try:
        done = run_trainer(
            WORKER, f"lock:10:{ckpts}", *argv(tmp_path, "run", "steps=10"), permissions_apply=True
        )
    finally:
        ckpts.chmod(0o755)
    assert_one_line_save_failure(done, 10, "Permission denied (EACCES)", ckpts)
    assert "LOCKED 10" in done.stdout
    assert snapshot(ckpts / "5") == before
    assert sorted(p.name for p in ckpts.iterdir()) == ["5"]


def test_disk_full_during_a_sync_save(full_run, tmp_path, capfd, monkeypatch):
    with tmpfs(tmp_path / "disk", 20) as disk:
        real_save = checkpointing.Checkpoints.save
        seen = {}

        def save(self, step, *args, **kwargs):
            if step == 10:
                self.wait()
                seen["5"] = snapshot(self.directory / "5")
                fill(disk)
            return real_save(self, step, *args, **kwargs)

        monkeypatch.setattr(checkpointing.Checkpoints, "save", save)
        capfd.readouterr()
        assert main(argv(disk, "run", "steps=10", "async_checkpointing=false")) == 1
        err = capfd.readouterr().err.splitlines()
        assert err[-1].startswith(
            "I/O error: saving checkpoint step 10 failed: No space left on device (ENOSPC) at "
        )
        assert "the newest checkpoint on disk is step 5" in err[-1]
        assert snapshot(disk / "run" / "checkpoints" / "5") == seen["5"]


def test_storage_errors_are_damage_or_unavailability():
    """`classify` on the errors measured here for each case, and on bugs."""
    wrapped = Exception("Encountered error while reading array index")  # orbax's wrapper
    wrapped.__cause__ = ValueError(
        'PERMISSION_DENIED: Error reading Byte range [0, 14691) of local file "/c/10/state/d/f9": '
        "Failed to open: \"/c/10/state/d/f9\": Permission denied [os_error_code='13']"
    )
    damaged = [
        ValueError("OUT_OF_RANGE: Requested byte range [0, 9) is not valid for value of size 4"),
        ValueError('DATA_LOSS: Error decoding local file "manifest.ocdbt"'),
        ValueError("NOT_FOUND: Error opening \"/c/d/x\" [os_error_code='2']"),
        FileNotFoundError(errno.ENOENT, "No such file or directory", "config/metadata"),
        json.JSONDecodeError("Expecting value", "{", 1),
        integrity.UnreadableCheckpointError("state/d/x does not match its checksum"),
    ]
    unavailable = [
        wrapped,
        PermissionError(errno.EACCES, "Permission denied", "/c/10/config/metadata"),
        OSError(errno.EIO, "Input/output error", "/c/10/state/d/x"),
        OSError(errno.ENOSPC, "No space left on device"),
        ValueError(
            'RESOURCE_EXHAUSTED: Error writing "x/0" in OCDBT database: Failed writing: "/c/d/8a": '
            "Failed to write 3260416 bytes to file 8: No space left on device [os_error_code='28']"
        ),
        ValueError('UNAVAILABLE: Error reading "/c/d/x"'),
    ]
    bugs = [
        TypeError("unsupported operand"),
        KeyError("state"),
        ValueError("pytree structure error: different types at key path"),
        ValueError("INVALID_ARGUMENT: rank mismatch"),
    ]
    assert [integrity.classify(e) for e in damaged] == [integrity.DAMAGED] * len(damaged)
    assert [integrity.classify(e) for e in unavailable] == [integrity.UNAVAILABLE] * 6
    assert [integrity.classify(e) for e in bugs] == [None] * len(bugs)
    assert [integrity.describe_failure(e) for e in unavailable[:5]] == [
        "Permission denied (EACCES) at /c/10/state/d/f9",
        "Permission denied (EACCES) at /c/10/config/metadata",
        "Input/output error (EIO) at /c/10/state/d/x",
        "No space left on device (ENOSPC)",
        "No space left on device (ENOSPC) at /c/d/8a",
    ]


def test_another_runs_damaged_checkpoint_is_not_moved(full_run, tmp_path):
    """load_parameters_path= names another run: its damage is reported (a checkpoint error,
    exit 2), never moved away."""
    base, _ = full_run
    other = tmp_path / "other"
    shutil.copytree(base / "full", other)
    for step in ("5", "10"):
        (other / "checkpoints" / step / "state" / "manifest.ocdbt").unlink()
    before = snapshot(other)
    config = load_config(argv(tmp_path, "new", f"load_parameters_path={other}"))
    with pytest.raises(CheckpointError) as failed:
        checkpointing.load_params(other, generate.abstract_params(config), config)
    assert str(failed.value) == (
        f"no readable checkpoint in {other / 'checkpoints'} (skipped 10, 5); {other} belongs to "
        f"another run, so nothing was moved; point load_parameters_path at a readable "
        f"checkpoint (a run folder, its checkpoints folder or one step's folder)"
    )
    assert snapshot(other) == before
