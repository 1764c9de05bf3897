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
from compare import assert_close_per_leaf, host, put_like, reordered_sum_rtol
from small_model import merged

from MaxText.config import load_config
from MaxText.data.prepare import main as prepare

TOL = 1e-5
# Pipelined vs jax.jit, compared one step at a time from the same input state (differences grow
# step after step through Adam: tests/compare.py), the same batch and reference:
# - the metrics: each program's float32 values are within TOL of the float64 formula (the bound
#   of test_one_step_equals_the_float64_formula, reasoned there), so within 2 TOL of each other;
# - the state (parameters, Adam's moments): the gradients are sums over the step's 8 x 64 tokens
#   that the two programs add in other orders (per microbatch and stage),
#   `reordered_sum_rtol` of each leaf's scale (tests/compare.py; with adam_eps=1e-3, as
#   tests/small_model.py explains, so that Adam does not turn a rounding-level gradient entry
#   into a full-size update).
TOL_PIPELINED = 2 * TOL
STEP_RTOL = reordered_sum_rtol(8 * 64)
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


def test_one_step_equals_the_float64_formula(world, trained):
    """The SPMD trainer's DPO step (jax.jit of the step function, as the trainer compiles it)
    with policy A and reference B (two different models, so the rewards are not 0): loss,
    rewards, margin and accuracy within 1e-5 of the float64 formula (rewards are beta x sums of
    ~8 log-probabilities of magnitude ~5: float32 rounding ~1e-6)."""
    from MaxText.checkpoint import manager
    from MaxText.generate import abstract_params

    config, trainer = trained["jit"]
    assert config.dpo_beta == BETA and config.dpo_label_smoothing == SMOOTHING
    a, b = (manager.load_params(c, abstract_params(config), config)[0] for c in world["ckpt"])
    state = {"step": np.int32(0), "params": a, "opt_state": trainer.optimizer.init(a)}
    state = jax.device_put(state, trainer.state_shardings)
    reference = jax.device_put(b, trainer.state_shardings["params"])
    batch = first_batch(dpo_keys(world))
    _, got = trainer.train_step.compiled(state, trainer.put_batch(batch), reference)
    want = reference_metrics(world, batch, policy=0, reference=1)
    for key, value in want.items():
        assert abs(float(got[key]) - value) <= TOL, (key, float(got[key]), value)
    assert abs(float(got["dpo_chosen_reward"])) > 0.1  # the rewards are not trivially 0
    assert float(got["tokens"]) == batch["targets_mask"].sum()


def run_in_process(argv, trainer=None):
    """train.py's run in this process (the trainer stays inspectable): (config, trainer).
    `trainer`: one built for the same argv by an earlier call, whose compiled step is run
    again (a restarted process compiles the same programs, or reads them from the cache)."""
    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.data import make_data
    from MaxText.train import run
    from MaxText.train_step import build_trainer

    config = load_config(argv)
    config, devs = devices.start(config)
    data = make_data(config)
    try:
        trainer = trainer or build_trainer(config, sharding.make_mesh(config, devs))
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


STEPS = ("steps=4", "checkpoint_period=2", "async_checkpointing=false", "adam_eps=1e-3")
LOSS = (f"dpo_beta={BETA}", f"dpo_label_smoothing={SMOOTHING}")


@pytest.fixture(scope="module")
def trained(world):
    """The trainers the tests share, built in this process: SPMD (`jax.jit`, "jit") and
    pipeline_parallelism=2 ("pp2", which also runs 4 steps as train.py would, run "pp2"),
    default keys otherwise; {name: (config, trainer)}."""
    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.train_step import build_trainer

    config, devs = devices.start(load_config(dpo_keys(world, *STEPS, *LOSS, "run_name=jit")))
    return {
        "jit": (config, build_trainer(config, sharding.make_mesh(config, devs))),
        "pp2": run_in_process(
            dpo_keys(world, *STEPS, *LOSS, "pipeline_parallelism=2", "run_name=pp2")
        ),
    }


def stepped_against_jit(world, trained, steps: int) -> list:
    """The pp2 trainer's compiled step taken `steps` times from the runs' starting state (policy
    A, Adam's moments zero) on the runs' batches, and before each the jit trainer's step from
    the same state (in its own tree), the same batch and the same reference (A): per step
    ((state, metrics) wanted, (state, metrics) got), as numpy, states in the canonical tree."""
    from test_train import relayout

    from MaxText.checkpoint import manager
    from MaxText.checkpoint.layout import CanonicalLayout
    from MaxText.data import make_data
    from MaxText.generate import abstract_params

    (config, pp2), (jit_config, jit) = trained["pp2"], trained["jit"]
    params = manager.load_params(world["ckpt"][0], abstract_params(config), config)[0]
    state = host({"step": np.int32(0), "params": params, "opt_state": pp2.optimizer.init(params)})
    assert jax.tree.structure(state) == jax.tree.structure(pp2.abstract_state)
    jit_reference = manager.load_params(world["ckpt"][0], abstract_params(jit_config), jit_config)
    jit_reference = jax.device_put(jit_reference[0], jit.state_shardings["params"])
    pp2_reference, template = pp2.train_step.reference, pp2.init_state()
    data = make_data(config)
    try:
        batches = [next(data.train) for _ in range(steps)]
    finally:
        data.close()
    canonical = lambda trainer, state: CanonicalLayout(trainer.abstract_state).to_canonical(  # noqa: E731
        jax.tree.leaves(state)
    )
    out = []
    for batch in batches:
        jit_state = jax.device_put(relayout(state, pp2, jit), jit.state_shardings)
        want = jit.train_step.compiled(jit_state, jit.put_batch(batch), jit_reference)
        got = pp2.train_step.compiled(
            put_like(template, state), pp2.put_batch(batch), pp2_reference
        )
        (want_state, want_metrics), (state, got_metrics) = host(want), host(got)
        out.append(
            ((canonical(jit, want_state), want_metrics), (canonical(pp2, state), got_metrics))
        )
    return out


def test_pipelined_equals_jit_reference_frozen_on_its_groups_and_resume(world, trained):
    """pipeline_parallelism=2 with default keys (1f1b, 4 microbatches, scanned layers,
    checkpointing on) against the SPMD step (jax.jit of the same function), 4 steps:
    - step 1: the policy is the reference, loss log 2 and rewards 0;
    - each step, taken from the same state by both programs: metrics within TOL_PIPELINED, the
      state (parameters, Adam's moments) per leaf within STEP_RTOL (reasons: at the top);
    - the reference parameters after 4 steps are bitwise the starting checkpoint's, each leaf on
      the group (and devices) of its stage's policy weights, which is where the step reads it;
    - the reference pass adds no task: 2 stages x 4 microbatches fwd and bwd instances, the
      programs fwd_0, fwd_1, bwd_0, bwd_1;
    - the pipelined run restarted from its step-2 checkpoint repeats steps 3 and 4 bitwise."""
    import shutil

    from jaxpp_integration.schedules import Phase
    from MaxText.checkpoint import manager
    from MaxText.generate import abstract_params

    config, trainer = trained["pp2"]
    pp2 = records(world, "pp2")
    assert abs(pp2[0]["loss"] - math.log(2)) <= 6e-8  # float32's spacing at log 2
    for key in ("dpo_chosen_reward", "dpo_rejected_reward", "dpo_reward_margin"):
        assert abs(pp2[0][key]) <= 1e-6, (key, pp2[0][key])
    steps = stepped_against_jit(world, trained, len(pp2))
    # the stepped trajectory is the run's (the same program from the same state): bit for bit
    assert [float(got["loss"]) for _, (_, got) in steps] == [r["loss"] for r in pp2]
    for k, ((want_state, want), (got_state, got)) in enumerate(steps, 1):
        for key in ("loss", "dpo_chosen_reward", "dpo_rejected_reward"):
            assert abs(want[key] - got[key]) <= TOL_PIPELINED, (k, key, want[key], got[key])
        assert abs(want["grad_norm"] - got["grad_norm"]) <= STEP_RTOL * want["grad_norm"], k
        assert want["tokens"] == got["tokens"] == pp2[k - 1]["trained_tokens"]
        assert_close_per_leaf(want_state, got_state, STEP_RTOL, f"step {k} state ")

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

    # The restart runs the same compiled step; its reference is dropped first, so the restart
    # must read it again (from load_parameters_path: the run's checkpoints hold no reference).
    run = world["root"] / "runs" / "pp2"
    shutil.rmtree(run / "checkpoints" / "4")
    trainer.train_step.set_reference(None)
    argv = dpo_keys(world, *STEPS, *LOSS, "pipeline_parallelism=2", "run_name=pp2")
    run_in_process(argv, trainer=trainer)
    again = records(world, "pp2")[len(pp2) :]
    assert [r["step"] for r in again] == [3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in pp2[2:]]  # JSON floats: all bits
