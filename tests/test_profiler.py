"""The profiler (trace of the chosen steps, pipeline timeline) and the memory log at start."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from small_model import SMALL_MODEL, merged

from MaxText import memory, sharding
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.train import run
from MaxText.train_step import build_trainer, make_train_step

PROFILED = [
    *SMALL_MODEL,
    "steps=4",
    "eval_interval=0",
    "log_period=1",
    "enable_progress_bar=false",
    "enable_tensorboard=false",
    "enable_checkpointing=false",  # the fake data below has no iterator state
    "profiler=xplane",
    "skip_first_n_steps_for_profiler=1",
    "profiler_steps=2",
]


def build(tmp_path, *overrides):
    config = load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"),
            *PROFILED,
            f"base_output_directory={tmp_path}",
            *overrides,
        )
    )
    return config, build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )


class _Data:
    def __init__(self, config):
        rng = np.random.default_rng(0)
        b, length = config.global_batch_size, config.max_target_length
        self.train = iter(
            {
                "inputs": rng.integers(0, config.vocab_size, (b, length)),
                "targets": rng.integers(0, config.vocab_size, (b, length)),
                "targets_mask": np.ones((b, length), np.float32),
            }
            for _ in range(config.steps)
        )

    def eval_batches(self):
        return iter(())


def _top_level_calls(trace_events, name):
    """Host events called `name` that are not nested in another one (one per step call)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events if e.get("name") == name)
    calls, end = 0, -1.0
    for start, stop in spans:
        if start >= end:
            calls += 1
            end = stop
    return calls


@pytest.fixture(scope="module")
def spmd_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("spmd")
    # one layer: what is traced and measured is the compiled step, whatever its depth (the
    # fixture's compile and the test's own one of the step are this file's main cost)
    config, trainer = build(tmp_path, "run_name=spmd", "num_decoder_layers=1")
    return config, trainer


def test_trace_covers_exactly_the_profiled_steps(spmd_run, capsys):
    """skip 1, profile 2 of 4 steps: one trace under tensorboard/plugins/profile holding two
    calls of the compiled step (the whole run would hold four)."""
    config, trainer = spmd_run
    run(config, trainer, _Data(config))
    out = capsys.readouterr().out
    assert "profiler: traced steps 2-3 to " in out
    runs = list(Path(config.tensorboard_dir, "plugins", "profile").iterdir())
    assert len(runs) == 1 and any(runs[0].glob("*.xplane.pb"))
    (trace,) = runs[0].glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert _top_level_calls(events, "PjitFunction(jit(train_step))") == 2


def test_logged_step_memory_is_xla_analysis_of_the_step(spmd_run, capsys):
    """The numbers logged at start are those of the trainer's compiled step, compared with an
    independent `jax.jit(step).lower(...).compile().memory_analysis()` of the same function."""
    config, trainer = spmd_run
    step = make_train_step(config, trainer.model, trainer.optimizer, trainer.lr_schedule)
    batch = {
        k: jax.ShapeDtypeStruct((config.global_batch_size, config.max_target_length), dtype)
        for k, dtype in (("inputs", np.int32), ("targets", np.int32), ("targets_mask", np.float32))
    }
    with jax.set_mesh(trainer.mesh), sharding.axis_rules():
        analysis = (
            jax.jit(step, donate_argnums=(0,))
            .lower(trainer.abstract_state, batch)
            .compile()
            .memory_analysis()
        )
    logged = memory.step_memory(trainer.train_step)
    assert logged == memory.XlaMemory(
        argument=analysis.argument_size_in_bytes,
        output=analysis.output_size_in_bytes,
        alias=analysis.alias_size_in_bytes,
        temp=analysis.temp_size_in_bytes,
    )
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state))
    assert logged.argument >= state_bytes and logged.alias >= state_bytes - 4  # donated state
    assert logged.temp > 0
    memory.log_memory(print, trainer.train_step, list(trainer.mesh.devices.flat))
    assert f"XLA memory of the step (per device): {logged.describe()}" in capsys.readouterr().out


def test_device_memory_in_use_counts_the_initialised_state(spmd_run):
    """On CPU (no memory_stats) the live arrays' bytes: initialising the state adds exactly its
    bytes on the device."""
    config, trainer = spmd_run
    device = trainer.mesh.devices.flat[0]
    before = memory.device_memory_in_use([device])
    state = trainer.init_state()
    after = memory.device_memory_in_use([device])
    assert after.source == before.source == "live arrays"  # XLA:CPU has no memory_stats
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert after.in_use[f"cpu:{device.id}"] - before.in_use[f"cpu:{device.id}"] == state_bytes


def test_profiler_keys_validated(tmp_path):
    with pytest.raises(ConfigError, match="not supported here: profiler=nsys: run train.py under"):
        load_config([str(CONFIGS_DIR / "base.yml"), "profiler=nsys"])
    with pytest.raises(ConfigError, match="profiler_steps=0: must be >= 1"):
        load_config([str(CONFIGS_DIR / "base.yml"), "profiler=xplane", "profiler_steps=0"])


@pytest.mark.slow
def test_pipelined_profile_writes_timeline_and_group_memory(tmp_path, capsys):
    """pipeline_parallelism=2: the trace, the measured timeline of the last traced step (and its
    simulated replay) as PNGs, and one memory line per group whose tasks' outputs can hold the
    state that group keeps."""
    config, trainer = build(tmp_path, "pipeline_parallelism=2", "num_decoder_layers=2")
    run(config, trainer, _Data(config))
    out = capsys.readouterr().out
    assert "profiler: traced steps 2-3 to " in out
    assert any(Path(config.tensorboard_dir, "plugins", "profile").glob("*/*.xplane.pb"))
    for name in ("pipeline_timeline_step3.png", "pipeline_timeline_step3_simulated.png"):
        png = Path(config.output_dir, name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert f"pipeline timeline of step 3: {config.output_dir}/pipeline_timeline_step3.png" in out
    assert trainer.train_step.last_events is None  # step 4 ran without the task timing

    groups = memory.step_memory(trainer.train_step)
    assert [g.group for g in groups] == [0, 1]
    for g in groups:
        assert f"XLA memory of {g.describe()}" in out
    # the state each group keeps after a step is written by that group's tasks
    state = trainer.init_state()
    state, _ = trainer.train_step(state, trainer.put_batch(next(_Data(config).train)))
    for g in groups:
        held = sum(x.nbytes for x in jax.tree.leaves(state) if g.group in x.mpmd_idxs)
        assert sum(mem.output for _, mem in g.tasks) >= held > 0


def test_traced_steps_follow_maxtext_numbering():
    """Steps S+K+1 ... S+K+N after a start at step S (a resumed run counts from its step),
    clipped to `steps`; a run that ends first says so and traces nothing."""
    from MaxText.profiling import Profiler

    def profiler(start, *overrides):
        lines = []
        config = load_config([str(CONFIGS_DIR / "base.yml"), "profiler=xplane", *overrides])
        p = Profiler(config, start, lines.append)
        return (p.enabled, p.first, p.last), lines

    keys = ("steps=20", "skip_first_n_steps_for_profiler=3", "profiler_steps=5")
    assert profiler(0, *keys) == ((True, 4, 8), [])
    assert profiler(10, *keys) == ((True, 14, 18), [])
    assert profiler(14, *keys) == ((True, 18, 20), [])
    (enabled, _, _), lines = profiler(17, *keys)
    assert not enabled
    assert lines == [
        "profiler: nothing to trace: the run ends at step 20, before step 21 "
        "(skip_first_n_steps_for_profiler=3)"
    ]
    off = load_config([str(CONFIGS_DIR / "base.yml")])
    assert Profiler(off, 0).step_kwargs(1) == {} and Profiler(off, 0).after_step(1, None) == 0.0
