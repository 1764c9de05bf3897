"""Stopping like a cluster job: SIGTERM / SIGINT save the step in flight and exit 128 + N.

A real trainer process (`python -m MaxText.train`, small model with the default keys: scanned
layers, async checkpointing, one grain worker process reading the shards) gets the signal
mid-training, either alone (`kill PID`, as a scheduler may) or with its whole process group
(Ctrl-C, SLURM). Checked: the exit code, the one line saying which step is on disk, that step's
checkpoint, no traceback or leaked-shared-memory warning from anyone, and that no child process
(grain workers, multiprocessing's resource tracker) outlives the trainer; the saved step then
resumes in this process and continues bitwise like an uninterrupted run. A second Ctrl-C stops at
once without saving. Two processes (`MaxText.launch`, pipeline_parallelism=2): SIGTERM to one of
them makes both save the same step and exit 143.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from grain_corpus import prepare_shards
from small_model import SMALL_MODEL_SHAPE, merged

from MaxText.checkpoint import integrity
from MaxText.config import CONFIGS_DIR
from MaxText.train import main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MODEL = SMALL_MODEL_SHAPE  # the default layout: scanned layers


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepare_shards(tmp_path_factory.mktemp("corpus"), seed=3)


def argv(shards: Path, base: Path, *overrides: str) -> list[str]:
    return merged(
        str(CONFIGS_DIR / "base.yml"),
        *MODEL,
        "vocab_size=512",
        "dataset_type=grain",
        f"grain_train_files={shards}/train-*.array_record",
        "grain_worker_count=1",  # the default, said here: data_workers counts the processes
        "learning_rate_schedule_steps=60",
        "log_period=1",
        "eval_interval=0",
        "enable_progress_bar=false",
        "enable_tensorboard=false",
        "checkpoint_period=1000",  # only the stop saves, unless a test says otherwise
        f"base_output_directory={base}",
        "run_name=run",
        *overrides,
    )


def losses(base: Path) -> dict[int, float]:
    lines = (base / "run" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def steps_on_disk(base: Path) -> list[int]:
    folder = base / "run" / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def children(pid: int) -> list[int]:
    """Every process whose parent is `pid` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22); None once it is gone
    or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def data_workers(pid: int) -> list[tuple[int, int]]:
    """The trainer's child processes, found before it is signalled (so that "none alive
    afterwards" means something): its grain worker (grain_worker_count=1, started by
    multiprocessing's spawn) and multiprocessing's resource tracker, each as (pid, start time)."""
    kids = [(kid, start) for kid in children(pid) if (start := _start_time(kid)) is not None]
    lines = [Path(f"/proc/{kid}/cmdline").read_bytes() for kid, _ in kids]
    assert sum(b"spawn_main" in line for line in lines) == 1, lines
    assert sum(b"resource_tracker" in line for line in lines) == 1, lines
    return kids


def alive(kids: list[tuple[int, int]], timeout: float = 30.0) -> list[int]:
    """The pids of `kids` still running, once the trainer's output pipe has ended (`finish`).

    Every kid inherited that pipe and closes it only when it exits, so by then each is gone or
    inside its exit (its files closed, not yet a zombie: on a loaded machine that lasts a moment,
    and a snapshot taken then saw one "alive"). Each is therefore waited for on its pidfd (an
    event, no sleep) up to `timeout` seconds; a kid still running after that is reported. A pid
    with another start time is another process: on a busy machine the pid space (32768 here,
    threads included) wraps within a test."""
    deadline = time.monotonic() + timeout
    running = []
    for pid, start in kids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if _start_time(pid) != start:
                continue
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                running.append(pid)
        finally:
            os.close(fd)
    return running


_STARTED: list = []  # every Trainer a test started: none may outlive its test


@pytest.fixture(autouse=True)
def _no_trainer_left_running():
    """A test that fails before its trainer exits (a `wait_for` timing out) must not leave it
    training (`steps=100000`) with its data workers: its process group is killed."""
    yield
    while _STARTED:
        proc = _STARTED.pop().proc
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


class Trainer:
    """A trainer subprocess in its own session; its output is collected line by line."""

    def __init__(self, args: list[str], module: str = "MaxText.train"):
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        if module == "MaxText.launch":
            env.pop("XLA_FLAGS", None)  # each process emulates the devices it needs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        _STARTED.append(self)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()

    def wait_for(self, text: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        with self._seen:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no line with {text!r}:\n" + "\n".join(self.lines[-30:]))
                self._seen.wait(min(left, 1.0))

    def finish(self, timeout: float = 300) -> str:
        """Every line the process and its children wrote: the reader ends at the pipe's end of
        file, i.e. once every process holding the pipe (grain workers included) has exited."""
        self.proc.wait(timeout)
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "a child of the trainer still holds its stdout"
        return "\n".join(self.lines)


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """60 uninterrupted steps, in this process, reading in this process (grain_worker_count=0:
    grain's prefetch keeps the element order whatever the worker count, so the batches are a
    worker's, as tests/test_data_grain_train.py checks bitwise; a worker process costs ~4 s of
    CPU to start). The resumed run under test keeps its worker."""
    base = tmp_path_factory.mktemp("reference")
    assert main(argv(shards, base, "steps=60", "grain_worker_count=0")) == 0
    return losses(base)


def _stopped_line(out: str, name: str, base: Path, code: int) -> int:
    """The step named by the one line a stopped run ends with (checked word for word)."""
    lines = [line for line in out.splitlines() if "stopped after step" in line]
    assert len(lines) == 1, out[-3000:]
    step = int(lines[0].split("stopped after step ")[1].split(";")[0])
    folder = base / "run" / "checkpoints" / str(step)
    assert lines[0].endswith(
        f"{name}: stopped after step {step}; checkpoint step {step} is on disk ({folder}); "
        f"exit code {code}"
    ), lines[0]
    return step


def _no_noise(out: str) -> None:
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert "leaked" not in out, out[-3000:]  # multiprocessing's resource tracker


def test_sigterm_to_the_trainer_alone_saves_and_resumes_bitwise(shards, reference, tmp_path):
    trainer = Trainer(argv(shards, tmp_path, "steps=100000"))
    trainer.wait_for("step 5/")
    kids = data_workers(trainer.proc.pid)
    trainer.proc.send_signal(signal.SIGTERM)
    out = trainer.finish()
    assert trainer.proc.returncode == 143, out[-3000:]
    step = _stopped_line(out, "SIGTERM", tmp_path, 143)
    assert 5 <= step < 55
    _no_noise(out)
    assert alive(kids) == []
    assert steps_on_disk(tmp_path) == [step]

    assert main(argv(shards, tmp_path, "steps=60")) == 0  # resumes from the saved step
    got = losses(tmp_path)
    assert [got[s] for s in range(step + 1, 61)] == [reference[s] for s in range(step + 1, 61)]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_process_group(shards, tmp_path, signum):
    """Ctrl-C (SIGINT), or a scheduler's SIGTERM to the job's process group (as SLURM's scancel
    and its time limit send it), reaches the trainer and its grain worker: the worker ignores
    it, the trainer saves and stops it; nobody prints a traceback."""
    trainer = Trainer(argv(shards, tmp_path, "steps=100000"))
    trainer.wait_for("step 5/")
    kids = data_workers(trainer.proc.pid)
    os.killpg(trainer.proc.pid, signum)
    out = trainer.finish()
    code = 128 + signum
    assert trainer.proc.returncode == code, out[-3000:]
    name = signal.Signals(signum).name
    step = _stopped_line(out, name, tmp_path, code)
    again = " (Ctrl-C again to stop" if signum == signal.SIGINT else ""
    assert f"{name}: saving after the step in flight, then stopping{again}" in out
    _no_noise(out)
    assert alive(kids) == []
    assert steps_on_disk(tmp_path) == [step]


def test_a_second_sigint_stops_at_once_without_saving(shards, tmp_path):
    trainer = Trainer(argv(shards, tmp_path, "steps=100000", "checkpoint_period=3"))
    trainer.wait_for("checkpoint step 6 ->")
    kids = data_workers(trainer.proc.pid)
    os.killpg(trainer.proc.pid, signal.SIGINT)
    trainer.wait_for("SIGINT: saving after the step in flight")
    os.killpg(trainer.proc.pid, signal.SIGINT)
    out = trainer.finish()
    assert trainer.proc.returncode == 130, out[-3000:]
    assert "stopped after step" not in out
    _no_noise(out)
    assert alive(kids) == []
    on_disk = steps_on_disk(tmp_path)
    newest = tmp_path / "run" / "checkpoints" / str(on_disk[-1])
    assert (
        f"SIGINT again: stopping now without saving; the newest checkpoint on disk is step "
        f"{on_disk[-1]} ({newest})"
    ) in out
    for step in on_disk:  # every complete checkpoint is intact
        assert integrity.verify_checksums(tmp_path / "run" / "checkpoints" / str(step))


DEFERRED_STOP = """
import os, signal, sys, threading
from MaxText.cluster import preemption
preemption.STOP_NOW_WAIT_S = float(sys.argv[1])
with preemption.StopRequests() as stops:
    stops.loop_started()
    stops.on_stop_now = lambda: "cleanup ran"
    os.kill(os.getpid(), signal.SIGINT)  # the first: save after the step in flight
    with stops.stop_now_deferred():
        os.kill(os.getpid(), signal.SIGINT)  # the second, inside the block
        print("still in the block", flush=True)
        if sys.argv[2] == "hangs":
            threading.Event().wait()
    print("after the block", flush=True)
"""


@pytest.mark.parametrize("block", ["ends", "hangs"])
def test_a_second_sigint_inside_a_data_fetch_stops_when_it_ends(block):
    """The loop's data fetch is a `stop_now_deferred` block: a second Ctrl-C there (its handler
    runs in the main thread, inside grain's reader) stops the process when the block ends, not
    in the middle of it, and after `STOP_NOW_WAIT_S` (here 1 s) if the block never ends."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", DEFERRED_STOP, "1.0", block],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 130, done.stderr
    assert done.stdout.splitlines() == ["still in the block"], done.stdout
    assert "SIGINT again: stopping now without saving; cleanup ran" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if block == "hangs":
        assert time.monotonic() - started >= 1.0


def _signal_one_of_two(shards, tmp_path, signum: int) -> tuple[Trainer, str, dict, int]:
    """A 2-process run (pp=2) under the launcher; `signum` sent to process 1 alone at step 5.
    Returns (launcher, output, {"[p0]": exit code text, "[p1]": ...}, the step both stopped
    after), having checked that both stopped after that one step and saved it together.

    The processes read their data themselves (grain_worker_count=0): what is checked here is the
    two processes stopping together; stopping a trainer's grain worker is the single-process
    tests' (a signal to the trainer alone, and to its process group), and a worker in each of
    the 2 processes would cost 2 worker processes' start-up (~4 s of CPU each)."""
    args = argv(shards, tmp_path, "steps=100000", "pipeline_parallelism=2", "grain_worker_count=0")
    launch = ["--num_processes", "2", "--timeout", "900", "--", *args]
    launcher = Trainer(launch, module="MaxText.launch")
    launcher.wait_for("[p0] step 5/")
    p1 = [
        pid
        for pid in children(launcher.proc.pid)
        if "process_id=1" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    assert len(p1) == 1
    os.kill(p1[0], signum)
    out = launcher.finish(timeout=600)
    stopped = [line for line in out.splitlines() if "stopped after step" in line]
    assert len(stopped) == 2, out[-3000:]
    steps = {int(line.split("stopped after step ")[1].split(";")[0]) for line in stopped}
    assert len(steps) == 1, stopped  # the same step on both processes
    (step,) = steps
    assert steps_on_disk(tmp_path) == [step]
    assert "Traceback" not in out
    codes = {line.split(" ", 1)[0]: line.rsplit("exit code ", 1)[1] for line in stopped}
    return launcher, out, codes, step


def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(shards, tmp_path):
    """JAX's preemption sync point: the process that got SIGTERM and its peer stop after the
    same step, save it together and exit 143; the launcher returns 143."""
    launcher, out, codes, _ = _signal_one_of_two(shards, tmp_path, signal.SIGTERM)
    assert launcher.proc.returncode == 143, out[-3000:]
    assert codes == {"[p0]": "143", "[p1]": "143"}
    why = "SIGTERM (a preemption notice to this job): stopped after step"
    assert all(why in line for line in out.splitlines() if "stopped after step" in line)


def test_sigint_to_one_of_two_processes_stops_both_at_the_same_step(shards, tmp_path):
    """SIGINT (Ctrl-C) reaching one process of two: its handler files JAX's preemption notice,
    so both stop after the same step and save it together; that process exits 130, its peer 143
    (the launcher, which did not send the signal, waits for both to save and returns process
    0's code)."""
    launcher, out, codes, _ = _signal_one_of_two(shards, tmp_path, signal.SIGINT)
    assert launcher.proc.returncode == 143, out[-3000:]
    assert codes == {"[p0]": "143", "[p1]": "130"}
