"""Checkpoints: exact resume, resume on other layouts, crash safety, load_parameters_path, generate.

Runs train with `MaxText.train.main` in this process (8 emulated CPU devices, conftest.py) except
where a process must die: those start `python -m MaxText.train` (or tests/checkpoint_worker.py) in
a subprocess with the same environment, kill it with SIGKILL and restart the run in-process.
Losses are read back from each run's metrics.jsonl (log_period=1), last record per step, so a
restarted run's records replace the ones the killed process wrote after its last checkpoint.

All runs share one small config (4 layers so pipeline_parallelism=4 has a layer per stage) at equal
global batch (8) and microbatching (4), with `learning_rate_schedule_steps=20` so a run stopped
at step 10 has the same schedule as the 20-step run it is compared with. SPMD runs use the
default layout (scanned layers); the pipelined and cross-layout runs unrolled layers (`UNROLLED`:
the layout bounds were measured with them, tests/small_model.py), so the on-disk tree is compared
across both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from compare import assert_bitwise as cmp_bitwise
from compare import assert_close_per_leaf, assert_on_group, host, put_like, reordered_sum_rtol
from small_model import SMALL_MODEL_SHAPE, SMALL_MODEL_TOKENS, merged
from trainer_checks import random_batches

from MaxText import generate, sharding
from MaxText import train as checkpoint_train
from MaxText.checkpoint import manager as checkpointing
from MaxText.checkpoint import restore as checkpoint_restore
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.data import make_data
from MaxText.train import main
from MaxText.train_step import build_trainer

REPO = Path(__file__).resolve().parent.parent

COMMON = [
    *SMALL_MODEL_SHAPE,
    "dataset_type=synthetic",
    "num_pipeline_microbatches=4",
    "learning_rate_schedule_steps=20",
    "log_period=1",
    "eval_interval=0",
    "enable_progress_bar=false",
    "enable_tensorboard=false",
    "enable_checkpointing=true",
    "checkpoint_period=5",
]


def argv(base: Path, run: str, *overrides: str) -> list[str]:
    return merged(
        str(CONFIGS_DIR / "base.yml"),
        *COMMON,
        f"base_output_directory={base}",
        f"run_name={run}",
        *overrides,
    )


def train(base: Path, run: str, *overrides: str) -> None:
    assert main(argv(base, run, *overrides)) == 0


def losses(base: Path, run: str) -> dict[int, float]:
    out = {}
    for line in (base / run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


def assert_bitwise(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    assert [got[s] for s in steps] == [want[s] for s in steps]


def complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    """A new run whose only checkpoint is `step` of `src_run`."""
    shutil.copytree(src_run / "checkpoints" / str(step), dst_run / "checkpoints" / str(step))


@pytest.fixture(scope="module")
def spmd_full(tmp_path_factory):
    """20 uninterrupted SPMD steps; checkpoints at 10, 15, 20 (5 deleted: keep 3)."""
    base = tmp_path_factory.mktemp("spmd")
    train(base, "full", "steps=20")
    return base, losses(base, "full")


# --------------------------------------------------------------------------- exact resume (SPMD)


def test_resume_spmd_is_bitwise(spmd_full, tmp_path, capsys, logs):
    full_dir, full = spmd_full
    assert complete_steps(full_dir / "full") == [10, 15, 20]
    train(tmp_path, "run", "steps=10")
    assert complete_steps(tmp_path / "run") == [5, 10]  # every 5 steps, and the last
    logs.clear()
    train(tmp_path, "run", "steps=20")
    assert logs.resumes() == [
        f"resuming run run from checkpoint step 10 ({tmp_path / 'run' / 'checkpoints' / '10'})"
    ]
    assert_bitwise(losses(tmp_path, "run"), full, range(1, 21))

    # The data position and RNG were saved with it.
    step_dir = tmp_path / "run" / "checkpoints" / "20"
    data_state = json.loads((step_dir / "data_iter" / "metadata").read_text())
    assert data_state["position"] == 20 * 8
    rng = json.loads((step_dir / "rng" / "metadata").read_text())
    assert rng["seed"] == 0 and len(rng["key_data"]) == 2
    config = json.loads((step_dir / "config" / "metadata").read_text())
    assert config["steps"] == 20 and config["run_name"] == "run"

    # A run already at `steps` says so and exits 0.
    capsys.readouterr()
    train(tmp_path, "run", "steps=20")
    assert "run run is already at step 20 >= steps=20" in capsys.readouterr().out


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("record", [True, False], ids=["checksums", "no_checksums"])
def test_truncated_latest_checkpoint_falls_back(spmd_full, tmp_path, logs, capfd, record):
    """A file of checkpoint 20 cut in half: the restart warns, names it, resumes from 15.

    Nothing else on stderr: no traceback from reads abandoned inside orbax (the damage is found
    before orbax reads the arrays: by the checksums, or, for a checkpoint without a record as
    older versions wrote them, by reading every stored chunk once)."""
    full_dir, full = spmd_full
    shutil.copytree(full_dir / "full" / "checkpoints", tmp_path / "run" / "checkpoints")
    bad = tmp_path / "run" / "checkpoints" / "20"
    if not record:
        (bad / "checksums.json").unlink()
    files = [p for p in bad.rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)  # array data
    size = biggest.stat().st_size
    with open(biggest, "r+b") as f:
        f.truncate(size // 2)

    capfd.readouterr()
    train(tmp_path, "run", "steps=20")
    assert "Traceback" not in capfd.readouterr().err
    warnings = logs.messages(logging.WARNING)
    why = (
        f"UnreadableCheckpointError: {biggest.relative_to(bad)} has {size // 2} bytes, {size} "
        f"when written (checksums.json))"
        if record  # else tensorstore's words from the pre-read, not orbax's "Error reading ..."
        else "ValueError: OUT_OF_RANGE: Requested byte range"
    )
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"checkpoint {bad} is incomplete or corrupt, skipping it ({why}")
    assert logs.resumes()[0].startswith("resuming run run from checkpoint step 15 (")
    assert_bitwise(losses(tmp_path, "run"), full, range(16, 21))
    # The corrupt one was set aside, so step 20 could be written again.
    assert [p.name.split("-")[0] for p in (tmp_path / "run" / "checkpoints_corrupt").iterdir()] == [
        "20"
    ]
    assert complete_steps(tmp_path / "run") == [10, 15, 20]


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes): a listing and contents together."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["read_state", "orbax_restore", "check_model"])
def test_a_bug_in_restore_propagates_and_moves_nothing(spmd_full, tmp_path, monkeypatch, where):
    """A programming error while restoring (here a TypeError put into our read, into orbax's
    restore, or into the model check) is not a damaged checkpoint: it reaches the caller with its
    traceback, and every checkpoint folder stays exactly as it was (nothing quarantined)."""
    import orbax.checkpoint as ocp

    full_dir, _ = spmd_full
    shutil.copytree(full_dir / "full" / "checkpoints", tmp_path / "run" / "checkpoints")
    before = _snapshot(tmp_path / "run")

    def bug(*args, **kwargs):
        raise TypeError("a bug in the restore path")

    target = {
        "read_state": (checkpoint_restore, "_read_state"),
        "orbax_restore": (ocp.CheckpointManager, "restore"),
        "check_model": (checkpoint_restore, "check_model"),
    }[where]
    monkeypatch.setattr(*target, bug)
    with pytest.raises(TypeError, match="a bug in the restore path"):
        main(argv(tmp_path, "run", "steps=20"))
    assert not (tmp_path / "run" / checkpointing.CORRUPT_DIR).exists()
    assert _snapshot(tmp_path / "run") == before


def test_storage_errors_are_told_from_bugs():
    """The classification `restore_latest` relies on, on the errors measured for real damage
    (truncated data file, missing/garbled OCDBT file, missing metadata) and on bugs."""
    tensorstore_read = ValueError('FAILED_PRECONDITION: Error reading "params.x/0" in OCDBT')
    wrapped = Exception("Encountered error while reading array index")  # orbax's wrapper
    wrapped.__cause__ = tensorstore_read
    storage = [
        ValueError("OUT_OF_RANGE: Requested byte range [0, 9) is not valid for value of size 4"),
        ValueError('DATA_LOSS: Error decoding local file "manifest.ocdbt"'),
        wrapped,
        FileNotFoundError("config/metadata not found"),
        json.JSONDecodeError("Expecting value", "{", 1),
        checkpointing.UnreadableCheckpointError("state/_METADATA is missing"),
    ]
    bugs = [
        TypeError("unsupported operand"),
        AttributeError("no attribute"),
        KeyError("state"),
        ValueError("pytree structure error: different types at key path"),
        ValueError("INVALID_ARGUMENT: rank mismatch"),  # wrong arguments: the caller's bug
    ]
    assert [checkpointing.is_storage_error(e) for e in storage] == [True] * len(storage)
    assert [checkpointing.is_storage_error(e) for e in bugs] == [False] * len(bugs)


def test_truncated_metadata_file_falls_back(spmd_full, tmp_path, logs):
    """orbax reads past a truncated _CHECKPOINT_METADATA; we still treat the checkpoint as bad."""
    full_dir, _ = spmd_full
    shutil.copytree(full_dir / "full" / "checkpoints", tmp_path / "run" / "checkpoints")
    meta = tmp_path / "run" / "checkpoints" / "20" / "_CHECKPOINT_METADATA"
    meta.write_text(meta.read_text()[:40])
    config = load_config(argv(tmp_path, "run", "steps=20"))
    trainer = build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )
    ckpt = checkpointing.Checkpoints(config, trainer)
    try:
        state = ckpt.restore_or_init(make_data(config))
    finally:
        ckpt.close()
    assert int(np.asarray(state["step"])) == 15
    assert any("_CHECKPOINT_METADATA is not valid JSON" in m for m in logs.messages())


def test_load_parameters_path_starts_a_new_run(spmd_full, tmp_path, logs):
    full_dir, _ = spmd_full
    src = full_dir / "full" / "checkpoints"
    config = load_config(argv(tmp_path, "new", "steps=20", f"load_parameters_path={src}"))
    trainer = build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )
    abstract = trainer.abstract_state["params"]
    for path, want_step in ((src, 20), (src / "15", 15)):
        ckpt = checkpointing.Checkpoints(
            load_config(argv(tmp_path, "new", "steps=20", f"load_parameters_path={path}")),
            trainer,
        )
        state = ckpt.restore_or_init(make_data(config))
        ckpt.close()
        saved, _ = checkpointing.load_params(path, abstract, config)
        assert int(np.asarray(state["step"])) == 0  # a new run: step, optimizer and data fresh
        for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(np.asarray(got), want)
        mu = state["opt_state"][1][0].mu
        assert all(not np.asarray(x).any() for x in jax.tree.leaves(mu))
        assert logs.messages()[-1] == (
            f"new run new starts from the parameters of checkpoint step {want_step} "
            f"({src / str(want_step)})"
        )


def test_checkpoint_of_another_model_is_a_config_error(spmd_full, tmp_path, capsys, monkeypatch):
    """Resuming a run whose checkpoint holds another model is one config error, found from the
    checkpoint's saved config before anything is compiled (no trainer is built); the same for
    `load_parameters_path` in a new run."""
    full_dir, _ = spmd_full
    copy_checkpoint(full_dir / "full", 20, tmp_path / "run")
    built = []
    monkeypatch.setattr(checkpoint_train, "build_trainer", lambda *a, **k: built.append(a))
    assert main(argv(tmp_path, "run", "steps=20", "emb_dim=16", "head_dim=4")) == 2
    assert not built
    refusal = (
        f"config error: checkpoint {tmp_path / 'run' / 'checkpoints' / '20'} holds a different "
        f"model: emb_dim=32 in the checkpoint vs 16 now; head_dim=8 in the checkpoint vs 4 now; "
        f"use the same model keys or another run_name"
    )
    assert capsys.readouterr().err.strip().splitlines()[-1] == refusal
    new_run = ["steps=20", "emb_dim=16", "head_dim=4", f"load_parameters_path={tmp_path / 'run'}"]
    assert main(argv(tmp_path, "new", *new_run)) == 2
    assert not built and not (tmp_path / "new").exists()  # nothing compiled, nothing written
    assert capsys.readouterr().err.strip().splitlines()[-1] == refusal


# ------------------------------------------------------------------------ pipelined and layouts

UNROLLED = ("scan_layers=false",)


@pytest.fixture(scope="module")
def pp4_run(tmp_path_factory):
    """20 uninterrupted steps at pipeline_parallelism=4; checkpoints at 10 and 20. Returns
    (folder, losses, the trainer the run built)."""
    base = tmp_path_factory.mktemp("pp4")
    built, real_build = [], checkpoint_train.build_trainer

    def build(config, mesh, *args, **kwargs):
        built.append(real_build(config, mesh, *args, **kwargs))
        return built[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_train, "build_trainer", build)
        train(base, "full", "steps=20", *UNROLLED, "pipeline_parallelism=4", "checkpoint_period=10")
    (trainer,) = built
    return base, losses(base, "full"), trainer


@pytest.fixture(scope="module")
def pp4_full(pp4_run):
    return pp4_run[:2]


@pytest.mark.slow
def test_resume_pipelined_is_bitwise(pp4_full, tmp_path, logs):
    """pipeline_parallelism=4 stopped at step 10 and resumed: steps 1-20 bitwise the
    uninterrupted run's (`pp4_full`, the same keys)."""
    layout = (*UNROLLED, "pipeline_parallelism=4", "checkpoint_period=10")
    train(tmp_path, "run", "steps=10", *layout)
    assert complete_steps(tmp_path / "run") == [10]
    logs.clear()
    train(tmp_path, "run", "steps=20", *layout)
    assert logs.resumes()[0].startswith("resuming run run from checkpoint step 10 (")
    assert_bitwise(losses(tmp_path, "run"), pp4_full[1], range(1, 21))


@pytest.mark.slow
def test_on_disk_tree_does_not_depend_on_the_layout(spmd_full, pp4_full):
    """Same names, global shapes and dtypes from SPMD (scanned layers) and from 4 pipeline groups
    (unrolled layers)."""

    def signature(step_dir: Path) -> dict:
        import orbax.checkpoint as ocp

        tree = ocp.PyTreeCheckpointer().metadata(step_dir / "state").item_metadata.tree
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(p): (tuple(m.shape), str(m.dtype)) for p, m in flat}

    spmd = signature(spmd_full[0] / "full" / "checkpoints" / "20")
    pipelined = signature(pp4_full[0] / "full" / "checkpoints" / "20")
    assert spmd == pipelined
    assert "['params']['layers_3']['mlp']['wo']" in spmd and "['step']" in spmd


class _StepAgainst:
    """A compiled train step that first runs `reference` (a trainer of another layout) on the
    same input state and batch, and checks that the two steps agree: every metric and state leaf
    within `rtol` of its largest magnitude (bitwise when 0). `steps` records each checked step's
    (step number, reference loss). Other attributes are the compiled step's."""

    def __init__(self, real, reference, batches: dict, rtol: float, steps: list):
        self.real, self.reference, self.batches = real, reference, batches
        self.rtol, self.steps = rtol, steps
        self.template = reference.init_state()  # where the reference takes its state

    def __call__(self, state, batch, **kwargs):
        inputs = put_like(self.template, host(state))
        want = host(self.reference.train_step(inputs, self.reference.put_batch(self.batches[0])))
        out = self.real(state, batch, **kwargs)
        got = host(out)
        step = int(want[0]["step"])
        if self.rtol == 0.0:
            cmp_bitwise(want, got, f"step {step}: ")
        else:
            assert_close_per_leaf(want, got, self.rtol, f"step {step}: ")
        self.steps.append((step, float(want[1]["loss"])))
        return out

    def __getattr__(self, name):
        return getattr(self.real, name)


def _checked_against(reference, rtol: float, steps: list):
    """A `build_trainer` for `MaxText.train` whose trainers check each step (`_StepAgainst`)."""
    real_build = checkpoint_train.build_trainer

    def build(config, mesh, *args, **kwargs):
        trainer = real_build(config, mesh, *args, **kwargs)
        batches = {}

        def put_batch(batch):
            batches[0] = batch  # the numpy batch, for the reference's own placement
            return trainer.put_batch(batch)

        step = _StepAgainst(trainer.train_step, reference, batches, rtol, steps)
        return dataclasses.replace(trainer, put_batch=put_batch, train_step=step)

    return build


@pytest.fixture(scope="module")
def pp4_reference(pp4_run):
    """The pipeline_parallelism=4 trainer the layout tests check each step against: the one
    `pp4_run` built and compiled (the reference only steps the states it is given)."""
    return pp4_run[2]


# One step from the same state in another layout: every loss and gradient entry is a sum over the
# step's SMALL_MODEL_TOKENS tokens added in another order, Adam's `nu` holds squares of them
# (`reordered_sum_rtol`, tests/compare.py). Steps are compared one at a time, each from the
# resumed run's own state: differences grow step after step through Adam (tests/compare.py).
ONE_STEP_RTOL = reordered_sum_rtol(SMALL_MODEL_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, rtol",
    [
        # Same microbatching (4): pipelined -> pipelined is bitwise. Pipelined -> one program
        # (pipeline_parallelism=1) is not: the engine compiles each stage's backward as its own
        # program (since this round the last stage's too, and activations carry sharding
        # constraints inside stages), and XLA orders one reduction differently there than in the
        # single jax.jit program, as tests/test_train.py::test_pipeline_matches_unpipelined
        # states.
        (("pipeline_parallelism=2",), 0.0),
        (("pipeline_parallelism=1",), ONE_STEP_RTOL),
        # fsdp=4 cannot use 4 microbatches at a global batch of 8 (4 x 4 data-parallel devices
        # do not divide it), so it runs 2 microbatches of 4 rows sharded over 4 devices: the loss
        # and gradient sums are added in another order.
        (("ici_fsdp_parallelism=4", "num_pipeline_microbatches=2"), ONE_STEP_RTOL),
    ],
    ids=["pp2", "pp1", "fsdp4"],
)
def test_resume_on_another_layout(
    pp4_full, pp4_reference, tmp_path, layout, rtol, logs, monkeypatch
):
    """Saved at pipeline_parallelism=4 step 10, resumed elsewhere: each of steps 11-20 agrees
    with the pipeline_parallelism=4 step from the same state and batch (bitwise, or within
    `rtol`), and step 11, from the restored state, is the uninterrupted run's step 11 exactly."""
    base, full = pp4_full
    reference = pp4_reference
    checked: list = []
    monkeypatch.setattr(
        checkpoint_train, "build_trainer", _checked_against(reference, rtol, checked)
    )
    copy_checkpoint(base / "full", 10, tmp_path / "run")
    train(tmp_path, "run", "steps=20", *UNROLLED, *layout)
    line = logs.resumes()[0]
    assert line.startswith("resuming run run from checkpoint step 10 (")
    assert "layout changed: " in line and "ici_pipeline_parallelism 4 -> " in line
    assert [s for s, _ in checked] == list(range(11, 21))
    assert checked[0][1] == full[11]  # the reference from the restored state: the saved run's
    got = losses(tmp_path, "run")
    if rtol == 0.0:
        assert_bitwise(got, full, range(11, 21))


@pytest.mark.slow
def test_fine_tune_state_is_made_where_the_step_reads_it(spmd_full, pp4_reference, tmp_path):
    """load_parameters_path at pipeline_parallelism=4: the loaded parameters with step 0 and the
    optimizer's initial state, a fresh state's bit for bit, with no random initialisation; each
    leaf made only on the groups the step reads it on (layer i's moments on group i, where
    `init_state` makes all on group 0); its first step is a fresh state's with those parameters."""
    trainer, src = pp4_reference, spmd_full[0] / "full" / "checkpoints"
    keys = (*UNROLLED, "pipeline_parallelism=4", f"load_parameters_path={src}")
    config = load_config(argv(tmp_path, "tune", *keys))
    fresh = host(trainer.init_state())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "init_state", lambda: pytest.fail("a fine-tune initialised"))
        with contextlib.closing(checkpointing.Checkpoints(config, trainer)) as ckpt:
            state = ckpt.restore_or_init(make_data(config))
    loaded, _ = checkpointing.load_params(src, trainer.abstract_state["params"], config)
    cmp_bitwise({**fresh, "params": loaded}, host(state), "fine-tune state ")
    inputs = trainer.train_step.report().inputs
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        layer = re.search(r"'layers_(\d+)'", jax.tree_util.keystr(path))
        assert layer is None or inputs[i].groups == (int(layer.group(1)),), path
        assert_on_group(leaf, trainer.mpmd_mesh, inputs[i].groups)
    (batch,) = random_batches(config, 1)
    before = {**trainer.init_state(), "params": put_like(state["params"], loaded)}  # as before
    want = host(trainer.train_step(before, trainer.put_batch(batch)))
    got = host(trainer.train_step(state, trainer.put_batch(batch)))
    cmp_bitwise(want, got, "first step ")


# ---------------------------------------------------------------------------- crashes (SIGKILL)


def _start(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ)  # conftest's XLA_FLAGS: the same 8 emulated devices as in-process runs
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kill_when(proc: subprocess.Popen, marker: str, timeout: float = 600) -> list[str]:
    """SIGKILLs `proc` as soon as a line containing `marker` appears; returns its output."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        timer.cancel()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL and marker in lines[-1], "".join(lines[-30:])
    return lines


@pytest.mark.slow
def test_kill_during_training_resumes_from_last_complete(spmd_full, tmp_path, logs, capfd):
    _, full = spmd_full
    proc = _start(["-m", "MaxText.train", *argv(tmp_path, "run", "steps=20")])
    _kill_when(proc, "step 13/20 |")
    last = complete_steps(tmp_path / "run")[-1]
    assert last >= 5

    capfd.readouterr()
    train(tmp_path, "run", "steps=20")
    assert "Traceback" not in capfd.readouterr().err
    assert logs.resumes()[0].startswith(f"resuming run run from checkpoint step {last} (")
    assert not logs.messages(logging.WARNING)
    assert_bitwise(losses(tmp_path, "run"), full, range(last + 1, 21))


@pytest.mark.slow
def test_kill_during_async_save_resumes_from_previous(spmd_full, tmp_path, logs, capfd):
    """The save of step 15 is written but never finalized when the process dies."""
    _, full = spmd_full
    worker = str(REPO / "tests" / "checkpoint_worker.py")
    proc = _start([worker, "freeze:15", *argv(tmp_path, "run", "steps=20")])
    _kill_when(proc, "FROZEN SAVE 15")
    ckpt_dir = tmp_path / "run" / "checkpoints"
    partial = ckpt_dir / "15.orbax-checkpoint-tmp"
    assert (partial / "state").is_dir() and not (ckpt_dir / "15").exists()
    assert complete_steps(tmp_path / "run") == [5, 10]

    capfd.readouterr()
    train(tmp_path, "run", "steps=20")
    assert "Traceback" not in capfd.readouterr().err
    assert logs.resumes()[0].startswith("resuming run run from checkpoint step 10 (")
    assert not logs.messages(logging.WARNING)
    assert not partial.exists()  # the leftover temporary folder was removed
    assert_bitwise(losses(tmp_path, "run"), full, range(11, 21))
    assert complete_steps(tmp_path / "run") == [10, 15, 20]


# ------------------------------------------------------------------------------------- generate


@pytest.mark.slow
def test_generate_prints_text_from_the_latest_checkpoint(tmp_path, capsys, logs):
    """Generation from the run's newest checkpoint, in this process (generate puts the parameters
    on one device whatever the process has: the 8 emulated ones here)."""
    text_run = [
        "dataset_type=text",
        "vocab_size=512",
        "max_target_length=32",
        "steps=6",
        "checkpoint_period=3",
    ]
    train(tmp_path, "shakespeare", *text_run)
    capsys.readouterr()
    logs.clear()
    code = generate.main(
        [
            str(CONFIGS_DIR / "base.yml"),
            f"base_output_directory={tmp_path}",
            "run_name=shakespeare",
            "prompt=ROMEO:",
            "max_prefill_predict_length=8",
            "max_predict_length=24",
            "decode_sampling_strategy=topk",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, logs.messages()
    assert out.startswith("ROMEO:") and len(out.strip()) > len("ROMEO:")
    step_dir = tmp_path / "shakespeare" / "checkpoints" / "6"
    assert f"generated from checkpoint step 6 ({step_dir}) with topk decoding" in logs.messages()
