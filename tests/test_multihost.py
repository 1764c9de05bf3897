"""The engine under JAX's multi-controller runtime: 2 local processes, gloo collectives on CPU.

What each process compiles and launches is counted in the worker (`multihost_worker.py` prints a
COUNTS line) and asserted here exactly."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from small_model import SMALL_MODEL

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(schedule: str, *extra: str, cache_dir: Path | None = None):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent}{os.pathsep}{HERE}")
    if cache_dir is not None:
        env["MULTIHOST_CACHE_DIR"] = str(cache_dir)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "multihost_worker.py"),
                str(pid),
                str(port),
                schedule,
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]


# schedule -> the persistent cache a passing counted run of it filled (both processes' programs):
# a later run of that schedule that does not count compiles reads its programs from there
FILLED: dict[str, Path] = {}


def _counts(out: str) -> dict:
    (line,) = [x for x in out.splitlines() if x.startswith("COUNTS ")]
    return json.loads(line[len("COUNTS ") :])


# Per schedule and process: XLA compiles of `.compile()` (task programs + transfer programs),
# task programs (a single process compiles both groups' programs: 8 for 1f1b, 12 interleaved;
# before each process compiled only its own, each process compiled all 8 / 12), and the step's
# cross-process transfers. Transfer programs here: one `move` per distinct batch signature (4 for
# 1f1b, 5 interleaved, on both processes), a `pack` for the scalars a process sends, an `unpack`
# for those it receives, a receive buffer per distinct received layout (3 on process 0, 2
# on process 1, for both schedules), and the program making its group's gradient accumulators
# on its devices (`runtime/fills.py`: neither group has a before-loop task).
COMPILES = {
    "1f1b": [(14, 4), (13, 4)],
    "interleaved": [(17, 6), (16, 6)],
}
TRANSFERS = {"1f1b": 15, "interleaved": 33}
# The step's batches per process: (side, values, of which scalars) -> how many. Launches per
# batch by design: one `move` program, plus the pack (sender) or unpack (receiver) when the
# batch holds scalars. Before: one program per transfer plus per-device eager copies (2 per
# transfer on the sender, 3 on the receiver with one device per group, host zeros put on the
# receiving device every time).
BATCHES = {
    "1f1b": [
        {("send", 1, 0): 4, ("receive", 2, 0): 4, ("receive", 1, 1): 1, ("send", 2, 2): 1},
        {("receive", 1, 0): 4, ("send", 2, 0): 4, ("send", 1, 1): 1, ("receive", 2, 2): 1},
    ],
    "interleaved": [
        {
            ("send", 1, 0): 12,
            ("receive", 1, 0): 8,
            ("receive", 2, 0): 4,
            ("receive", 2, 2): 1,
            ("send", 3, 3): 1,
        },
        {
            ("receive", 1, 0): 12,
            ("send", 1, 0): 8,
            ("send", 2, 0): 4,
            ("send", 2, 2): 1,
            ("receive", 3, 3): 1,
        },
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_two_processes_equal_single_process_bitwise(schedule, tmp_path):
    """Tied embedding + global-norm clipping, 3 steps; each process checks its own groups
    bitwise against `jax.jit` of the step on one device. Each process compiles only its own
    groups' task programs (exact counts) and finds them in the persistent cache when compiling
    again; it moves the step's cross-process values in batches: one program per batch (+ the
    scalar pack/unpack), no XLA compile and no host array put on a device while doing it; a
    sender keeps nothing but a 4-byte flag, and both directions use one device order. The
    losses of the three steps are read back on both processes in one collective
    (`jaxpp.fetch_later`), bitwise."""
    procs = _launch(schedule, cache_dir=tmp_path)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "OK" in outs[0] and "groups here: [0]" in outs[0]
    assert "OK" in outs[1] and "groups here: [1]" in outs[1]
    for pid, out in enumerate(outs):
        c = _counts(out)
        xla, tasks = COMPILES[schedule][pid]
        assert c["task_groups"] == [pid] and c["task_devices_local"], c
        assert (c["task_compiles"], c["task_loads"]) == (tasks, 0), c
        assert c["xla_compiles"] == xla, c
        program = [b for b in c["batches"] if b["of"] == "program"]
        got = collections.Counter((b["side"], b["values"], b["scalars"]) for b in program)
        assert got == BATCHES[schedule][pid], got
        assert sum(b["values"] for b in program) == c["transfers"] == TRANSFERS[schedule]
        for b in c["batches"]:
            assert b["launches"] == 1 + (b["scalars"] > 0), b
            assert b["compiles"] == 0 and b["host_puts"] == 0, b
            # a sender keeps only the 4-byte flag it may wait on (one device per group here)
            assert b["kept_bytes"] == (4 if b["side"] == "send" else 0), b
        # both directions of the stage boundary over one device order (group 0's device first):
        # one NCCL communicator for the pair
        (order,) = {tuple(b["pair_devices"]) for b in c["batches"]}
        assert len(order) == 2 and order[0] < order[1], order
        # the updated tied embedding is read by both groups next step: one batch of one
        inputs = [b for b in c["batches"] if b["of"] == "inputs"]
        assert [b["side"] for b in inputs] == [["send", "receive"][pid]], inputs
        # compiled again: every task program (and the fill program) is read from the persistent
        # cache, which each process wrote its own programs to (JAX itself writes from process 0)
        assert c["again"] == {"real_compiles": 0, "cache_hits": tasks + 1}, c["again"]  # + fills
        # three steps' losses, read back together: one collective, no broadcast per value
        (line,) = [x for x in out.splitlines() if x.startswith("FETCH ")]
        assert json.loads(line[len("FETCH ") :]) == {"gather": 1, "broadcast": 0}
    FILLED[schedule] = tmp_path


@pytest.mark.slow
def test_two_processes_run_a_schedule_that_receives_out_of_send_order(tmp_path):
    """A user schedule whose second rank runs its forwards in another order than the first
    rank sends their inputs (`swapped` in the worker): every process walks one global
    instruction order, so the cross-process transfers pair up whatever order each rank's list
    has; the state bitwise equal to `jax.jit` on one device, as with the built-in schedules, the
    loss within the bound of its 4 microbatch terms added in the order the second rank runs
    them (`assert_same_loss` in the worker; bitwise before only by the data's luck). Its programs
    are 1f1b's (the same two stages; only the order differs), so it reads them from the 1f1b
    run's persistent cache when that test ran first (its compiles are not counted)."""
    procs = _launch("swapped", cache_dir=FILLED.get("1f1b", tmp_path))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "OK" in outs[0] and "groups here: [0]" in outs[0]
    assert "OK" in outs[1] and "groups here: [1]" in outs[1]


@pytest.mark.slow
def test_peer_death_makes_the_other_exit():
    """Process 1 dies after compiling; process 0, blocked on a transfer, must exit non-zero
    with a message within the heartbeat timeout (10 s) plus slack, never hang. The programs come
    from the 1f1b run's persistent cache when that test ran first (what is tested starts after
    compiling; ~5 s of CPU less), else they are compiled."""
    procs = _launch("1f1b", "die", cache_dir=FILLED.get("1f1b"))
    start = time.monotonic()
    out0 = procs[0].communicate(timeout=180)[0]
    procs[1].communicate(timeout=30)
    assert procs[1].returncode != 0
    assert procs[0].returncode != 0
    assert time.monotonic() - start < 180
    assert "another task died" in out0 or "distributed service detected fatal errors" in out0, out0[
        -2000:
    ]


def test_trainer_transfers_go_in_batches_and_scalars_as_one_vector(tmp_path):
    """The trainer's default step (scanned layers, AdamW after a global-norm clip) at pp=2 with
    its two groups on two processes: the program's 51 cross-process transfers are cut into 11
    batches, and the 42 per-leaf scalar partials the optimizer phase exchanges (22 from group 1,
    20 from group 0) into one batch per direction, each moved as one float32 vector; every
    batch, forward or back, runs over the same device order. Read off the compiled program in
    one process (which transfers cross depends only on the groups' owners);
    `test_two_processes_equal_single_process_bitwise` runs batches for real."""
    from jaxpp_integration.compiler.program import Transfer
    from jaxpp_integration.runtime.transfer import cross_process_runs, plan_cross_process
    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.train_step import build_trainer

    model = [a for a in SMALL_MODEL if not a.startswith("scan_layers")]  # the default: scanned
    config = load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            *model,
            "pipeline_parallelism=2",
            f"base_output_directory={tmp_path}",
        ]
    )
    assert config.scan_layers and config.num_pipeline_microbatches == 4
    step = build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    ).train_step
    prog = step.program
    runs = cross_process_runs(prog, owners=[0, 1])
    moved = [t for _, batch in runs for t in batch]
    assert moved == [i for i in prog.instrs if isinstance(i, Transfer)] and len(moved) == 51
    shape = collections.Counter(
        (b[0].src_rank, b[0].dst_rank, len(b), sum(not prog.slot_aval[t.dst].shape for t in b))
        for _, b in runs
    )
    # (from, to, values, of which scalars) -> batches: per microbatch the hidden state forward
    # (the positions, a program constant, are made where they are read: partition.py), the
    # cotangent backward; then a scalar, then each group's per-leaf partials
    assert shape == {
        (0, 1, 1, 0): 4,
        (1, 0, 1, 0): 4,
        (1, 0, 1, 1): 1,
        (1, 0, 22, 22): 1,
        (0, 1, 20, 20): 1,
    }
    vectors, orders = [], set()
    for sender in (0, 1):  # the sending side of every batch of one group, as its process plans it
        planned = plan_cross_process(prog, step.slot_sharding, [0, 1], {sender}, "stage")
        for transfers, batch in planned.values():
            orders.add(tuple(d.id for d in batch.pair_shardings[0].sharding.mesh.devices.flat))
            if transfers[0].src_rank != sender or len(transfers) < 20:
                continue
            (vector,) = batch.pair.args_info[0]  # one input: the packed scalars, both halves
            vectors.append((sender, vector.shape, str(vector.dtype)))
    assert vectors == [(0, (40,), "float32"), (1, (44,), "float32")]
    # every batch, either way, runs over one device order: one NCCL communicator for the pair
    group_devices = [tuple(d.id for d in step.mpmd_mesh.devices_of(r)) for r in (0, 1)]
    assert orders == {group_devices[0] + group_devices[1]}
