"""The train step and loop: SPMD layouts and microbatching agree with one device, the pipelined
step agrees with the unpipelined one, the loop logs what it promises, NaN aborts, `train.py` runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compare import assert_bitwise, assert_close_per_leaf, host, put_like, reordered_sum_rtol
from small_model import SMALL_MODEL, SMALL_MODEL_TOKENS, merged
from trainer_checks import built_once, relayout

from MaxText import sharding
from MaxText.checkpoint.layout import CanonicalLayout
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder, cross_entropy_sums
from MaxText.optimizer import _decay_mask, learning_rate_schedule, make_optimizer
from MaxText.train import TrainingDivergedError, run
from MaxText.train_step import build_trainer, split_microbatches, state_specs

REPO = Path(__file__).resolve().parent.parent

SMALL = [
    *SMALL_MODEL,
    "warmup_steps_fraction=0",
    "steps=3",
    "enable_progress_bar=false",
    "enable_tensorboard=false",
    "enable_checkpointing=false",  # the loop tests feed a stand-in iterator without get_state
]


def small_config(tmp_path, *overrides):
    return load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"), *SMALL, f"base_output_directory={tmp_path}", *overrides
        )
    )


def make_batches(config, n, seed=0):
    rng = np.random.default_rng(seed)
    b, length = config.global_batch_size, config.max_target_length
    out = []
    for _ in range(n):
        x = rng.integers(0, config.vocab_size, (b, length + 1))
        mask = (rng.random((b, length)) > 0.2).astype(np.float32)  # some padding
        out.append({"inputs": x[:, :-1], "targets": x[:, 1:], "targets_mask": mask})
    return out


def build(tmp_path, *overrides):
    config = small_config(tmp_path, *overrides)
    return config, build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )


def train(tmp_path, *overrides, trainer=None, steps=3):
    """(per-step losses, initial params, final params) as numpy."""
    config, trainer = trainer or build(tmp_path, *overrides)
    state = trainer.init_state()
    init = jax.tree.map(np.asarray, state["params"])
    losses = []
    for batch in make_batches(config, steps):
        state, metrics = trainer.train_step(state, trainer.put_batch(batch))
        losses.append(float(np.asarray(metrics["loss"])))
    assert int(np.asarray(state["step"])) == steps
    return np.asarray(losses), init, jax.tree.map(np.asarray, state["params"])


# One step from the same state in two layouts: every loss and gradient entry is a sum over the
# step's SMALL_MODEL_TOKENS tokens that the two programs add in other orders (sharded partial
# sums, microbatch partials, a stage's backward compiled on its own); Adam's `nu` holds squares
# of them: `reordered_sum_rtol` (3.0e-5). The parameters move by lr times Adam's update, which
# those gradients decide. Measured on one host: at most 44 EPS32 of a leaf (3 steps, every layout
# below), against the bound's 254.
ONE_STEP_RTOL = reordered_sum_rtol(SMALL_MODEL_TOKENS)
M4 = "num_pipeline_microbatches=4"


def stepped_alike(reference, candidate, steps=3) -> list:
    """Steps `candidate` ((config, trainer)) `steps` times from its initial state and, before
    each step, `reference` from the same input state (float32 differences grow step after step
    through Adam, so a bound counts one step's differences: tests/compare.py). The layouts may
    differ (scanned or unrolled layers, stages): states cross through the checkpoints' canonical
    tree. Both start from the same initial state, bitwise (same seed). Returns per step
    ((state, metrics) wanted, (state, metrics) got), as numpy, states in the canonical tree."""
    (config, ref), (_, cand) = reference, candidate
    ref_layout, cand_layout = ref.init_state(), cand.init_state()  # placement templates
    canonical = lambda trainer, state: CanonicalLayout(trainer.abstract_state).to_canonical(
        jax.tree.leaves(state)
    )
    assert_bitwise(
        canonical(ref, host(ref_layout)), canonical(cand, host(cand_layout)), "initial state "
    )
    state, out = host(cand_layout), []
    for batch in make_batches(config, steps):
        want = ref.train_step(
            put_like(ref_layout, relayout(state, cand, ref)), ref.put_batch(batch)
        )
        got = cand.train_step(put_like(cand_layout, state), cand.put_batch(batch))
        (want_state, want_metrics), (state, got_metrics) = host(want), host(got)
        out.append(
            ((canonical(ref, want_state), want_metrics), (canonical(cand, state), got_metrics))
        )
    assert int(state["step"]) == steps
    return out


def assert_steps_agree(steps: list, rtol: float) -> None:
    """Each step's metrics and state (params, Adam's moments) within `rtol` of each leaf's
    largest magnitude. (Not the update itself: Adam divides each gradient entry by its own
    magnitude plus adam_eps, so an entry near zero turns its absolute rounding difference into
    up to lr / adam_eps times it in the update, unrelated to the update's scale; `mu` and `nu`
    check the gradients, the parameters the update's effect.)"""
    for k, ((want_state, want_metrics), (got_state, got_metrics)) in enumerate(steps, 1):
        assert_close_per_leaf(want_metrics, got_metrics, rtol, f"step {k} metrics ")
        assert_close_per_leaf(want_state, got_state, rtol, f"step {k} state ")


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """`trainers(*overrides)`: (config, trainer) of SMALL with `overrides`, built once for the
    whole file (tests of one layout share its compiled steps; none writes into its folder)."""
    return built_once(build, tmp_path_factory.mktemp("trainers"))


@pytest.fixture(scope="module")
def one_device_trainer(trainers):
    """(config, trainer) on one device; the loop tests reuse its compiled step."""
    return trainers()


@pytest.fixture(scope="module")
def one_device(one_device_trainer):
    return train(None, trainer=one_device_trainer)


def test_microbatches_are_strided_rows():
    x = np.arange(8 * 3).reshape(8, 3)
    mb = np.asarray(split_microbatches(x, 4))
    assert mb.shape == (4, 2, 3)
    np.testing.assert_array_equal(mb[1], x[[1, 5]])


def test_learning_rate_schedule_and_weight_decay_mask(tmp_path):
    config = small_config(tmp_path, "steps=100", "warmup_steps_fraction=0.1", "learning_rate=3e-3")
    lr = learning_rate_schedule(config)
    # warmup 0 -> 3e-3 over 10 steps, cosine towards 3e-4 at step 100, then 0 (as MaxText)
    cos_99 = 3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi * 89 / 90))
    expected = {0: 0.0, 5: 1.5e-3, 10: 3e-3, 55: 3e-4 + 2.7e-3 * 0.5, 99: cos_99, 100: 0, 150: 0}
    for step, value in expected.items():
        # float32 (the schedule) against float64 (the formula): a few roundings of ~6e-8 each
        assert float(lr(step)) == pytest.approx(value, rel=1e-5, abs=1e-9), step
    gpt = small_config(tmp_path, "decoder_block=gpt")
    abstract_state, _ = state_specs(gpt, Decoder(gpt), make_optimizer(gpt)[0])
    mask = _decay_mask(abstract_state["params"])
    attention = mask["layers_0"]["self_attention"]
    assert attention["query_kernel"] and not attention["query_bias"] and "key_bias" not in attention
    assert mask["token_embedding"] and not mask["decoder_norm"]["scale"]
    assert not mask["layers_0"]["mlp"]["wi_bias"] and mask["layers_0"]["mlp"]["wi"]


@pytest.mark.parametrize(
    "layout",
    [
        ("ici_data_parallelism=2", "ici_fsdp_parallelism=4"),
        ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    ],
    ids=["data2-fsdp4", "data2-fsdp2-tensor2"],
)
def test_spmd_layouts_match_one_device(one_device_trainer, trainers, layout):
    """Sharded reductions sum in another order: each step within `ONE_STEP_RTOL`."""
    assert_steps_agree(stepped_alike(one_device_trainer, trainers(*layout)), ONE_STEP_RTOL)


def test_microbatching_matches_full_batch(one_device_trainer, unpipelined_m4):
    """4 microbatches sum 4 partial losses and gradients instead of one: each step within
    `ONE_STEP_RTOL`."""
    assert_steps_agree(stepped_alike(one_device_trainer, unpipelined_m4), ONE_STEP_RTOL)


def test_scanned_and_unrolled_layers_train_alike(one_device, tmp_path):
    """The same seed gives the same initial weights with scan_layers=true and false (compared in
    the canonical per-layer tree), and the two train the same: losses, grad norms and params
    after 3 steps bitwise on one device.

    Measured bitwise here (XLA:CPU computes the loop body of the scan with the same arithmetic
    as each unrolled layer). Nothing guarantees it: XLA may fuse an unrolled layer with its
    neighbours differently from a loop body; should a compiler change break it, that is the
    cause, and the bound would be 1e-6 per leaf as for pipelined layouts.
    """
    from MaxText.checkpoint.layout import canonical_tree

    config_default = small_config(tmp_path)
    other = "scan_layers=false" if config_default.scan_layers else "scan_layers=true"
    got = train(tmp_path, other)

    def canonical(params):
        return canonical_tree(params, take=lambda x, k: x[k], length=lambda x: x.shape[0])

    (losses_a, init_a, final_a), (losses_b, init_b, final_b) = one_device, got
    assert_bitwise(canonical(init_a), canonical(init_b), "init ")
    assert_bitwise(losses_a, losses_b, "losses ")
    assert_bitwise(canonical(final_a), canonical(final_b), "params ")


class _Data:
    """Stand-in for MaxText.data in loop tests: fixed random batches, a small eval split."""

    def __init__(self, config):
        self.train = iter(make_batches(config, config.steps + 1))
        self._eval = make_batches(config, 2, seed=1)
        self.tokenizer = None

    def eval_batches(self):
        return iter(self._eval)


METRIC_KEYS = {
    "step",
    "raw_grad_norm",
    "total_weights",
    "loss",
    "step_time_s",
    "tokens_per_s_per_device",
    "tflops_per_s_per_device",
    "mfu",
    "grad_norm",
    "learning_rate",
}


def loop_config(config, tmp_path, **loop_keys):
    """The same model and step with other loop-only keys (logging, evaluation, outputs)."""
    keys = dict(base_output_directory=str(tmp_path), run_name="run", metrics_file="")
    return config.replace(**keys, **loop_keys)


def _tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} read from the TFRecord event files (tensorboardX's Event proto)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in folder.glob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4  # length, its crc, the record, its crc
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


STEP_LINE = re.compile(
    r"^completed step: (\d+), seconds: (\d+\.\d{3}), TFLOP/s/device: (\d+\.\d{3}), "
    r"Tokens/s/device: (\d+\.\d{3}), total_weights: (\d+), loss: (\d+\.\d{3})$"
)


def test_loop_writes_metrics_and_evaluates(one_device_trainer, one_device, tmp_path, capsys):
    config, trainer = one_device_trainer
    config = loop_config(config, tmp_path, log_period=2, eval_interval=1, enable_tensorboard=True)
    capsys.readouterr()
    last = run(config, trainer, _Data(config))
    records = [json.loads(line) for line in Path(config.metrics_file).read_text().splitlines()]
    # MaxText's line after every step; total_weights = the batch's unmasked target tokens
    lines = [m for m in map(STEP_LINE.match, capsys.readouterr().out.splitlines()) if m]
    weights = [int(b["targets_mask"].sum()) for b in make_batches(config, 3)]
    assert [int(m[1]) for m in lines] == [1, 2, 3]
    assert [int(m[5]) for m in lines] == weights == [r["total_weights"] for r in records]
    assert [m[6] for m in lines] == [f"{r['loss']:.3f}" for r in records]
    # TensorBoard: MaxText's names, grad_norm after clipping and raw_grad_norm before
    scalars = _tensorboard_scalars(Path(config.tensorboard_dir))
    for tag, key in (
        ("learning/grad_norm", "grad_norm"),
        ("learning/raw_grad_norm", "raw_grad_norm"),
        ("learning/total_weights", "total_weights"),
    ):
        want = {r["step"]: r[key] for r in records}
        # stored as float32: one rounding, at most 2^-24 = 6e-8 relative
        assert scalars[tag] == pytest.approx(want, rel=1e-6), tag
    assert all(r["grad_norm"] == min(r["raw_grad_norm"], 1.0) for r in records)
    assert [r["step"] for r in records] == [1, 2, 3]  # eval every step forces a record
    config = loop_config(config, tmp_path / "b", log_period=2, eval_interval=0)
    custom = tmp_path / "elsewhere" / "m.jsonl"  # metrics_file= (MaxText's key): any path
    config = config.replace(metrics_file=str(custom))
    run(config, trainer, _Data(config))
    assert not (tmp_path / "b" / "run" / "metrics.jsonl").exists()
    plain = [json.loads(line) for line in custom.read_text().splitlines()]
    assert [r["step"] for r in plain] == [2, 3]  # log_period, and the last step
    for r in records + plain:
        assert METRIC_KEYS <= set(r)
        assert r["step_time_s"] > 0 and r["tokens_per_s_per_device"] > 0 and r["mfu"] > 0
    assert all("eval_loss" in r and r["eval_batches"] == 2 for r in records)
    assert not any("eval_loss" in r for r in plain)
    assert [r["loss"] for r in records[1:]] == [r["loss"] for r in plain]  # same run, same data
    assert last == records[-1]
    assert [r["loss"] for r in records] == one_device[0].tolist()  # the loop runs the same steps
    assert any(Path(config.tensorboard_dir).glob("events.out.tfevents.*"))


def test_grad_norms_are_maxtexts(one_device_trainer):
    """raw_grad_norm is the norm of the gradients, grad_norm the norm after
    clip_by_global_norm, against a plain jax.jit of the loss gradient and optax's clipping.
    Not bitwise: the step sums the gradients over the batch's tokens in its own program, each
    entry within `ONE_STEP_RTOL` of its leaf; a norm's relative error is at most its entries'."""
    config, trainer = one_device_trainer
    state = trainer.init_state()
    params = jax.tree.map(np.asarray, state["params"])
    batch = make_batches(config, 1)[0]
    _, metrics = trainer.train_step(state, trainer.put_batch(batch))

    def mean_loss(p):
        logits = trainer.model.apply({"params": p}, jnp.asarray(batch["inputs"]))
        total, count = cross_entropy_sums(logits, batch["targets"], batch["targets_mask"])
        return total / count

    grads = jax.jit(jax.grad(mean_loss))(params)
    threshold = config.gradient_clipping_threshold
    raw = float(optax.tree.norm(grads))
    assert raw > threshold  # clipping is active, so the two norms differ
    clipped, _ = optax.clip_by_global_norm(threshold).update(grads, None)
    np.testing.assert_allclose(float(metrics["raw_grad_norm"]), raw, rtol=ONE_STEP_RTOL)
    np.testing.assert_allclose(
        float(metrics["grad_norm"]), float(optax.tree.norm(clipped)), rtol=ONE_STEP_RTOL
    )


def test_nan_loss_aborts_with_step_number(one_device_trainer, tmp_path):
    """The loop reads metrics one step late; the abort must still name the step that diverged."""
    config, trainer = one_device_trainer
    config = loop_config(config, tmp_path, log_period=10, eval_interval=0)
    calls = []

    def step_with_nan_at_2(state, batch):
        state, metrics = trainer.train_step(state, batch)
        calls.append(1)
        if len(calls) == 2:
            metrics = {**metrics, "loss": metrics["loss"] * float("nan")}
        return state, metrics

    nan_trainer = dataclasses.replace(trainer, train_step=step_with_nan_at_2)
    with pytest.raises(TrainingDivergedError, match=r"loss is nan at step 2; aborting"):
        run(config, nan_trainer, _Data(config))


# ---------------------------------------------------------------------------- pipelined (MPMD)


@pytest.fixture(scope="module")
def unpipelined_m4(trainers):
    return trainers(M4)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_unpipelined(unpipelined_m4, trainers, pp):
    """Same seed and microbatching: pipeline_parallelism=2 and 4 train like 1, each step within
    `ONE_STEP_RTOL` of the unpipelined step from the same state.

    Not bitwise: the engine compiles each stage's backward as its own XLA program, and XLA orders
    one reduction differently there (the first RMSNorm's scale gradient, 2 ulp of its largest
    entry on one host); global-norm clipping spreads that through every update.
    """
    got = trainers(f"pipeline_parallelism={pp}", M4)
    assert_steps_agree(stepped_alike(unpipelined_m4, got), ONE_STEP_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "dualpipev"])
def test_virtual_stages_match_unpipelined(unpipelined_m4, trainers, schedule):
    """num_pipeline_repeats=2: 4 stages of one layer on 2 groups; same bound and reason as above."""
    got = trainers(
        "pipeline_parallelism=2", "num_pipeline_repeats=2", f"pipeline_schedule={schedule}", M4
    )
    assert_steps_agree(stepped_alike(unpipelined_m4, got), ONE_STEP_RTOL)


@pytest.mark.slow
def test_tied_embedding_across_stages(tmp_path):
    """gpt block with logits_via_embedding: the table is used by the first and the last stage,
    whose two gradient contributions are added in another program: `ONE_STEP_RTOL`. Two layers,
    one per stage: the first and the last stage are what the tie is about (more layers only
    lengthen both compiles)."""
    tied = (
        "decoder_block=gpt",
        "logits_via_embedding=true",
        "num_pipeline_microbatches=4",
        "num_decoder_layers=2",
    )
    reference = build(tmp_path / "one", *tied)
    got = build(tmp_path, "pipeline_parallelism=2", *tied)
    assert got[0].stage_layers == (1, 1)
    assert_steps_agree(stepped_alike(reference, got), ONE_STEP_RTOL)


def test_pipelined_state_stays_on_its_stage_group(trainers):
    """pipeline_parallelism=4, one layer per stage: after a step every parameter and Adam moment
    lives only on its stage's group (the optimizer update runs there), so no group holds the
    whole model; only the scalar step counters are on every group."""
    config, trainer = trainers("pipeline_parallelism=4", M4)
    state = trainer.init_state()
    for batch in make_batches(config, 2):
        state, _ = trainer.train_step(state, trainer.put_batch(batch))
    home = {"token_embedding": (0,), "decoder_norm": (3,), "logits_kernel": (3,)}
    home.update({f"layers_{k}": (k,) for k in range(4)})
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 0:  # step, Adam's count
            assert leaf.mpmd_idxs == (0, 1, 2, 3), name
            continue
        owner = next(v for k, v in home.items() if f"['{k}']" in name)
        assert leaf.mpmd_idxs == owner, name


def test_pipelined_eval_keeps_stages_on_their_groups(one_device_trainer, trainers):
    """pipeline_parallelism=2 evaluates as a forward-only pipeline: each param leaf is read by the
    groups the train step left it on (no copy to one device), and the sums equal one device's.

    Bounds: token counts exact; loss sums within `reordered_sum_rtol` of the batch's tokens'
    positive losses (the pipeline adds 4 microbatch sums, one device sums the whole batch at
    once)."""
    config, trainer = trainers("pipeline_parallelism=2", M4)
    state = trainer.init_state()
    state, _ = trainer.train_step(state, trainer.put_batch(make_batches(config, 1)[0]))
    params = state["params"]
    assert trainer.eval_step.pipelined.compiled is None  # compiled at the first evaluation
    trainer.eval_step(params, trainer.put_batch(make_batches(config, 1)[0]))
    compiled = trainer.eval_step.pipelined.compiled
    leaves = jax.tree.leaves(params)
    for j, leaf in enumerate(leaves):  # the params are the first leaves of (params, batch)
        assert set(compiled.program.inputs[j]) == set(leaf.mpmd_idxs), j
    assert {r for j in range(len(leaves)) for r in compiled.program.inputs[j]} == {0, 1}

    reference = one_device_trainer[1]
    host_params = jax.tree.map(np.asarray, params)
    for batch in make_batches(config, 2, seed=1):
        got = trainer.eval_step(params, trainer.put_batch(batch))
        want = reference.eval_step(host_params, reference.put_batch(batch))
        assert float(got["tokens"]) == float(want["tokens"])
        rtol = reordered_sum_rtol(SMALL_MODEL_TOKENS, squared=False)
        np.testing.assert_allclose(float(got["loss_sum"]), float(want["loss_sum"]), rtol=rtol)


@pytest.mark.slow
def test_pipeline_with_fsdp_inside_stages(unpipelined_m4, trainers):
    """pipeline_parallelism=2 x ici_fsdp_parallelism=2: sharded reductions inside pipelined
    stages, `ONE_STEP_RTOL`."""
    got = trainers("pipeline_parallelism=2", "ici_fsdp_parallelism=2", M4)
    assert_steps_agree(stepped_alike(unpipelined_m4, got), ONE_STEP_RTOL)


def test_fsdp_inside_stages_splits_the_microbatch(trainers):
    """Data parallelism inside a stage: with ici_fsdp_parallelism=2 every device of a group
    computes half of each microbatch, so the hidden state a stage sends to the next is split
    along the batch (the trainer's activation constraints hold inside pipeline stages too).
    Reference: the microbatch size over the fsdp axis, from the config alone."""
    from jaxpp_integration.compiler.program import Transfer

    config, trainer = trainers("pipeline_parallelism=2", "ici_fsdp_parallelism=2", M4)
    prog, sh = trainer.train_step.program, trainer.train_step.slot_sharding
    hidden = (config.microbatch_size, config.max_target_length, config.emb_dim)
    sent = [
        t for t in prog.instrs if isinstance(t, Transfer) and prog.slot_aval[t.dst].shape == hidden
    ]
    assert sent, "no stage-boundary hidden state was sent between groups"
    for t in sent:
        for slot in (t.src, t.dst):
            assert sh[slot].shard_shape(hidden)[0] == config.microbatch_size // 2, sh[slot]


def test_train_py_has_a_pulse(tmp_path):
    """`python train.py` end to end in a fresh CPU process on the real data module (synthetic),
    2 layers, 2 steps, pipeline_parallelism=2: it emulates the 2 devices it needs and says so
    once, logs the schedule, trains (a line per step, metrics records with every key, an
    evaluation), writes TensorBoard events. (A fresh process on the default SPMD path:
    tests/test_train_maxtext.py::test_maxtext_getting_started_command_runs_unchanged.)"""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # no emulation asked for: the trainer decides
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "configs/base.yml",
            "pipeline_parallelism=2",
            "num_decoder_layers=2",
            "steps=2",
            "log_period=1",
            "eval_interval=2",
            "eval_steps=1",
            "dataset_type=synthetic",
            "max_target_length=32",
            "per_device_batch_size=4",
            f"base_output_directory={tmp_path}",
            "run_name=pulse",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    emulation = [x for x in proc.stderr.splitlines() if "emulating" in x]
    assert emulation == [
        "emulating 2 CPU devices for ici_pipeline_parallelism=2 (this host has no accelerator)"
    ]
    assert "schedule 1f1b, stages of [1, 1] layers" in proc.stdout
    assert "step 2/2 | loss" in proc.stdout and "(CPU estimate)" in proc.stdout
    lines = (tmp_path / "pulse" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert all(METRIC_KEYS <= set(r) for r in records) and "eval_loss" in records[-1]
    assert all(np.isfinite(r["loss"]) for r in records) and np.isfinite(records[-1]["eval_loss"])
    assert any((tmp_path / "pulse" / "tensorboard").glob("events.out.tfevents.*"))
