"""State stays on the devices (#35 items 1 and 2): host-to-device copies are counted exactly.

Counted by patching `jax.device_put` (the bytes of every host array it is given) while the code
runs under `jax.transfer_guard_host_to_device("disallow")`, which refuses the implicit copies
the patch cannot see (a numpy array handed to a compiled program). Expected figures come from
the shapes and shardings alone: a value placed with sharding S costs the bytes of its shard on
every device of S.

- the step loop: per step, the host-to-device bytes are exactly the batch's (each batch leaf on
  every group that reads it), for the engine's 2-stage MLP (whose first-stage group has no
  before-loop work, so its gradient accumulators are `Fill`s: before, zero-stride numpy views
  copied to the devices every step) and for the trainer's default step at pp=2 x data=2;
- checkpoints: the multi-process save path (each value spread over all groups,
  `mpmd_to_spmd_reshard`; taken here in one process) puts 0 bytes (before: the rows of the
  groups not holding a value were host zeros, (G-1)/G of the state per save), and a restore puts
  exactly this process's share of the checkpoint (every restored buffer once). Both let
  implicit copies through: the canonical layout's per-layer split `x[k]` sends each index k
  (4 bytes) to a device.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from engine_models import make_step, mpmd_mesh, tied_mlp_setup
from small_model import SMALL_MODEL_SHAPE

import jaxpp_integration as jaxpp
from jaxpp_integration.compiler.program import Fill
from MaxText import sharding
from MaxText.checkpoint.manager import Checkpoints
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.data import make_data
from MaxText.train_step import build_trainer


@contextlib.contextmanager
def host_to_device_bytes(implicit: str = "disallow"):
    """Yields a list whose sum is the bytes of the host arrays `jax.device_put` was given in the
    block; implicit host-to-device copies raise (with `implicit="allow"`: they are let through,
    e.g. the 4-byte layer indices `x[k]` of a checkpoint's per-layer split)."""
    put = jax.device_put
    seen: list[int] = []

    def counted(x, *args, **kwargs):
        seen.extend(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(x) if _on_host(leaf))
        return put(x, *args, **kwargs)

    jax.device_put = counted
    try:
        with jax.transfer_guard_host_to_device(implicit):
            yield seen
    finally:
        jax.device_put = put


def _on_host(leaf) -> bool:
    return not isinstance(leaf, jax.Array)


def placed_bytes(shape, dtype, shardings) -> int:
    """Bytes a value of `shape` takes once placed with each of `shardings` (its shard on every
    device, replicas included)."""
    item = np.dtype(dtype).itemsize
    return sum(
        int(np.prod(sh.shard_shape(tuple(shape)))) * item * len(sh.device_set) for sh in shardings
    )


def batch_bytes(step, leaves_at: range, values) -> int:
    """What placing the batch costs: each batch leaf (flat step inputs `leaves_at`) on every
    group the compiled `step` reads it on, with that group's layout."""
    total = 0
    for j, value in zip(leaves_at, values, strict=True):
        slots = step.program.inputs[j]
        assert slots, f"step input {j} is read by no group"
        shardings = [step.slot_sharding[s] for s in slots.values()]
        total += placed_bytes(value.shape, value.dtype, shardings)
    return total


# ------------------------------------------------------------------ the engine's 2-stage MLP


def test_engine_step_puts_only_the_batch():
    params, batch, loss_fn = tied_mlp_setup(2, 4, tied=False)
    opt = optax.sgd(0.1, momentum=0.9)
    step = make_step(loss_fn, opt, jaxpp.Std1F1B(2))
    compiled = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2)).compile(
        params, opt.init(params), batch
    )
    fills = [i for i in compiled.program.instrs if isinstance(i, Fill)]
    assert {f.rank for f in fills} == {0, 1} and len(fills) == 5  # the case this test is about
    state = compiled(params, opt.init(params), batch)[:2]  # the state now lives on its groups
    host_batch = jax.tree.map(np.asarray, batch)
    n_state = len(jax.tree.leaves(state))
    expected = batch_bytes(compiled, range(n_state, n_state + 2), jax.tree.leaves(host_batch))
    assert expected == 2 * np.asarray(batch[0]).nbytes  # inputs on group 0, targets on group 1
    for _ in range(2):
        with host_to_device_bytes() as seen:
            state = compiled(*state, host_batch)[:2]
            jax.block_until_ready(jax.tree.leaves(state))
        assert sum(seen) == expected, seen
    # and nothing at all with the batch already on a device
    on_device = jax.device_put(host_batch, jax.devices()[0])
    with host_to_device_bytes() as seen:
        jax.block_until_ready(compiled(*state, on_device))
    assert seen == []


# ---------------------------------------------------- the trainer's default step, pp=2 x data=2


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    base = tmp_path_factory.mktemp("run")
    config = load_config(
        [
            str(CONFIGS_DIR / "base.yml"),
            *SMALL_MODEL_SHAPE,
            "dataset_type=synthetic",
            "pipeline_parallelism=2",
            "ici_data_parallelism=2",
            "enable_progress_bar=false",
            "enable_tensorboard=false",
            f"base_output_directory={base}",
        ]
    )
    config, devs = devices.start(config)
    trainer = build_trainer(config, sharding.make_mesh(config, devs))
    assert config.scan_layers and config.enable_checkpointing and config.mesh_pipeline == 2
    return config, trainer


def test_trainer_step_puts_only_the_batch(pipelined):
    config, trainer = pipelined
    data = make_data(config)
    state = trainer.init_state()
    batches = iter(data.train)
    state, _ = trainer.train_step(state, trainer.put_batch(next(batches)))
    n_state = len(jax.tree.leaves(state))
    for _ in range(2):
        host = next(batches)
        with host_to_device_bytes() as seen:
            batch = trainer.put_batch(host)
            state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(jax.tree.leaves(metrics))
        leaves = jax.tree.leaves(batch)
        expected = batch_bytes(trainer.train_step, range(n_state, n_state + len(leaves)), leaves)
        # three (8, 16) int32 leaves, each read by one or both groups, split over data there
        assert expected in {k * 8 * 16 * 4 for k in range(3, 7)}
        assert sum(seen) == expected, seen


def test_save_puts_nothing_and_restore_puts_this_process_share(pipelined, tmp_path):
    config, trainer = pipelined
    data = make_data(config)
    state = trainer.init_state()
    state, _ = trainer.train_step(state, trainer.put_batch(next(iter(data.train))))
    saved = [np.asarray(x) for x in jax.tree.leaves(state)]
    checkpoints = Checkpoints(config, trainer)
    checkpoints._placement.spread_over_groups = True  # the save path of several processes
    with host_to_device_bytes(implicit="allow") as seen:
        checkpoints.save(1, state, data, wait=True)
    checkpoints.close()
    assert seen == []
    assert (Path(config.checkpoint_dir) / "1").is_dir()

    again = Checkpoints(config, trainer)
    with host_to_device_bytes(implicit="allow") as seen:
        restored = again.restore_or_init(make_data(config))
    again.close()
    leaves = jax.tree.leaves(restored)
    share = sum(
        s.data.nbytes for x in leaves for a in x.arrays.values() for s in a.addressable_shards
    )
    assert sum(seen) == share, (sum(seen), share)
    for want, got in zip(saved, leaves, strict=True):
        for a in got.arrays.values():
            np.testing.assert_array_equal(np.asarray(a), want)
