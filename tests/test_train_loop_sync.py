"""The loop's host syncs: a pipelined step's metrics are read after the next step is dispatched
(as on the SPMD path), except at a checkpoint step, an evaluation and the last step; a NaN still
names its step, and the newest checkpoint on disk is the last one saved before it.

The pipelined trainer runs the default keys (scanned layers, default gradient reduction,
checkpointing on) at pipeline_parallelism=2; it is compiled once for the file. `run` is the
trainer's loop; the step is wrapped to record when each step is dispatched (and to put a NaN into
one step's loss) and the loop's metrics read (`train._scalars`) to record when each step's
metrics are fetched. `StepClock` (honest step times without a host sync) is tested alone with
stand-in arrays and a stand-in clock.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from small_model import SMALL_MODEL_SHAPE, merged

from MaxText import sharding
from MaxText import step_clock as step_clock_lib
from MaxText import train as train_lib
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.data import make_data
from MaxText.train import TrainingDivergedError, run
from MaxText.train_step import build_trainer

MODEL = SMALL_MODEL_SHAPE  # the default layout: scanned layers


def _config(base: Path, *overrides: str):
    return load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"),
            *MODEL,
            "dataset_type=synthetic",
            "pipeline_parallelism=2",
            "num_pipeline_microbatches=4",
            "steps=6",
            "eval_interval=0",
            "log_period=100",
            "enable_progress_bar=false",
            "enable_tensorboard=false",
            f"base_output_directory={base}",
            *overrides,
        )
    )


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    config = _config(tmp_path_factory.mktemp("compile"))
    config, devs = devices.start(config)
    return build_trainer(config, sharding.make_mesh(config, devs))


class _RecordingStep:
    """The compiled step, recording `d<step>` at each dispatch (and a `bad` loss, NaN unless
    given, at step `nan_at`);
    every metrics dict carries its step for the fetch to record `f<step>`. Other attributes (the
    first step's `last_device_bytes`) are the compiled step's."""

    def __init__(self, real, events: list, nan_at: int | None, bad: float = float("nan")):
        self.real, self.events, self.nan_at, self.bad = real, events, nan_at, bad

    def __call__(self, state, batch, **kwargs):
        state, metrics = self.real(state, batch, **kwargs)
        step = len([e for e in self.events if e.startswith("d")]) + 1
        self.events.append(f"d{step}")
        if step == self.nan_at:
            metrics = {**metrics, "loss": np.float32(self.bad)}  # as read back: a NaN loss
        return state, {**metrics, "_step": np.int32(step)}

    def __getattr__(self, name):
        return getattr(self.real, name)


def _instrumented(trainer, events: list, nan_at: int | None = None, bad: float = float("nan")):
    """The trainer with its step wrapped in a `_RecordingStep`."""
    return dataclasses.replace(
        trainer, train_step=_RecordingStep(trainer.train_step, events, nan_at, bad)
    )


@pytest.fixture
def fetches(monkeypatch):
    events: list[str] = []
    real = train_lib._scalars

    def scalars(metrics):
        values = real(metrics)
        events.append(f"f{int(values['_step'])}")
        return values

    monkeypatch.setattr(train_lib, "_scalars", scalars)
    return events


def _checkpoints(config) -> list[int]:
    folder = Path(config.checkpoint_dir)
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def test_pipelined_metrics_are_read_one_step_late(pipelined, tmp_path, fetches, capsys):
    config = _config(tmp_path, "checkpoint_period=3", "run_name=lag")
    trainer = _instrumented(dataclasses.replace(pipelined, config=config), fetches)
    run(config, trainer, make_data(config))
    # Step N's metrics after step N+1's dispatch; at the checkpoint step 3 and the last step 6
    # at once, before the save (before the next step may donate the state).
    assert fetches == ["d1", "d2", "f1", "d3", "f2", "f3", "d4", "d5", "f4", "d6", "f5", "f6"]
    assert _checkpoints(config) == [3, 6]
    assert "host time between step dispatches: median " in capsys.readouterr().out


def test_several_processes_read_once_per_log_period(pipelined, tmp_path, fetches, monkeypatch):
    """Under several processes a step's metrics travel to every process (a collective), so the
    loop starts one read per log period (`train._read_every`, patched here to what it is with
    several processes), right after that period's last step is dispatched, and finishes it after
    the next step's dispatch: log_period=2, 6 steps, saved only at the end."""
    config = _config(tmp_path, "log_period=2", "checkpoint_period=1000", "run_name=period")
    monkeypatch.setattr(train_lib, "_read_every", lambda c: c.log_period)
    reads = []
    real = train_lib.jaxpp.fetch_later

    def fetch_later(tree):
        reads.append(len(tree))
        fetches.append(f"r{len(tree)}")
        return real(tree)

    monkeypatch.setattr(train_lib.jaxpp, "fetch_later", fetch_later)
    trainer = _instrumented(dataclasses.replace(pipelined, config=config), fetches)
    run(config, trainer, make_data(config))
    assert reads == [2, 2, 2]  # one read per log period, each of the period's steps
    assert fetches == [
        *("d1", "d2", "r2", "d3", "f1", "f2"),
        *("d4", "r2", "d5", "f3", "f4"),
        *("d6", "r2", "f5", "f6"),  # the last step: read at once, before the save
    ]


@pytest.mark.parametrize(
    "nan_at, newest, bad",
    [(4, 2, "nan"), (5, 4, "nan"), (5, 4, "inf")],
    ids=["at_a_checkpoint_step", "lagged_before_a_checkpoint_step", "inf_lagged"],
)
def test_nan_names_its_step_and_is_never_saved(pipelined, tmp_path, fetches, nan_at, newest, bad):
    """checkpoint_period=2: a NaN at step 4 (a checkpoint step: read before saving) or at step 5
    (read one step late, after step 6 was dispatched: step 6, a checkpoint step and the last,
    must not be saved either); an Inf loss alike. The newest checkpoint on disk is the last
    before the bad step."""
    config = _config(tmp_path, "checkpoint_period=2", "run_name=nan")
    trainer = _instrumented(
        dataclasses.replace(pipelined, config=config), fetches, nan_at, float(bad)
    )
    with pytest.raises(TrainingDivergedError) as diverged:
        run(config, trainer, make_data(config))
    folder = Path(config.checkpoint_dir) / str(newest)
    assert str(diverged.value) == (
        f"loss is {bad} at step {nan_at}; aborting (try a lower learning_rate or a "
        f"gradient_clipping_threshold); the newest checkpoint on disk is step {newest} ({folder})"
    )
    assert _checkpoints(config) == [s for s in (2, 4) if s <= newest]
    assert fetches[-1] == f"f{nan_at}"


# ------------------------------------------------------------------------------- StepClock alone


class _Array:
    def __init__(self):
        self.done = False

    def is_ready(self):
        return self.done


class _Mpmd:  # an MpmdArray's local arrays, by group
    def __init__(self, *arrays):
        self.arrays = dict(enumerate(arrays))


def test_step_clock_takes_the_first_time_a_step_is_seen_ready(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_clock_lib.time, "perf_counter", lambda: now[0])
    clock = step_clock_lib.StepClock()  # the loop starts at 100
    a1, a2 = _Array(), _Array()
    m1 = {"loss": _Mpmd(a1, _Array())}
    m1["loss"].arrays[1].done = True

    now[0] = 101.0
    clock.dispatching()
    now[0] = 103.0  # step 1's dispatch took 2 s; not finished yet (group 0 pending)
    clock.dispatched(1, m1)
    now[0] = 104.0
    a1.done = True  # finishes between two looks
    clock.dispatching()  # step 2: the host's gap is 104 - 103
    now[0] = 105.0
    clock.dispatched(2, {"loss": a2})
    assert clock.step_seconds(1) == 4.0  # seen ready at 104, not at the read (105)
    now[0] = 107.0  # the blocking read of step 2 returns (a stand-in array never says ready)
    assert clock.step_seconds(2) == 3.0  # still running when read: ends when the read returns
    assert clock.gaps == [1.0]
    assert clock.steps == [4.0, 3.0]


def test_step_clock_splits_steps_seen_ready_together(monkeypatch):
    """Two steps first seen ready in the same look: the older ended before the previous look
    could tell (a lower bound), so neither gets a zero time."""
    now = [0.0]
    monkeypatch.setattr(step_clock_lib.time, "perf_counter", lambda: now[0])
    clock = step_clock_lib.StepClock()
    a1, a2 = _Array(), _Array()
    clock.dispatching()
    now[0] = 1.0
    clock.dispatched(1, a1)
    now[0] = 2.0
    clock.dispatching()
    now[0] = 5.0
    a1.done = a2.done = True
    clock.dispatched(2, a2)
    assert clock.step_seconds(1) == 2.0  # the look at 2.0 was the last that saw it running
    assert clock.step_seconds(2) == 3.0
    clock.restart()  # an evaluation: the next step starts now, no gap across it
    assert clock.gap_summary() == (
        "host time between step dispatches: median 1000.00 ms over 1 steps, 40.0% of the median "
        "step (2500.0 ms)"
    )
