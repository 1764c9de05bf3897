"""One exit-code table for every entry point (`MaxText/exit_codes.py`), tested per tool, and the
paths each tool checks before it compiles anything.

0 success, 1 run failure, 2 user/config/data/path error, 3 hang watchdog, 128+N after a handled
signal N. Each case runs the tool's `main` in this process (the launcher also with stand-in child
processes); a path or usage error must come before any compile, which the tests make fail loudly
(`build_trainer`, the planner's `make_plan` replaced by a function that raises).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from fs_faults import readonly
from small_model import SMALL_MODEL

from jaxpp_integration.runtime.watchdog import HANG_EXIT_CODE
from MaxText import exit_codes, generate, launch, plan
from MaxText import train as train_lib
from MaxText.config import CONFIGS_DIR
from MaxText.data import prepare as prepare_lib
from MaxText.errors import ConfigError, PathError, StorageError
from MaxText.train import TrainingDivergedError

BASE = [str(CONFIGS_DIR / "base.yml"), *SMALL_MODEL, "dataset_type=synthetic", "steps=2"]


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def no_compile(monkeypatch):
    """Anything that would compile the trainer's step (or plan it) fails the test."""

    def compiled(*args, **kwargs):
        raise AssertionError("compiled before the error was reported")

    monkeypatch.setattr(train_lib, "build_trainer", compiled)
    monkeypatch.setattr(plan, "make_plan", compiled)


def test_the_table():
    assert (exit_codes.OK, exit_codes.RUN_FAILURE, exit_codes.USER_ERROR) == (0, 1, 2)
    assert exit_codes.HANG == HANG_EXIT_CODE == 3
    assert exit_codes.after_signal(signal.SIGTERM) == 143
    assert exit_codes.after_signal(signal.SIGINT) == 130
    assert exit_codes.from_returncode(-signal.SIGKILL) == 137  # Popen: killed by signal 9
    assert exit_codes.from_returncode(143) == 143 and exit_codes.from_returncode(0) == 0
    codes = {
        ConfigError("c"): (2, "config error: c"),
        PathError("p"): (2, "path error: p"),
        prepare_lib.DataError("d"): (2, "data error: d"),
        StorageError("s\nmore"): (1, "I/O error: s"),
        TrainingDivergedError("loss is nan at step 3"): (1, "error: loss is nan at step 3"),
    }
    for error, (code, line) in codes.items():
        assert exit_codes.exit_code_of(error) == code
        assert exit_codes.first_line(error) == line.split(": ", 1)[1]
        assert f"{type(error).prefix}: {exit_codes.first_line(error)}" == line
    assert exit_codes.exit_code_of(ValueError("a bug")) is None


# ----------------------------------------------------------------------------------------- train


def _paths(tmp: Path) -> dict:
    afile = tmp / "a_file"
    afile.write_text("x")
    return {
        "under_proc": (
            ["base_output_directory=/proc/nope"],
            "path error: base_output_directory=/proc/nope/run: cannot create folder "
            "/proc/nope/run (No such file or directory, ENOENT); use a folder you can write to",
        ),
        "a_file": (
            [f"base_output_directory={afile}"],
            f"path error: base_output_directory={afile}/run: cannot create folder {afile}/run "
            f"(Not a directory, ENOTDIR); use a folder you can write to",
        ),
        "metrics_under_proc": (
            [f"base_output_directory={tmp}", "metrics_file=/proc/m.jsonl"],
            "path error: metrics_file=/proc/m.jsonl: cannot write in /proc (",
        ),
        "jax_cache_under_proc": (
            [f"base_output_directory={tmp}", "jax_cache_dir=/proc/nope/cache"],
            "path error: jax_cache_dir=/proc/nope/cache: cannot create folder /proc/nope/cache "
            "(No such file or directory, ENOENT); use a folder you can write to",
        ),
        "load_parameters_file": (
            [f"base_output_directory={tmp}", f"load_parameters_path={afile}"],
            f"path error: load_parameters_path={afile}: {afile} is a file; give a run folder, "
            f"its checkpoints folder or one step's folder",
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["under_proc", "a_file", "metrics_under_proc", "jax_cache_under_proc", "load_parameters_file"],
)
def test_train_path_errors_exit_2_before_compiling(tmp_path, capsys, no_compile, case):
    overrides, want = _paths(tmp_path)[case]
    assert train_lib.main([*BASE, "run_name=run", *overrides]) == 2
    assert _one_line(capsys).startswith(want)


@pytest.mark.parametrize("where", ["output", "checkpoints", "tensorboard", "jax_cache_dir"])
def test_train_read_only_folders_exit_2_before_compiling(tmp_path, capsys, no_compile, where):
    """A read-only output folder, or a read-only folder the run writes inside a writable one:
    checkpoints/ and tensorboard/ (before, found at the first save or event), `jax_cache_dir`
    (found when the first compiled program is written)."""
    run = tmp_path / "out" / "run"
    target = {"output": tmp_path / "out", "jax_cache_dir": tmp_path / "cache"}.get(
        where, run / where
    )
    argv = [*BASE, f"base_output_directory={tmp_path / 'out'}", "run_name=run"]
    argv += ["enable_tensorboard=true", f"jax_cache_dir={tmp_path / 'cache'}"]
    with readonly(target):
        code = train_lib.main(argv)
        line = _one_line(capsys)
    assert code == 2
    key = "jax_cache_dir" if where == "jax_cache_dir" else "base_output_directory"
    shown = {"output": run, "jax_cache_dir": target}.get(where, target)
    assert line.startswith(f"path error: {key}={shown}: "), line
    assert "Read-only file system, EROFS" in line or "Permission denied, EACCES" in line


def test_train_config_error_exits_2(tmp_path, capsys, no_compile):
    assert train_lib.main([*BASE, "num_decoder_layer=3"]) == 2
    assert _one_line(capsys).startswith("config error: unknown config key 'num_decoder_layer'")


def test_a_signal_while_compiling_stops_after_the_compile_in_flight(tmp_path):
    """SIGTERM while XLA compiles the step (a real compile, no persistent cache): Python runs the
    trainer's handler only when that C++ call returns, so the trainer finishes the compile in
    flight, starts no other, says nothing new was saved and exits 143; no checkpoint is written.
    Bound on what follows the compile: 10 s (only Python unwinding and one printed line remain;
    ms on a quiet machine, the margin is for a loaded CI box).

    It runs in a process of its own (tests/signal_compile_worker.py): the handler raises out of
    JAX's compile path, and a thread reads the main thread's frames; neither should share a
    process with the rest of the suite (an xdist worker crashed twice in this test, natively,
    after the trainer had returned). The worker exits 0 once it has written what it saw."""
    out = tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    worker = Path(__file__).with_name("signal_compile_worker.py")
    argv = [*BASE, f"base_output_directory={tmp_path}", "run_name=run"]
    proc = subprocess.run(
        [sys.executable, str(worker), str(out), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    seen = json.loads(out.read_text())
    assert seen["sent"] is not None, "no backend_compile_and_load frame seen: did JAX rename it?"
    assert seen["code"] == 143 and not seen["built"]
    assert seen["stderr"] == ["SIGTERM: stopped before the first step; nothing new to save"]
    assert seen["compiles_after"] == 0
    assert seen["returned"] - seen["left"] < 10.0, seen
    assert not [p for p in (tmp_path / "run" / "checkpoints").glob("*") if p.name.isdigit()]


def test_a_failing_metrics_write_is_one_io_line(tmp_path, capsys, monkeypatch):
    """Writing metrics.jsonl fails (a full disk) at step 2, after step 1 was checkpointed: one
    `I/O error:` line naming the file, the errno and the newest checkpoint on disk (step 1, whose
    background save the message waits for), exit 1."""
    import errno

    from MaxText import metrics

    written = []

    def full_at_step_2(self, record):
        if record["step"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(record["step"])

    monkeypatch.setattr(metrics.MetricsLogger, "write", full_at_step_2)
    argv = [*BASE, f"base_output_directory={tmp_path}", "run_name=run", "log_period=1"]
    argv += ["enable_progress_bar=false", "checkpoint_period=1"]
    assert train_lib.main(argv) == 1
    run = tmp_path / "run"
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"checkpoint step 1 -> {run / 'checkpoints' / '1'} (async")
    assert err[1:] == [
        f"I/O error: writing metrics to {run / 'metrics.jsonl'} failed: No space left on device, "
        f"ENOSPC; the newest checkpoint on disk is step 1 ({run / 'checkpoints' / '1'})"
    ]
    assert written == [1]


# ------------------------------------------------------------------------------------------ plan


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--memory-gb", "-5"], "argument --memory-gb: must be > 0, got -5"),
        (["--efficiency", "0"], "argument --efficiency: must be in (0, 1], got 0"),
        (["--peak-tflops", "nan"], "argument --peak-tflops: must be > 0, got nan"),
    ],
)
def test_plan_hardware_flags_out_of_range_exit_2(capsys, no_compile, flags, want):
    with pytest.raises(SystemExit) as stop:
        plan.main([*BASE, "--hardware", "cpu", *flags])
    assert stop.value.code == 2
    assert want in capsys.readouterr().err


def test_plan_flags_reach_the_hardware(monkeypatch):
    """--efficiency is applied (it was dropped when 0, and any falsy value), --memory-gb too."""
    seen = {}

    def capture(config, hardware, base):
        seen["hardware"] = hardware
        raise StopIteration

    monkeypatch.setattr(plan, "make_plan", capture)
    with pytest.raises(StopIteration):
        plan.main([*BASE, "--hardware", "cpu", "--efficiency", "0.25", "--memory-gb", "3"])
    assert seen["hardware"].efficiency == 0.25 and seen["hardware"].memory_bytes == 3e9


def test_plan_json_path_is_checked_before_planning(tmp_path, capsys, no_compile):
    assert plan.main([*BASE, "--hardware", "cpu", "--json", "/proc/plan.json"]) == 2
    assert _one_line(capsys).startswith("path error: --json=/proc/plan.json: cannot write in /proc")
    assert plan.main([*BASE, "--hardware", "cpu", "--json", str(tmp_path)]) == 2
    assert (
        _one_line(capsys)
        == f"path error: --json={tmp_path}: {tmp_path} is a folder; give a file name"
    )


# -------------------------------------------------------------------------------------- generate


def test_generate_errors_exit_2(tmp_path, capsys):
    afile = tmp_path / "params"
    afile.write_text("x")
    argv = [*BASE, f"base_output_directory={tmp_path}", "run_name=none"]
    assert generate.main(argv) == 2
    assert _one_line(capsys) == f"checkpoint error: {tmp_path / 'none'} does not exist"
    assert generate.main([*argv, f"load_parameters_path={afile}"]) == 2
    assert _one_line(capsys) == (
        f"checkpoint error: {afile} is a file; give a run folder, its checkpoints folder or one "
        f"step's folder"
    )


# ---------------------------------------------------------------------------------- data.prepare


def test_prepare_exit_codes(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("to be or not to be " * 50)
    afile = tmp_path / "a_file"
    afile.write_text("x")
    assert prepare_lib.main(["--input", str(corpus), "--out", str(afile), "--quiet"]) == 2
    assert (
        _one_line(capsys)
        == f"path error: --out={afile}: {afile} is a file, not a folder; give a folder"
    )
    (corpus / "b.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    assert prepare_lib.main(["--input", str(corpus), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert _one_line(capsys) == (
        f"data error: {corpus / 'b.txt'} is not UTF-8 text (byte 0x80 at offset 136); convert it "
        f"to UTF-8 or leave it out of --input"
    )
    (corpus / "b.txt").write_bytes(b"text\x00with a NUL")
    assert prepare_lib.main(["--input", str(corpus), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert _one_line(capsys) == (
        f"data error: {corpus / 'b.txt'} looks like a binary file (NUL byte at offset 4); leave "
        f"it out of --input"
    )
    (corpus / "b.txt").unlink()
    (corpus / "c.jsonl").write_bytes(json.dumps({"text": "fine"}).encode() + b"\n\xff\xfe\n")
    assert prepare_lib.main(["--input", str(corpus), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert _one_line(capsys).startswith(f"data error: {corpus / 'c.jsonl'}:2 is not UTF-8 text")
    (corpus / "c.jsonl").unlink()
    assert (
        prepare_lib.main(
            ["--input", str(corpus), "--out", str(tmp_path / "o"), "--quiet", "--vocab_size", "300"]
        )
        == 0
    )


# ---------------------------------------------------------------------------------------- launch

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    mode = sys.argv[1]
    if mode == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    def stop(signum, frame):
        print(f"child got {signal.Signals(signum).name}", flush=True)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    open(os.path.join(os.path.dirname(__file__), f"ready_{os.getpid()}"), "w").close()
    time.sleep(120)
    """
)


def test_launch_reports_a_child_killed_by_signal_9_as_137(tmp_path, capsys):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    assert launch.launch(2, ["kill9"], script=child, timeout=60) == 137
    assert "exited with 137" in capsys.readouterr().out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_launch_forwards_signals_and_returns_128_plus_n(tmp_path, capsys, signum):
    """The launcher's children run in their own session (a terminal's Ctrl-C reaches the
    launcher only); the launcher forwards the signal once to each and returns their 128 + N."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)

    def signal_launcher_when_children_are_ready():
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready_*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signum)  # as a terminal's Ctrl-C or a scheduler would

    before = signal.getsignal(signum)
    sender = threading.Thread(target=signal_launcher_when_children_are_ready, daemon=True)
    sender.start()
    code = launch.launch(2, ["wait"], script=child, timeout=100)
    sender.join()
    out = capsys.readouterr().out
    assert code == 128 + signum, out
    name = signal.Signals(signum).name
    assert out.count(f"child got {name}") == 2, out  # each child once
    assert f"[launch] {name}: forwarded to the trainers" in out
    assert signal.getsignal(signum) is before  # the launcher's handler is gone again
