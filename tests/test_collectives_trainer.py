"""The trainer's `gradient_reduction` on its default path: collectives per step, in the HLO.

pipeline_parallelism=2 (llama blocks, embedding in stage 0, loss in stage 1) with the trainer's
defaults: `scan_layers: true` (each stage's 2 layers one `scan`) and `gradient_reduction: auto`;
unrolled layers as a variant. Counts are read from every task's compiled HLO times its
instances, a collective inside a layer scan's `while` once per trip.

- data=2: the loss sum, token count and every gradient stay unreduced during the loop (inside
  the scans too) and one `reduce_r` task per stage all-reduces them: 0 reductions in the loop
  tasks and 2 per step at m = 4 and 8.
- data=2 x fsdp=2: over data the same; over fsdp each microbatch's gradient of a weight sharded
  over fsdp is reduce-scattered into its shard in the backward task, a stacked layer weight's
  one layer at a time inside the backward layer scan (m x layers per such stack per step, m
  per other such weight), and the accumulators hold shards.
- "microbatch" reduces in every task instance. The modes add the same numbers in another order,
  so each step from the same state agrees within `MODES_RTOL` of each leaf's scale, not bitwise.
"""

from __future__ import annotations

import jax
import pytest
from compare import reordered_sum_rtol
from small_model import SMALL_MODEL_SHAPE, merged
from test_collectives_auto import _watch_inputs
from test_train import assert_steps_agree, make_batches, stepped_alike
from trainer_checks import fsdp_scatters_per_microbatch as _fsdp_scatters_per_microbatch

from jaxpp_integration.tools.collectives import program_collectives, task_collectives
from MaxText import sharding
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.train_step import build_trainer

DATA2 = ("ici_data_parallelism=2",)
DATA2_FSDP2 = ("ici_data_parallelism=2", "ici_fsdp_parallelism=2")


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """Builds each (m, mode, extra keys) trainer once for the whole file; its 2-step run too."""
    root = tmp_path_factory.mktemp("collectives_trainer")
    built: dict = {}

    def get(m, mode, *extra):
        key = (m, mode, *extra)
        if key not in built:
            overrides = [f"num_pipeline_microbatches={m}", *extra]
            if mode is not None:  # None: the default
                overrides.append(f"gradient_reduction={mode}")
            config = load_config(
                merged(
                    str(CONFIGS_DIR / "base.yml"),
                    *SMALL_MODEL_SHAPE,
                    "global_batch_size=16",
                    "pipeline_parallelism=2",
                    *overrides,
                    "warmup_steps_fraction=0",
                    "enable_progress_bar=false",
                    "enable_tensorboard=false",
                    f"base_output_directory={root}",
                )
            )
            mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
            built[key] = (config, build_trainer(config, mesh))
        return built[key]

    return get


def _train(config, trainer, steps=2):
    """The state after `steps` steps from the initial state."""
    state = trainer.init_state()
    for batch in make_batches(config, steps):
        state, _ = trainer.train_step(state, trainer.put_batch(batch))
    return state


def _loop(trainer, kind, axes=None):
    return sum(task_collectives(trainer.train_step, p, kind, axes) for p in ("fwd_", "bwd_"))


# One step from the same state: every loss and gradient entry is a sum over the step's 256
# tokens (global_batch_size=16 x 16) that the modes add in other orders, Adam's `nu` holds squares
# of them: `reordered_sum_rtol` (tests/compare.py), 6.1e-5 of each leaf.
MODES_RTOL = reordered_sum_rtol(16 * 16)


def _assert_trains_alike(reference, candidate, rtol=MODES_RTOL):
    """2 steps of `candidate` ((config, trainer)), each against `reference`'s step from the same
    state (tests/test_train.py: `stepped_alike`): metrics and state within `rtol`."""
    assert_steps_agree(stepped_alike(reference, candidate, steps=2), rtol)


@pytest.mark.parametrize("m", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_default_defers_inside_scanned_stages(trainers, m):
    """Default keys at pp=2 x data=2: no reduction in any loop task (counted per trip of the
    layer scans), one all-reduce over data per stage after the loop: 2 per step at m = 4 and
    at m = 8."""
    config, trainer = trainers(m, None, *DATA2)
    assert config.scan_layers and config.gradient_reduction == "auto"
    assert _loop(trainer, "all-reduce") == 0 and _loop(trainer, "reduce-scatter") == 0
    assert task_collectives(trainer.train_step, "reduce_", "all-reduce", ("data",)) == 2
    counts = program_collectives(trainer.train_step)
    assert counts["all-reduce"]["launches"] == 2
    assert counts["reduce-scatter"]["launches"] == 0
    assert trainer.train_step.reduction_choice.deferred_axes == ("data",)


def test_default_trains_like_microbatch(trainers):
    """The same 2 steps with gradient_reduction=microbatch (which reduces in every task
    instance: m x the all-reduces of one microbatch): each step within `MODES_RTOL`."""
    auto = trainers(4, None, *DATA2)
    per_mb = trainers(4, "microbatch", *DATA2)
    assert _loop(per_mb[1], "all-reduce", ("data",)) > 0
    _assert_trains_alike(per_mb, auto)


@pytest.mark.slow
def test_unrolled_layers_defer_too(trainers):
    """The variant layout, scan_layers=false: 0 reductions in the loop tasks, 2 per step, and
    each step within the same bound of the scanned microbatch run's step from the same state
    (carried across the layouts through the checkpoints' canonical tree; layers unrolled or
    scanned train bitwise alike on one device: tests/test_train.py)."""
    config, trainer = trainers(4, None, *DATA2, "scan_layers=false")
    assert not config.scan_layers
    assert _loop(trainer, "all-reduce") == 0
    assert program_collectives(trainer.train_step)["all-reduce"]["launches"] == 2
    _assert_trains_alike(trainers(4, "microbatch", *DATA2), (config, trainer))


def _fsdp_leaves_per_group(trainer, state):
    """How many parameter leaves each group holds sharded over fsdp (read off the state)."""
    counts = [0] * trainer.mpmd_mesh.mpmd_dim
    for leaf in jax.tree.leaves(state["params"]):
        (group,) = leaf.mpmd_idxs
        spec = [a for e in leaf.sharding.spec for a in (e if isinstance(e, tuple) else (e,))]
        counts[group] += "fsdp" in spec
    return counts


@pytest.mark.slow
def test_auto_with_data_and_fsdp(trainers):
    """pp=2 x data=2 x fsdp=2, m=4, default keys (XLA:CPU reports no device memory, so auto
    scatters over fsdp): every weight sharded over fsdp gets one reduce-scatter over fsdp per
    microbatch, a stacked layer weight one per layer, inside the backward layer scan (4 x the
    count read off the state; before issue 37, one per stack after the scan), no all-reduce in
    the loop; after it one
    all-reduce over data per stage (the shards) and one over data+fsdp per stage (gradients of
    weights replicated over fsdp, loss sum, token count). The accumulators reaching the
    reduce_ tasks are, on every device of their group, [1, *shard]: split over data and fsdp.
    Trains like gradient_reduction=microbatch (`MODES_RTOL`)."""
    config, trainer = trainers(4, None, *DATA2_FSDP2)
    compiled = trainer.train_step
    choice = compiled.reduction_choice
    assert (choice.deferred_axes, choice.scattered_axes) == (("data",), ("fsdp",))
    seen, originals = [], dict(compiled.executables)
    _watch_inputs(compiled, "reduce_", seen)
    try:
        state = _train(config, trainer)
    finally:
        compiled.executables.update(originals)
    per_group = _fsdp_leaves_per_group(trainer, state)
    assert all(per_group)
    per_microbatch = _fsdp_scatters_per_microbatch(state)
    assert per_microbatch > sum(per_group)  # 2 layers a stage: stacks scatter per layer
    assert _loop(trainer, "reduce-scatter", ("fsdp",)) == 4 * per_microbatch
    assert _loop(trainer, "reduce-scatter") == 4 * per_microbatch
    assert _loop(trainer, "all-reduce") == 0
    assert task_collectives(compiled, "reduce_", "all-reduce", ("data",)) == 2
    assert task_collectives(compiled, "reduce_", "all-reduce", ("data", "fsdp")) == 2
    scattered = 0
    for rank, args in seen[-2:]:
        group = {d.id for d in trainer.mpmd_mesh.devices_of(rank)}
        for shape, shards in args:
            assert {dev for dev, _ in shards} == group
            split = {s for _, s in shards}
            assert len(split) == 1
            (local,) = split
            assert local[0] == 1  # one data (or data x fsdp) slice of the partial per device
            scattered += local[1:] != shape[1:]  # a shard of the weight's gradient
    assert scattered == sum(per_group)
    _assert_trains_alike(trainers(4, "microbatch", *DATA2_FSDP2), (config, trainer))


@pytest.mark.slow
def test_planner_reports_gradient_bytes_and_launches(trainers):
    """The plan of each mode, read off the compiled steps (pp=2 x data=2 x fsdp=2): "auto" and
    "microbatch" accumulate one shard of every fsdp weight per device, so each group's gradient
    bytes equal its parameter bytes (+ the loss-sum and token-count float32 scalars on the last
    group); "step" keeps full-size partials: the fsdp weights twice over. The reductions it
    reports are the program's own counts for the loop and reduce_ tasks."""
    from MaxText.planning import cost_model
    from MaxText.planning.hardware import cpu_hardware

    plans = {}
    for mode in ("auto", "microbatch", "step"):
        config, trainer = trainers(4, None if mode == "auto" else mode, *DATA2_FSDP2)
        plans[mode] = cost_model.plan_compiled(
            config, cpu_hardware(config.num_devices), trainer.train_step, trainer.abstract_state
        )
    last = len(plans["auto"].groups) - 1
    for mode in ("auto", "microbatch"):
        for g in plans[mode].groups:
            assert g.grad_bytes == g.params_bytes + (8 if g.group == last else 0), (mode, g)
    for g in plans["step"].groups:
        assert g.grad_bytes > 1.9 * g.params_bytes, g
    report = plans["auto"].gradients
    assert report["mode"] == "auto" and report["scattered_axes"] == ["fsdp"]
    assert report["grad_bytes"] == [g.grad_bytes for g in plans["auto"].groups]
    config, trainer = trainers(4, None, *DATA2_FSDP2)
    per_microbatch = _fsdp_scatters_per_microbatch(_train(config, trainer, steps=1))
    assert report["reductions"]["reduce-scatter"]["fsdp"]["launches"] == 4 * per_microbatch
    assert report["reductions"]["all-reduce"]["data"]["launches"] == 2
    assert plans["step"].gradients["reductions"].keys() == {"all-reduce"}
    assert plans["microbatch"].gradients["mode"] == "microbatch"


@pytest.mark.slow
def test_trainer_fsdp_weights_gathered_once(trainers):
    """pipeline_fsdp_ag_once=true (pp=2 x data=2 x fsdp=2, m=4, gradient_reduction=step): no
    loop task all-gathers a weight, the gather_r tasks (one per stage) do; without the key the
    loop tasks gather in every instance (a multiple of m). Independence of m is the engine
    test's (tests/test_collectives.py). Trains alike (`MODES_RTOL`; both defer the gradient
    sums)."""
    config, once = trainers(4, "step", *DATA2_FSDP2, "pipeline_fsdp_ag_once=true")
    _, base = trainers(4, "step", *DATA2_FSDP2)
    assert _loop(once, "all-gather") == 0
    assert task_collectives(once.train_step, "gather_", "all-gather") > 0
    assert _loop(base, "all-gather") >= 4 and _loop(base, "all-gather") % 4 == 0
    _assert_trains_alike((config, base), (config, once))
