"""`jax_cache_dir` and the run-long compilation cache (`MaxText/cluster/compile_cache.py`).

Counted with JAX's own cache and compile events (`jax.monitoring`): a second run of the same
pipelined training with `jax_cache_dir` set runs no XLA compile (every program is a cache hit,
copies on other groups are loaded from the bytes read) and trains bitwise like the first; a
plan that compiles several variants of one step reuses the programs they share; and JAX's
settings are restored after a run."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from compare import assert_bitwise
from small_model import SMALL_MODEL, merged

from MaxText.config import CONFIGS_DIR
from MaxText.train import main

HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"
COMPILES = "/jax/core/compile/backend_compile_duration"  # a compile or a cache read


pytestmark = pytest.mark.usefixtures("no_compilation_cache")  # they count cache events


@contextlib.contextmanager
def cache_events():
    """Counts of JAX's persistent-cache hits and misses and of its backend-compile events (each
    a real XLA compile or a cache read) while the block runs."""
    seen = {HITS: 0, MISSES: 0, COMPILES: 0}

    def listener(event, **kwargs):
        if event in seen:
            seen[event] += 1

    def duration_listener(event, duration, **kwargs):
        if event == COMPILES:
            seen[event] += 1

    jax.monitoring.register_event_listener(listener)
    jax.monitoring.register_event_duration_secs_listener(duration_listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(listener)
        jax.monitoring.unregister_event_duration_listener(duration_listener)


def train(base: Path, run: str, *overrides: str) -> np.ndarray:
    argv = merged(
        str(CONFIGS_DIR / "base.yml"),
        *SMALL_MODEL,
        "dataset_type=synthetic",
        "num_pipeline_microbatches=4",
        "steps=2",
        "log_period=1",
        "eval_interval=0",
        "enable_progress_bar=false",
        "enable_tensorboard=false",
        "enable_checkpointing=false",
        f"base_output_directory={base}",
        f"run_name={run}",
        *overrides,
    )
    assert main(argv) == 0
    lines = (base / run / "metrics.jsonl").read_text().splitlines()
    return np.asarray([json.loads(line)["loss"] for line in lines if '"loss"' in line])


def test_second_run_compiles_nothing_and_trains_alike(tmp_path):
    """A restart of the same pipelined run with a warm `jax_cache_dir` runs no XLA compile at
    all: every program is read from the cache, and the layer block both stages share (scanned
    layers, the default) is loaded onto the second group from the bytes read (on XLA:CPU a
    deserialized executable cannot be serialized again). It trains bitwise like the first run."""
    cache = tmp_path / "jax_cache"
    overrides = (f"jax_cache_dir={cache}", "pipeline_parallelism=2", "scan_layers=true")
    with cache_events() as first:
        losses = train(tmp_path, "first", *overrides)
    assert first[MISSES] > 0 and any(cache.iterdir())
    with cache_events() as second:
        again = train(tmp_path, "second", *overrides)
    # (in this process a few helper functions stay compiled in jax.jit's own memory cache, so
    # they do not even read the cache)
    assert second[COMPILES] - second[HITS] == 0, (first, second)  # real compiles
    assert second[MISSES] == 0 and second[HITS] > 0, (first, second)
    assert_bitwise(losses, again, "losses with programs from the cache")
    assert jax.config.jax_compilation_cache_dir is None  # JAX's settings are back


def test_cache_entries_are_written_whole(tmp_path, monkeypatch):
    """An entry is written to a temporary file renamed into place (runs and test workers may
    share one cache folder: a reader must never meet half an entry), and nothing else is left."""
    from MaxText.cluster.compile_cache import compilation_cache

    written = []
    write_bytes = Path.write_bytes
    monkeypatch.setattr(
        Path, "write_bytes", lambda p, b: written.append(p.name) or write_bytes(p, b)
    )
    with compilation_cache(str(tmp_path)):
        jax.jit(lambda x: x * 3.0 + 1.0)(np.ones(7, np.float32)).block_until_ready()
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].endswith("-cache"), entries
    assert written == [f".{entries[0]}.{os.getpid()}.{threading.get_ident()}.partial"]


def test_default_cache_lives_for_the_run_only(tmp_path, monkeypatch):
    """jax_cache_dir="": a temporary cache while the trainer runs, removed afterwards (in a
    temporary folder of this test's own, so runs in parallel test workers do not interfere)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    created = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(
        tempfile, "mkdtemp", lambda **kw: created.append(mkdtemp(**kw)) or created[-1]
    )
    with cache_events() as events:
        train(tmp_path, "run")  # SPMD: the cache's lifetime does not depend on the layout
    assert events[MISSES] > 0  # the run compiled through the cache
    assert [Path(d).parent for d in created if "maxtext_jax_cache_" in d] == [scratch]
    assert list(scratch.glob("maxtext_jax_cache_*")) == []
    assert jax.config.jax_compilation_cache_dir is None


def test_plan_variants_share_compiled_programs(capsys):
    """remat_policy=auto plans the step with remat everywhere, then with the chosen policies:
    the programs they share (before and after the loop) are compiled once."""
    from MaxText import plan

    argv = [
        str(CONFIGS_DIR / "base.yml"),
        *SMALL_MODEL,
        "dataset_type=synthetic",
        "pipeline_parallelism=2",
        "num_pipeline_microbatches=4",
        "remat_policy=auto",
        "--hardware",
        "cpu",
    ]
    with cache_events() as events:
        assert plan.main(argv) == 0
    assert "remat per stage ['none', 'none']" in capsys.readouterr().out
    assert events[HITS] > 0 and events[MISSES] > 0, events
