"""The trainer's first-step memory measurement and its in-place update, on the default path.

The trainer with its default keys (scanned layers, the default `gradient_reduction`, state
donated to the step) at pipeline_parallelism=2 x ici_data_parallelism=2, short sequences and 2
microbatches, so that the optimizer update is where the step would peak if it held the old and
the new state at once. One trainer, one measured step (module fixture):

- the engine's device-bytes measurement (`measured_train_step`: tracked from the program's
  allocation and free events) equals the former scan of every live array after every
  instruction, on every device, exactly;
- each group's after-loop tasks consume its whole training state (parameters and optimizer
  state), measured on the devices at those instructions, and the step's peak is no longer the
  update;
- the state stays on the devices (#35): per step the bytes copied from the host are exactly the
  batch's, a checkpoint save on the path of several processes (each value spread over all groups,
  `mpmd_to_spmd_reshard`, taken here in one process) copies none (before: the rows of the groups
  not holding a value were host zeros, (G-1)/G of the state per save), and a restore exactly
  this process's share of the checkpoint (counted with `host_transfers.py`).
"""

from __future__ import annotations

import gc
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from host_transfers import batch_bytes, host_to_device_bytes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from small_model import SMALL_MODEL_SHAPE, merged

from jaxpp_integration.runtime.executor import scanning_device_bytes
from MaxText import sharding
from MaxText.checkpoint.manager import Checkpoints
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.train_step import batch_shapes, build_trainer, measured_train_step


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    config = load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"),
            *SMALL_MODEL_SHAPE,
            "pipeline_parallelism=2",
            "ici_data_parallelism=2",
            "num_pipeline_microbatches=2",
            "max_target_length=4",
            f"base_output_directory={tmp_path_factory.mktemp('run')}",
        )
    )
    assert config.scan_layers  # the default
    trainer = build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )
    batch = trainer.put_batch(
        {k: np.zeros(v.shape, v.dtype) for k, v in batch_shapes(config).items()}
    )
    state = trainer.init_state()
    state, _ = trainer.train_step(state, batch)  # the second step: state already in place
    leaves = jax.tree.leaves(state)
    gc.collect()
    with scanning_device_bytes() as scan:
        _, _, peaks = measured_train_step(trainer, state, batch)
    return config, trainer, leaves, scan.steps[0], peaks


def test_tracked_measurement_equals_the_per_instruction_scan(measured):
    _, trainer, _, scanned, peaks = measured
    tracked = trainer.train_step.last_device_bytes
    assert tracked.timeline == scanned
    assert tracked.checked and tracked.mismatches() == []
    groups = trainer.train_step.report().group_devices
    assert peaks == [max(m.get(d, 0) for m in scanned for d in ids) for ids in groups]


def _state_bytes(trainer, group: int) -> int:
    """One device's bytes of the state leaves `group` holds, from the leaves' shapes and their
    PartitionSpecs on the group's sub-mesh."""
    report = trainer.train_step.report()
    mesh = trainer.mpmd_mesh.unstack[group]
    specs = jax.tree.leaves(trainer.state_specs, is_leaf=lambda x: isinstance(x, P))
    total = 0
    for leaf, spec, inp in zip(jax.tree.leaves(trainer.abstract_state), specs, report.inputs):
        if group in inp.groups:
            shard = NamedSharding(mesh, spec).shard_shape(leaf.shape)
            total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total


def test_update_consumes_the_training_state(measured):
    """On every device, right after each after-loop task: the bytes before it, plus what it
    made, minus what it was given to consume; a group's after-loop tasks consume all of its
    state (parameters, Adam moments, counters) but the learning-rate schedule's step count:
    read by two of the group's programs, it has no int32 output left in the second and is
    freed right after it. The state's bytes per device follow from the leaves' shapes and
    specs; the arrays passed in are deleted after the step."""
    _, trainer, leaves, scanned, _ = measured
    report = trainer.train_step.report()
    nbytes = {e.value: e.device_bytes for e in report.events}
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(trainer.abstract_state)
    ]
    for g, ids in enumerate(report.group_devices):
        after = [t for t in report.tasks_of(g) if t.kind == "after"]
        for t in after:
            made = sum(nbytes[s] for s in t.writes)
            for d in ids:
                before, now = scanned[t.index - 1].get(d, 0), scanned[t.index].get(d, 0)
                assert before + made - now == t.donated_bytes, (g, t.name, d)
        consumed = {s for t in after for s in t.donates}
        held = enumerate(report.inputs[: len(leaves)])
        state = {inp.values[g]: i for i, inp in held if g in inp.values}
        left = [paths[i] for s, i in state.items() if s not in consumed]
        assert left == ["['opt_state'][1][2].count"], (g, left)
        assert sum(nbytes[s] for s in state) == _state_bytes(trainer, g) > 0
    assert all(a.is_deleted() for x in leaves for a in x.arrays.values())


def test_update_is_no_longer_the_peak(measured):
    """Short sequences and 2 microbatches: holding the old and the new state at once, the
    optimizer update would be the step's peak (the bytes before it plus what it makes). Updated
    in place, every group's measured peak lies below that figure and is reached elsewhere (here
    at the once-per-step reduction of the gradients)."""
    _, trainer, leaves, scanned, peaks = measured
    report = trainer.train_step.report()
    nbytes = {e.value: e.device_bytes for e in report.events}
    for g, ids in enumerate(report.group_devices):
        state = {inp.values[g] for inp in report.inputs[: len(leaves)] if g in inp.values}
        updates = [t for t in report.tasks_of(g) if set(t.donates) & state]
        held = (
            max(
                scanned[t.index - 1].get(d, 0) + sum(nbytes[s] for s in t.writes)
                for t in updates
                for d in ids
            )
            if updates
            else 0
        )
        at = min(i for i, m in enumerate(scanned) if max(m.get(d, 0) for d in ids) == peaks[g])
        assert peaks[g] < held and at not in {t.index for t in updates}, (g, peaks[g], held, at)


# --------------------------------------------------------------- state on the devices (#35)


def _host_batch(config) -> dict:
    return {k: np.ones(v.shape, v.dtype) for k, v in batch_shapes(config).items()}


def test_a_step_copies_only_its_batch_from_the_host(measured):
    """Two steps from a fresh state: what `put_batch` and the step copy from the host is the
    batch's bytes on the groups reading each leaf (split over data there), nothing else; implicit
    copies are refused. (At this layout both groups have before-loop work, so the trainer has no
    fills; `tests/test_device_side_state.py` counts a step that has.)"""
    config, trainer, *_ = measured
    state = trainer.init_state()
    n_state = len(jax.tree.leaves(state))
    for _ in range(2):
        with host_to_device_bytes() as seen:
            batch = trainer.put_batch(_host_batch(config))
            state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(jax.tree.leaves(metrics))
        leaves = jax.tree.leaves(batch)
        expected = batch_bytes(trainer.train_step, range(n_state, n_state + len(leaves)), leaves)
        # three (8, 4) int32 leaves, each read by one or both groups
        assert expected in {k * 8 * 4 * 4 for k in range(3, 7)}
        assert sum(seen) == expected, seen


def test_a_save_copies_nothing_and_a_restore_this_process_share(measured):
    """A step's state saved on the path of several processes (taken in one process): 0 bytes
    from the host; restored: the bytes of every restored buffer once, the values bitwise. Both
    let implicit copies through: the canonical layout's per-layer split `x[k]` sends each index
    k (4 bytes) to a device."""
    config, trainer, *_ = measured
    assert config.enable_checkpointing  # the default
    state, _ = trainer.train_step(trainer.init_state(), trainer.put_batch(_host_batch(config)))
    saved = [np.asarray(x) for x in jax.tree.leaves(state)]
    data = types.SimpleNamespace(  # the loop's data iterator, as far as checkpoints use it
        train=types.SimpleNamespace(get_state=lambda: {"at": 1}, set_state=lambda _: None)
    )
    checkpoints = Checkpoints(config, trainer)
    checkpoints._placement.spread_over_groups = True  # the save path of several processes
    with host_to_device_bytes(implicit="allow") as seen:
        checkpoints.save(1, state, data, wait=True)
    checkpoints.close()
    assert seen == []
    assert (Path(config.checkpoint_dir) / "1").is_dir()

    again = Checkpoints(config, trainer)
    with host_to_device_bytes(implicit="allow") as seen:
        restored = again.restore_or_init(data)
    again.close()
    leaves = jax.tree.leaves(restored)
    share = sum(
        s.data.nbytes for x in leaves for a in x.arrays.values() for s in a.addressable_shards
    )
    assert sum(seen) == share, (sum(seen), share)
    for want, got in zip(saved, leaves, strict=True):
        for a in got.arrays.values():
            np.testing.assert_array_equal(np.asarray(a), want)
