"""dataset_type=grain in the trainer: exact resume with worker processes, SPMD and pipelined.

10 steps + resume + 10 steps with grain_worker_count=2 give bitwise the losses of 20 straight
steps (the data position, a (window, row) pair, is saved in the checkpoint's `data_iter` item;
the straight run reads in the trainer's process, which gives the same batches), and the same
checkpoint resumed with grain_worker_count=0 continues bitwise as well. Runs go through
`MaxText.train.main` in this process; the worker processes make each run ~10 s slower here, hence
the slow marks.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from compare import assert_bitwise
from grain_corpus import WORDS, prepare_shards
from small_model import SMALL_MODEL, merged

from MaxText.config import CONFIGS_DIR
from MaxText.data import prepare as prepare_lib
from MaxText.data.shards import Shards
from MaxText.train import main


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return prepare_shards(tmp_path_factory.mktemp("grain_train"), seed=1)


def train_argv(shards: Path, base: Path, run: str, *overrides: str) -> list[str]:
    return merged(
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
    )


def train(shards: Path, base: Path, run: str, *overrides: str) -> None:
    assert main(train_argv(shards, base, run, *overrides)) == 0


def losses(base: Path, run: str, steps: range = range(1, 21)) -> np.ndarray:
    by_step = {}
    for line in (base / run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]
    return np.asarray([by_step[s] for s in steps], np.float64)


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    """`uninterrupted(layout)`: the folder of the 20 straight steps of `layout` (run `full`), run
    once per layout for the whole file, in this process: the resume tests and the two-process
    test compare with it. It reads in this process (grain_worker_count=0): grain's prefetch keeps
    the element order whatever the worker count, so its batches are a 2-worker run's, and the
    runs under test (stopped, resumed, two processes) keep their workers, each of which costs
    seconds of CPU to start; comparing them with a worker-free run checks that order as well."""
    made: dict[tuple, Path] = {}

    def run(layout: list[str]) -> Path:
        if tuple(layout) not in made:
            base = tmp_path_factory.mktemp("uninterrupted")
            train(shards, base, "full", "steps=20", "grain_worker_count=0", *layout)
            made[tuple(layout)] = base
        return made[tuple(layout)]

    return run


def saved_state(step_dir: Path) -> dict:
    """The `state` item of a checkpoint step folder as numpy arrays (its canonical tree)."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(step_dir / "state").item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(step_dir / "state", restore_args=args)


# pp2 once differed after the resume (1 of 4 runs, last session), on a machine where branches
# were being merged into the checked-out tree while tests ran (a module imported after a merge
# is the new code). Not reproduced in 50 pp2 resumes and 26 straight runs since (batches, saved
# states and compiled programs bitwise equal in all); the checks before the resume below would
# show whether a recurrence comes from the saved state or from after the restore.


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [[], ["pipeline_parallelism=2"]],
    ids=["spmd", "pp2"],
)
def test_resume_with_grain_workers_is_bitwise(shards, uninterrupted, tmp_path, layout):
    straight = uninterrupted(layout)
    train(shards, tmp_path, "run", "steps=10", "grain_worker_count=2", *layout)
    state = json.loads((tmp_path / "run/checkpoints/10/data_iter/metadata").read_text())
    assert state["window"] > 0 and state["fingerprint"]["dataset"] == "grain"
    shutil.copytree(tmp_path / "run/checkpoints/10", tmp_path / "other/checkpoints/10")
    # Where a difference would come from: the state and data position at the resume point are
    # the uninterrupted run's (its step-10 checkpoint was written while step 11 ran), ...
    assert_bitwise(
        saved_state(straight / "full/checkpoints/10"),
        saved_state(tmp_path / "run/checkpoints/10"),
        "state saved at step 10, uninterrupted vs stopped there",
    )
    full_state = json.loads((straight / "full/checkpoints/10/data_iter/metadata").read_text())
    assert state == full_state
    # ... so a difference in the losses below arises after the restore.
    train(shards, tmp_path, "run", "steps=20", "grain_worker_count=2", *layout)
    full = losses(straight, "full")
    assert_bitwise(full, losses(tmp_path, "run"), "10 + resume + 10 vs 20 steps")
    # The same checkpoint resumed with another worker count (here: none) continues alike (one
    # layout suffices: the worker count changes only how the data is read).
    if layout:
        train(shards, tmp_path, "other", "steps=20", "grain_worker_count=0", *layout)
        other = losses(tmp_path, "other", range(11, 21))
        assert_bitwise(full[10:], other, "resumed with grain_worker_count=0")


# ------------------------------------------------------------------------------ memory bound

RSS_SCRIPT = """
import resource, sys
from MaxText.train import main
code = main(sys.argv[1:])
print("MAXRSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def synthetic_shards(template: Path, out: Path, num_docs: int, doc_len: int) -> Path:
    """A prepared folder of `num_docs` random documents (the template's tokenizer), written
    directly: the 20x set is ~80 MB of tokens, too slow to tokenize here."""
    out.mkdir()
    shutil.copy(template / prepare_lib.TOKENIZER_FILE, out / prepare_lib.TOKENIZER_FILE)
    manifest = json.loads((template / prepare_lib.MANIFEST).read_text())
    writer = Shards(out, "train", 10_000, np.dtype(np.uint16))
    rng = np.random.default_rng(0)
    for _ in range(num_docs):
        writer.add(rng.integers(4, 320, doc_len))
    writer.close()
    manifest["splits"] = {"train": writer.summary()}
    (out / prepare_lib.MANIFEST).write_text(json.dumps(manifest))
    return out


@pytest.mark.slow
def test_trainer_memory_does_not_grow_with_dataset_size(shards, tmp_path):
    """Peak RSS of 10 training steps (workers off: all reading in the trainer's process) on
    datasets of 4 MB and 80 MB of tokens differ by less than 10 % (~530 MB here, so holding
    the larger set in memory, as the text pipeline does with its corpus, would fail it)."""
    import os
    import subprocess
    import sys

    rss = {}
    for factor in (1, 20):
        data = synthetic_shards(shards, tmp_path / f"x{factor}", 2000 * factor, 1000)
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        argv = merged(
            str(CONFIGS_DIR / "base.yml"),
            *SMALL_MODEL,
            "vocab_size=512",
            "dataset_type=grain",
            f"grain_train_files={data}/train-*.array_record",
            "grain_worker_count=0",
            "steps=10",
            "eval_interval=0",
            "enable_progress_bar=false",
            "enable_tensorboard=false",
            f"base_output_directory={tmp_path}",
            f"run_name=x{factor}",
        )
        proc = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, *argv],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        rss[factor] = int(proc.stdout.split("MAXRSS_KB")[1].split()[0])
    assert abs(rss[20] - rss[1]) < 0.10 * rss[1], rss


# ------------------------------------------------------------------------------ two processes


@pytest.mark.slow
def test_two_process_pipelined_grain_run_equals_one_process(shards, uninterrupted, tmp_path):
    """Under pipelining every process feeds the whole batch, so each reads every document (its
    own grain workers): 2 processes (MaxText.launch, one pipeline group each) give bitwise the
    losses of the 1-process run (the uninterrupted pp2 run of the resume test, in this process
    on 2 of its emulated devices: the same pipeline groups of one device each; its first 4 steps
    are these 4, as the learning-rate schedule is the same 20 steps and checkpointing does not
    change what a step computes)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    keys = [
        "grain_worker_count=1",
        "pipeline_parallelism=2",
        "steps=4",
        "enable_checkpointing=false",
    ]
    launch = [sys.executable, "-m", "MaxText.launch", "--num_processes", "2", "--timeout", "900"]
    argv = train_argv(shards, tmp_path, "two", *keys)
    proc = subprocess.run(
        [*launch, "--", *argv], cwd=root, env=env, capture_output=True, text=True, timeout=1000
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = losses(uninterrupted(["pipeline_parallelism=2"]), "full", range(1, 5))
    assert_bitwise(one, losses(tmp_path, "two", range(1, 5)), "2 processes vs 1")


def test_grain_run_trains_and_evaluates(tmp_path):
    """A pulse in the fast suite: 2 SPMD steps on packed grain data (in-process reading) with a
    held-out evaluation; the loss and the eval loss are finite and the eval counted tokens."""
    base = tmp_path / "data"
    rng = random.Random(2)
    (base / "corpus").mkdir(parents=True)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))) for _ in range(120)]
    (base / "corpus" / "docs.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts)
    )
    prepare_lib.prepare(
        str(base / "corpus"), str(base / "shards"), vocab_size=320, eval_fraction=0.2, quiet=True
    )
    train(
        base / "shards",
        tmp_path,
        "pulse",
        "steps=2",
        "grain_worker_count=0",
        f"grain_eval_files={base / 'shards'}/eval-*.array_record",
        "eval_interval=2",
        "eval_steps=2",
        "enable_checkpointing=false",
    )
    last = json.loads((tmp_path / "pulse" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and np.isfinite(last["loss"]) and np.isfinite(last["eval_loss"])
    assert last["eval_batches"] == 2
