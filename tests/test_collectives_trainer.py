"""The trainer's `gradient_reduction` key: data-parallel all-reduces per step, counted in HLO.

pipeline_parallelism=2 x ici_data_parallelism=2 (llama blocks, embedding in stage 0, loss in
stage 1). With "step" the loss sum, token count and every gradient stay unreduced during the
loop and one `reduce_r` task per stage all-reduces them: the same launches at m = 4 and 8.
With "microbatch" every loop task instance all-reduces: m times as many. The two modes add the
same numbers in another order, so the losses agree to float rounding (1e-6), not bitwise.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from small_model import SMALL_MODEL, merged
from test_train import make_batches

from jaxpp_integration.tools.collectives import task_collectives
from MaxText import sharding
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.train_step import build_trainer


def _trainer(tmp_path, m, mode, *extra):
    config = load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"),
            *SMALL_MODEL,
            "global_batch_size=16",
            "pipeline_parallelism=2",
            *(extra or ("ici_data_parallelism=2",)),
            f"num_pipeline_microbatches={m}",
            f"gradient_reduction={mode}",
            "steps=2",
            "warmup_steps_fraction=0",
            "enable_progress_bar=false",
            "enable_tensorboard=false",
            f"base_output_directory={tmp_path}",
        )
    )
    return config, build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )


def _losses(config, trainer, steps=2):
    state = trainer.init_state()
    out = []
    for batch in make_batches(config, steps):
        state, metrics = trainer.train_step(state, trainer.put_batch(batch))
        out.append(float(np.asarray(metrics["loss"])))
    return np.asarray(out)


@pytest.mark.slow
@pytest.mark.parametrize("m", [4, 8])
def test_trainer_gradient_reduction_launches(tmp_path, m):
    config, step_mode = _trainer(tmp_path, m, "step")
    _, per_mb = _trainer(tmp_path, m, "microbatch")
    loop = lambda t: sum(task_collectives(t.train_step, p, "all-reduce") for p in ("fwd", "bwd"))
    # "step": nothing reduced inside the loop; one all-reduce task per stage after it
    assert loop(step_mode) == 0
    assert task_collectives(step_mode.train_step, "reduce_", "all-reduce") == 2
    # "microbatch": every forward/backward instance of both stages reduces: a multiple of m
    assert loop(per_mb) >= 2 * m and loop(per_mb) % m == 0
    np.testing.assert_allclose(
        _losses(config, step_mode), _losses(config, per_mb), rtol=1e-6, atol=0
    )


@pytest.mark.slow
def test_trainer_fsdp_weights_gathered_once(tmp_path):
    """pipeline_parallelism=2 x ici_fsdp_parallelism=2, m=4, with pipeline_fsdp_ag_once=true:
    no loop task all-gathers a weight, the gather_r tasks (one per stage) do; without the key
    the loop tasks gather in every instance (a multiple of m). Independence of m is the engine
    test's (tests/test_collectives.py). Losses agree to 1e-6 (both defer the gradient sums)."""
    fsdp = ("ici_fsdp_parallelism=2",)
    loop = lambda t: sum(task_collectives(t.train_step, p, "all-gather") for p in ("fwd", "bwd"))  # noqa: E731
    config, once = _trainer(tmp_path, 4, "step", *fsdp, "pipeline_fsdp_ag_once=true")
    _, base = _trainer(tmp_path, 4, "step", *fsdp)
    assert loop(once) == 0
    assert task_collectives(once.train_step, "gather_", "all-gather") > 0
    assert loop(base) >= 4 and loop(base) % 4 == 0
    np.testing.assert_allclose(_losses(config, once), _losses(config, base), rtol=1e-6, atol=0)


def test_microbatch_reduction_accumulates_gradients_sharded_like_parameters(tmp_path):
    """gradient_reduction=microbatch at fsdp=2: each microbatch's gradients are reduced to one
    fsdp shard per device (XLA:CPU: an all-reduce and a slice; GPU backends form a
    reduce-scatter) and the accumulators hold that shard, so every group's
    gradient bytes equal its parameter bytes (the plan's replay of the program, against the
    parameter shards' bytes read from the trainer's state); with "step" the deferred partial
    sums are full-size per device: twice the parameters. Losses agree to rounding (1e-6)."""
    from MaxText.planning import cost_model
    from MaxText.planning.hardware import cpu_hardware

    extra = ("ici_fsdp_parallelism=2",)
    config, per_mb = _trainer(tmp_path, 4, "microbatch", *extra)
    _, step_mode = _trainer(tmp_path, 4, "step", *extra)
    hardware = cpu_hardware(config.num_devices)
    planned = {
        mode: cost_model.plan_compiled(config, hardware, t.train_step, t.abstract_state)
        for mode, t in (("microbatch", per_mb), ("step", step_mode))
    }
    last = len(planned["step"].groups) - 1
    for g in planned["microbatch"].groups:
        # + the loss-sum and token-count scalars (float32) on the last stage's group
        assert g.grad_bytes == g.params_bytes + (8 if g.group == last else 0), g
    for g in planned["step"].groups:
        assert g.grad_bytes > 1.9 * g.params_bytes, g  # full-size partial sums per device
    p = planned["microbatch"]
    state = per_mb.init_state()
    shard_bytes = sum(
        leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state["params"])
    )
    assert sum(g.params_bytes for g in p.groups) == shard_bytes
    np.testing.assert_allclose(
        _losses(config, step_mode), _losses(config, per_mb), rtol=1e-6, atol=0
    )
