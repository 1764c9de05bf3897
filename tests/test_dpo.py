"""DPO (use_dpo) end to end: the formula, the pipelined step against jax.jit, the frozen reference.

The world (tests/chat_world.py): two random Llamas converted from Hugging Face folders (the policy
A, and B used as a reference other than the policy for the formula test), and preference pairs
("What is a plus b?" -> chosen "The answer is <a + b>.", rejected "The answer is <a + b + 1>.")
prepared with `prepare --format preference` from A's checkpoint.

References: the float64 Llama forward pass of tests/hf_reference.py, log-probabilities summed over
the response tokens transformers' `return_assistant_tokens_mask` marks, and the published loss
(Rafailov et al. 2023, conservative form with label smoothing) written out below in float64.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from chat_world import BASE, SYSTEM, chat_model, independent_masks, segments, target_logprobs
from small_model import merged

from MaxText.config import load_config
from MaxText.data.prepare import main as prepare

TOL = 1e-5
# Pipelined vs jax.jit: the same operations, the gradient sums in another order (per microbatch
# and stage). Metrics measured within ~1e-6; parameters after 4 steps within 1e-5 of each leaf's
# largest entry with adam_eps=1e-3 (Adam turns a rounding-level gradient entry into a full-size
# update when eps is tiny: tests/small_model.py; one entry moved by 2e-4 of its leaf's scale at
# the default 1e-8).
TOL_PIPELINED = 1e-5
BETA, SMOOTHING = 0.5, 0.1


def pair(rng) -> dict:
    a, b = (int(x) for x in rng.integers(0, 5, 2))
    prompt = [SYSTEM, {"role": "user", "content": f"What is {a} plus {b}?"}]
    answer = {"chosen": a + b, "rejected": a + b + 1}
    return {"prompt": prompt} | {
        k: [{"role": "assistant", "content": f"The answer is {v}."}] for k, v in answer.items()
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    rng = np.random.default_rng(1)
    pairs = [pair(rng) for _ in range(48)]
    texts = [m["content"] for p in pairs for side in p.values() for m in side]
    model = chat_model(root, [*texts, "system user assistant"], seeds=(5, 6))
    with open(root / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in pairs)
    data = root / "prefs"
    args = ["--format", "preference", "--input", str(root / "pairs.jsonl"), "--out", str(data)]
    assert prepare([*args, "--tokenizer_path", str(model["ckpt"][0]), "--quiet"]) == 0
    sides = [p["prompt"] + p[k] for p in pairs for k in ("chosen", "rejected")]
    return {**model, "root": root, "data": data, "masks": independent_masks(model["hf"], sides)}


def dpo_keys(world, *extra: str) -> list[str]:
    return merged(
        BASE,
        f"load_parameters_path={world['ckpt'][0]}",
        "use_dpo=true",
        "dataset_type=grain",
        f"grain_train_files={world['data']}/train-*.array_record",
        "max_target_length=64",
        "global_batch_size=8",
        "log_period=1",
        "eval_interval=0",
        "enable_progress_bar=false",
        "enable_tensorboard=false",
        "grain_worker_count=0",
        f"base_output_directory={world['root'] / 'runs'}",
        *extra,
    )


def first_batch(argv):
    from MaxText.data import make_data

    data = make_data(load_config(argv))
    batch = next(data.train)
    data.close()
    return batch


def reference_metrics(world, batch, policy: int, reference: int) -> dict:
    """The published formula in float64 over the batch's pairs (rows 2k, 2k + 1)."""
    sums = {policy: [], reference: []}
    for r, where, ids in segments(batch):
        mask = world["masks"][tuple(ids.tolist())][1:]
        np.testing.assert_array_equal(batch["targets_mask"][r, where], mask)
        for m in sums:
            sums[m].append(
                float((target_logprobs(world["cfg"], world["tensors"][m], ids) * mask).sum())
            )
    pi, ref = np.asarray(sums[policy]), np.asarray(sums[reference])
    chosen, rejected = BETA * (pi[0::2] - ref[0::2]), BETA * (pi[1::2] - ref[1::2])
    d = chosen - rejected
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    loss = -(1 - SMOOTHING) * log_sigmoid(d) - SMOOTHING * log_sigmoid(-d)
    return {
        "loss": loss.mean(),
        "dpo_chosen_reward": chosen.mean(),
        "dpo_rejected_reward": rejected.mean(),
        "dpo_reward_margin": d.mean(),
        "dpo_reward_accuracy": (chosen > rejected).mean(),
    }


def test_one_step_equals_the_float64_formula(world):
    """jax.jit of the DPO step with policy A and reference B (two different models, so the
    rewards are not 0): loss, rewards, margin and accuracy within 1e-5 of the float64 formula
    (rewards are beta x sums of ~8 log-probabilities of magnitude ~5: float32 rounding ~1e-6)."""
    from MaxText.checkpoint import manager
    from MaxText.generate import abstract_params
    from MaxText.model import Decoder
    from MaxText.optimizer import make_optimizer
    from MaxText.train_step import batch_keys, make_dpo_train_step

    argv = dpo_keys(world, f"dpo_beta={BETA}", f"dpo_label_smoothing={SMOOTHING}")
    config = load_config(argv)
    model = Decoder(config)
    optimizer, lr = make_optimizer(config)
    a, b = (manager.load_params(c, abstract_params(config), config)[0] for c in world["ckpt"])
    step = jax.jit(make_dpo_train_step(config, model, optimizer, lr, batch_keys(config)))
    state = {"step": np.int32(0), "params": a, "opt_state": optimizer.init(a)}
    batch = first_batch(argv)
    keys = {k: np.asarray(batch[k], np.float32 if k == "targets_mask" else np.int32)
            for k in batch_keys(config)}  # fmt: skip
    _, got = step(state, keys, b)
    want = reference_metrics(world, batch, policy=0, reference=1)
    for key, value in want.items():
        assert abs(float(got[key]) - value) <= TOL, (key, float(got[key]), value)
    assert abs(float(got["dpo_chosen_reward"])) > 0.1  # the rewards are not trivially 0
    assert float(got["tokens"]) == batch["targets_mask"].sum()


def run_in_process(argv):
    """train.py's run in this process (the trainer stays inspectable): (config, trainer)."""
    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.data import make_data
    from MaxText.train import run
    from MaxText.train_step import build_trainer

    config = load_config(argv)
    config, devs = devices.start(config)
    data = make_data(config)
    try:
        trainer = build_trainer(config, sharding.make_mesh(config, devs))
        run(config, trainer, data)
    finally:
        data.close()
    return config, trainer


def _params_offset(trainer) -> int:
    """Where the params' leaves start among the state's (dict keys in order: opt_state first)."""
    return len(jax.tree.leaves(trainer.abstract_state["opt_state"]))


def records(world, run: str) -> list[dict]:
    path = world["root"] / "runs" / run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_pipelined_equals_jit_reference_frozen_on_its_groups_and_resume(world):
    """pipeline_parallelism=2 with default keys (1f1b, 4 microbatches, scanned layers,
    checkpointing on) against the SPMD step (jax.jit of the same function), 4 steps:
    - step 1: the policy is the reference, loss log 2 and rewards 0;
    - every step's metrics, and the parameters after 4 steps per leaf, within TOL_PIPELINED;
    - the reference parameters after 4 steps are bitwise the starting checkpoint's, each leaf on
      the group (and devices) of its stage's policy weights, which is where the step reads it;
    - the reference pass adds no task: 2 stages x 4 microbatches fwd and bwd instances, the
      programs fwd_0, fwd_1, bwd_0, bwd_1;
    - the pipelined run restarted from its step-2 checkpoint repeats steps 3 and 4 bitwise."""
    import shutil

    from jaxpp_integration.schedules import Phase
    from MaxText.checkpoint import manager
    from MaxText.generate import abstract_params

    keys = ("steps=4", "checkpoint_period=2", "async_checkpointing=false", "adam_eps=1e-3")
    run_in_process(dpo_keys(world, *keys, "run_name=jit"))
    config, trainer = run_in_process(
        dpo_keys(world, *keys, "pipeline_parallelism=2", "run_name=pp2")
    )
    jit, pp2 = records(world, "jit"), records(world, "pp2")
    assert abs(pp2[0]["loss"] - math.log(2)) <= 6e-8  # float32's spacing at log 2
    for key in ("dpo_chosen_reward", "dpo_rejected_reward", "dpo_reward_margin"):
        assert abs(pp2[0][key]) <= 1e-6, (key, pp2[0][key])
    for a, b in zip(jit, pp2, strict=True):
        for key in ("loss", "dpo_chosen_reward", "dpo_rejected_reward", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL_PIPELINED, (a["step"], key, a[key], b[key])
        assert a["trained_tokens"] == b["trained_tokens"]
    abstract = abstract_params(load_config(dpo_keys(world)))
    final = {}
    for run in ("jit", "pp2"):
        path = world["root"] / "runs" / run
        final[run] = manager.load_params(path, abstract, config)[0]
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(final["jit"]),
        jax.tree.leaves(final["pp2"]),
        strict=True,
    ):
        scale = float(np.abs(x).max())
        np.testing.assert_allclose(y, x, rtol=0, atol=TOL_PIPELINED * scale, err_msg=str(path))

    start = manager.load_params(world["ckpt"][0], abstract_params(config), config)[0]  # pp2 tree
    reference = trainer.train_step.reference
    report = trainer.train_step.report()
    n_state = len(jax.tree.leaves(trainer.abstract_state))
    n_params = len(jax.tree.leaves(trainer.abstract_state["params"]))
    n_batch = len(report.inputs) - n_state - n_params
    param_inputs = report.inputs[_params_offset(trainer) : _params_offset(trainer) + n_params]
    ref_inputs = report.inputs[n_state + n_batch :]
    mesh = trainer.mpmd_mesh
    for want, got, p_in, r_in in zip(
        jax.tree.leaves(start), jax.tree.leaves(reference), param_inputs, ref_inputs, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
        assert tuple(r_in.groups) == tuple(p_in.groups) == got.mpmd_idxs, (r_in, p_in)
        assert r_in.device_bytes == p_in.device_bytes  # what the planner and memory log count
        for g in got.mpmd_idxs:
            assert set(got.array_on(g).devices()) == set(mesh.devices_of(g))
    assert {len(set(r.groups)) for r in ref_inputs} == {1}  # each stage's weights on one group
    loop = [t for t in report.tasks if t.kind == "loop"]
    m = config.num_pipeline_microbatches
    assert sum(t.phase is Phase.FWD for t in loop) == 2 * m == 8
    assert sum(t.phase is Phase.BWD for t in loop) == 2 * m
    assert {t.program for t in loop} == {"fwd_0", "fwd_1", "bwd_0", "bwd_1"}

    run = world["root"] / "runs" / "pp2"
    shutil.rmtree(run / "checkpoints" / "4")
    run_in_process(dpo_keys(world, *keys, "pipeline_parallelism=2", "run_name=pp2"))
    again = records(world, "pp2")[len(pp2) :]
    assert [r["step"] for r in again] == [3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in pp2[2:]]  # JSON floats: all bits
