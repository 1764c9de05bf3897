"""dataset_type=grain in the trainer: exact resume with worker processes, SPMD and pipelined.

10 steps + resume + 10 steps give bitwise the losses of 20 straight steps with
grain_worker_count=2 (the data position, a (window, row) pair, is saved in the checkpoint's
`data_iter` item), and the same checkpoint resumed with grain_worker_count=0 continues bitwise as
well. Runs go through `MaxText.train.main` in this process; the worker processes make each run
~10 s slower here, hence the slow marks.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from compare import assert_bitwise
from small_model import SMALL_MODEL

from MaxText.config import CONFIGS_DIR
from MaxText.data import prepare as prepare_lib
from MaxText.train import main

WORDS = "thou art the fairest rose in all of verona and yet my lord doth speak".split()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("grain_train")
    rng = random.Random(1)
    (base / "corpus").mkdir()
    with (base / "corpus" / "docs.jsonl").open("w") as f:
        for _ in range(300):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
            f.write(json.dumps({"text": text}) + "\n")
    prepare_lib.prepare(str(base / "corpus"), str(base / "shards"), vocab_size=320, quiet=True)
    return base / "shards"


def train(shards: Path, base: Path, run: str, *overrides: str) -> None:
    argv = [
        str(CONFIGS_DIR / "base.yml"),
        *SMALL_MODEL,
        "vocab_size=512",  # the prepared tokenizer has 320 pieces
        "dataset_type=grain",
        f"grain_train_files={shards}/train-*.array_record",
        "num_pipeline_microbatches=4",
        "learning_rate_schedule_steps=20",
        "log_period=1",
        "eval_interval=0",
        "enable_progress_bar=false",
        "enable_tensorboard=false",
        "enable_checkpointing=true",
        "checkpoint_period=5",
        f"base_output_directory={base}",
        f"run_name={run}",
        *overrides,
    ]
    assert main(argv) == 0


def losses(base: Path, run: str, steps: range = range(1, 21)) -> np.ndarray:
    by_step = {}
    for line in (base / run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]
    return np.asarray([by_step[s] for s in steps], np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["pipeline_parallelism=2"]], ids=["spmd", "pp2"])
def test_resume_with_grain_workers_is_bitwise(shards, tmp_path, layout):
    train(shards, tmp_path, "full", "steps=20", "grain_worker_count=2", *layout)
    train(shards, tmp_path, "run", "steps=10", "grain_worker_count=2", *layout)
    state = json.loads((tmp_path / "run/checkpoints/10/data_iter/metadata").read_text())
    assert state["window"] > 0 and state["fingerprint"]["dataset"] == "grain"
    shutil.copytree(tmp_path / "run/checkpoints/10", tmp_path / "other/checkpoints/10")
    train(shards, tmp_path, "run", "steps=20", "grain_worker_count=2", *layout)
    full = losses(tmp_path, "full")
    assert_bitwise(full, losses(tmp_path, "run"), "10 + resume + 10 vs 20 steps")
    # The same checkpoint resumed with another worker count (here: none) continues alike.
    train(shards, tmp_path, "other", "steps=20", "grain_worker_count=0", *layout)
    other = losses(tmp_path, "other", range(11, 21))
    assert_bitwise(full[10:], other, "resumed with grain_worker_count=0")
