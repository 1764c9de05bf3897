"""`scan_layers=true` with pipelining: one scan per stage, exact against `jax.jit`, stacked
weights on their stage's group, one initialisation and one checkpoint tree for every layout.

Reference for the step: `jax.jit` of the very same step function (same scanned model with its
stage markers, which are the identity outside the engine; `treduce` is a plain loop there), on
one device, from the same initial state. Reference for the initialisation: the unrolled model's
per-layer parameters. Reference for checkpoints: the state that was saved.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from compare import (
    assert_bitwise,
    assert_close_per_leaf,
    assert_on_group,
    host,
    reordered_sum_rtol,
)
from small_model import SMALL_MODEL, SMALL_MODEL_TOKENS, merged
from trainer_checks import built_once
from trainer_checks import random_batches as batches

from MaxText import sharding
from MaxText.checkpoint.layout import CanonicalLayout, canonical_tree, numpy_stack
from MaxText.checkpoint.manager import load_params
from MaxText.cluster import devices
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder
from MaxText.optimizer import make_optimizer
from MaxText.train_step import _init_on, build_trainer, make_train_step, state_specs

COMMON = [*SMALL_MODEL, "warmup_steps_fraction=0", "num_pipeline_microbatches=4"]


def config_of(tmp_path, *overrides):
    return load_config(
        merged(
            str(CONFIGS_DIR / "base.yml"), *COMMON, f"base_output_directory={tmp_path}", *overrides
        )
    )


def build(tmp_path, *overrides):
    config = config_of(tmp_path, *overrides)
    return config, build_trainer(
        config, sharding.make_mesh(config, devices.setup(**config.device_args()))
    )


def canonical(params):
    """Any layout's params as the unrolled tree (numpy), to compare layouts leaf by leaf."""
    return canonical_tree(host(params), take=lambda x, k: x[k], length=lambda x: x.shape[0])


# ---------------------------------------------------------------------------- initialisation


@functools.cache
def initial_params(*overrides):
    """(config, params as numpy) as the trainer initialises them (on the first group when
    pipelined), without compiling a step."""
    config = config_of("/unused", *overrides)
    mesh = sharding.make_mesh(config, devices.setup(**config.device_args()))
    if config.is_pipelined:
        mesh = sharding.make_mpmd_mesh(mesh).unstack[0]
    model = Decoder(config)
    optimizer = make_optimizer(config)[0]
    _, specs = state_specs(config, model, optimizer)
    init_state, _ = _init_on(mesh, config, model, optimizer, specs)
    return config, host(init_state()["params"])


@pytest.mark.parametrize(
    "layout",
    [
        ("scan_layers=true",),
        ("scan_layers=true", "pipeline_parallelism=2", "num_decoder_layers=5"),  # 3 + 2 layers
        (
            "scan_layers=true",
            "pipeline_parallelism=2",
            "num_pipeline_repeats=2",
            "pipeline_schedule=interleaved_1f1b",
            "num_decoder_layers=5",
        ),  # fmt: skip
        ("scan_layers=false", "pipeline_parallelism=2", "num_decoder_layers=5"),
    ],
    ids=["scanned", "scanned_pp2_uneven", "scanned_virtual", "unrolled_pp2"],
)
def test_same_seed_same_initial_weights_in_every_layout(layout):
    """Layer i gets the same values scanned or unrolled, whatever the stages (bitwise)."""
    depth = next((o for o in layout if o.startswith("num_decoder_layers")), None)
    _, want = initial_params("scan_layers=false", *([depth] if depth else []))
    config, got = initial_params(*layout)
    if config.scan_layers:
        assert not any(k.startswith("layers_") and k[7:].isdigit() for k in got)
        names = {k for k in got if k.startswith("layers")}
        assert names == ({"layers"} if config.num_stages == 1 else
                         {f"layers_stage_{s}" for s in range(config.num_stages)})  # fmt: skip
    assert_bitwise(want, canonical(got), "init ")


def test_layers_do_not_share_initial_values():
    """Each layer has its own key: no two layers start equal (a shared key would pass above)."""
    _, params = initial_params("scan_layers=false")
    a, b = params["layers_0"]["mlp"]["wo"], params["layers_1"]["mlp"]["wo"]
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------------------- pipelined step

# group holding each stage (hand-written: interleaved round-robin, DualPipeV's V)
HOMES = {
    "gpipe": (0, 1),
    "1f1b": (0, 1),
    "zero_bubble": (0, 1),
    "interleaved_1f1b": (0, 1, 0, 1),
    "dualpipev": (0, 1, 1, 0),
}
# GPipe and 1F1B share one layout (uneven 3 + 2, remat inside the scan), so their steps' stage
# programs and their `jax.jit` reference are the same programs, compiled once (the session's
# compilation cache); stages without remat: the virtual layouts below.
LAYOUTS = {
    "gpipe": ("num_decoder_layers=5", "remat_policy=full"),
    "1f1b": ("num_decoder_layers=5", "remat_policy=full"),
    "zero_bubble": (),
    "interleaved_1f1b": ("num_pipeline_repeats=2", "num_decoder_layers=9"),  # 2, 3, 2, 2
    "dualpipev": ("num_pipeline_repeats=2", "num_decoder_layers=9"),
}


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """`trainers(*overrides)`: (config, trainer) built once for the whole file (the one-layer
    DualPipeV step test and the checkpoint test share theirs; none writes into its folder)."""
    return built_once(build, tmp_path_factory.mktemp("trainers"))


def run_against_jit(trainers, schedule, *overrides, steps=2, rtol=0.0):
    """Steps the pipelined scanned trainer, and before each step `jax.jit` of its step function
    from the same input state (the pipelined step's): bitwise when `rtol` is 0, else each leaf
    of the state and metrics within `rtol` of its largest magnitude (one step's differences)."""
    config, trainer = trainers(
        "scan_layers=true",
        "pipeline_parallelism=2",
        f"pipeline_schedule={schedule}",
        *(overrides or LAYOUTS[schedule]),
    )
    reference = jax.jit(
        make_train_step(config, trainer.model, trainer.optimizer, trainer.lr_schedule)
    )
    state = trainer.init_state()
    for k, batch in enumerate(batches(config, steps)):
        want_state, want_metrics = reference(host(state), batch)
        state, metrics = trainer.train_step(state, trainer.put_batch(batch))
        what = f"{schedule} step {k + 1} "
        if rtol == 0.0:
            assert_bitwise(host(want_metrics), host(metrics), f"{what}metrics ")
            assert_bitwise(host(want_state), host(state), f"{what}state ")
        else:
            assert_close_per_leaf(host(want_metrics), host(metrics), rtol, f"{what}metrics ")
            assert_close_per_leaf(host(want_state), host(state), rtol, f"{what}state ")
    return config, trainer, state


def assert_stage_weights_on_their_groups(config, trainer, state, homes):
    """`layers_stage_<s>` (params and both Adam moments) lives only on stage s's group."""
    assert config.num_stages == len(homes)
    found = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        for s in range(config.num_stages):
            if f"['layers_stage_{s}']" in name:
                assert leaf.shape[0] == config.stage_layers[s], name
                assert_on_group(leaf, trainer.mpmd_mesh, (homes[s],))
                found += 1
    assert found == 3 * 9 * config.num_stages  # params, mu, nu x 9 leaves per llama layer


def test_scanned_1f1b_uneven_stages_with_remat_is_bitwise(trainers):
    """1F1B, 3 + 2 layers, remat_policy=full inside the scan: bitwise equal to `jax.jit`."""
    config, trainer, state = run_against_jit(trainers, "1f1b")
    assert config.stage_layers == (3, 2)
    assert_stage_weights_on_their_groups(config, trainer, state, HOMES["1f1b"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_scanned_pipeline_is_bitwise_for_gpipe_and_interleaved(trainers, schedule):
    """Bitwise equal to `jax.jit` of the same step (GPipe: uneven stages of 3 + 2 layers with
    remat; Interleaved: virtual stages of 2-3 layers without); each stage's stack on its group.

    Why bitwise: a stage of two or more layers is a `while` loop whose body XLA compiles as a
    computation of its own, the same in the stage's program as in `jax.jit`'s one program, and
    the work between stages is the engine's usual bitwise case (tests/test_engine_equivalence.py).
    """
    config, trainer, state = run_against_jit(trainers, schedule)
    assert_stage_weights_on_their_groups(config, trainer, state, HOMES[schedule])


# One step from the same state, where the pipelined program adds some sums in another order
# than `jax.jit`'s: every loss and gradient entry is a sum over the step's SMALL_MODEL_TOKENS
# tokens, Adam's `nu` holds squares of them (`reordered_sum_rtol`, tests/compare.py: 3.0e-5 of
# each leaf). Measured on one host: at most 3.9 EPS32 per step (chained over 3 steps instead: a
# `nu` 134 EPS32 apart, the reason for comparing step by step).
ONE_STEP_RTOL = reordered_sum_rtol(SMALL_MODEL_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zero_bubble", "dualpipev"])
def test_scanned_split_backward_schedules_agree_step_by_step(trainers, schedule):
    """ZeroBubble and DualPipeV (4 and 9 layers; uneven virtual stages for the V): each step
    from the same state within `ONE_STEP_RTOL` of each leaf, not bitwise; each stage's stack on
    its group.

    The trainer compiles the pipelined step under its activation-sharding rules (so the batch
    stays split over fsdp inside stages), the `jax.jit` reference here without them; where the
    first stage's backward is cut differently (ZeroBubble's bwdI/bwdW, the V's first stage) the
    constraint moves one reduction of the token embedding's gradient (its entries ~1 ulp apart),
    and through the global-norm clip factor every gradient may scale ~1 ulp apart."""
    config, trainer, state = run_against_jit(trainers, schedule, rtol=ONE_STEP_RTOL)
    assert_stage_weights_on_their_groups(config, trainer, state, HOMES[schedule])


@pytest.mark.slow
def test_one_layer_stages_agree_step_by_step(trainers):
    """DualPipeV with one layer per stage (4 layers, 4 stages): each step from the same state
    within `ONE_STEP_RTOL` of each leaf, not bitwise.

    XLA's while-loop simplifier inlines a scan of one trip, so the layer's ops fuse with their
    neighbours across the stage boundary as unrolled layers do, and the per-stage program orders
    the layer's reductions differently from `jax.jit`'s whole step (the cause tests/test_train.py
    names for unrolled pipelines).
    """
    config, trainer, state = run_against_jit(
        trainers, "dualpipev", "num_pipeline_repeats=2", rtol=ONE_STEP_RTOL
    )
    assert config.stage_layers == (1, 1, 1, 1)
    assert_stage_weights_on_their_groups(config, trainer, state, HOMES["dualpipev"])


# ---------------------------------------------------------------------------- checkpoints


class _Iterator:
    """The training iterator's checkpoint seam (position only)."""

    def __init__(self):
        self.position = {"step": 0}

    def get_state(self):
        return dict(self.position)

    def set_state(self, state):
        self.position = dict(state)


class _Data:
    def __init__(self):
        self.train = _Iterator()


def test_canonical_tree_names_every_layer_and_maps_back():
    """Scanned, 5 layers on stages of 3 + 2: canonical `layers_3` is `layers_stage_1[0]` (in the
    params and in both Adam moments), and the way back restores the stacked state exactly."""
    config = config_of(
        "/unused", "scan_layers=true", "pipeline_parallelism=2", "num_decoder_layers=5"
    )
    abstract, _ = state_specs(config, Decoder(config), make_optimizer(config)[0])
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(abstract)
    values = [rng.standard_normal(a.shape).astype(a.dtype) for a in leaves]
    state = jax.tree.unflatten(treedef, values)
    layout = CanonicalLayout(abstract)
    canon = layout.to_canonical(values)
    names = [k for k in canon["params"] if k.startswith("layers")]
    assert sorted(names) == sorted(f"layers_{i}" for i in range(5))
    moments = [canon["opt_state"][1][0].mu, canon["opt_state"][1][0].nu]
    for got, tree in zip([canon["params"], *moments], [state["params"], *_moments(state)]):
        np.testing.assert_array_equal(
            got["layers_3"]["mlp"]["wo"], tree["layers_stage_1"]["mlp"]["wo"][0]
        )
        np.testing.assert_array_equal(
            got["layers_2"]["mlp"]["wo"], tree["layers_stage_0"]["mlp"]["wo"][2]
        )
    assert jax.tree.map(np.shape, canon["params"]["layers_4"]) == jax.tree.map(
        lambda x: x.shape[1:], state["params"]["layers_stage_1"]
    )
    flat = jax.tree.leaves(canon)
    back = layout.from_canonical(flat, range(len(flat)), numpy_stack)
    assert_bitwise(state, jax.tree.unflatten(treedef, [back[j] for j in range(len(values))]))


def _moments(state):
    adam = state["opt_state"][1][0]
    return [adam.mu, adam.nu]


def _checkpoints(config, trainer, run_dir):
    from MaxText.checkpoint.manager import Checkpoints

    run = dict(base_output_directory=str(run_dir.parent), run_name=run_dir.name)
    config = config.replace(enable_checkpointing=True, **run)
    return Checkpoints(config, trainer)


# 4 one-layer stages on 2 groups in DualPipeV's V (stage 3 back on group 0): the one-layer step
# test's trainer, reused
SCANNED_V = (
    "scan_layers=true",
    "pipeline_parallelism=2",
    "pipeline_schedule=dualpipev",
    "num_pipeline_repeats=2",
)
UNROLLED_PP2 = ("scan_layers=false", "pipeline_parallelism=2")
UNROLLED_SPMD = ("scan_layers=false",)
SCANNED_SPMD = ("scan_layers=true",)


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, targets",
    [(SCANNED_V, (UNROLLED_PP2, UNROLLED_SPMD)), (UNROLLED_PP2, (SCANNED_V, SCANNED_SPMD))],
    ids=["scanned_virtual_to_unrolled", "unrolled_pp2_to_scanned"],
)
def test_checkpoint_moves_between_scanned_and_unrolled(tmp_path_factory, trainers, source, targets):
    """A state saved in one layer layout is restored bitwise in the others (compared in the
    canonical tree with what was saved), placed where the target step wants it, and trains on:
    the next step's loss (one step from the same state) equals the source layout's within
    `reordered_sum_rtol` of its SMALL_MODEL_TOKENS terms (other programs: the pipelined and SPMD
    steps sum microbatches and reduce in another order, see tests/test_train.py)."""
    run_dir = tmp_path_factory.mktemp("run")
    config, trainer = trainers(*source)
    step_batches = batches(config, 2)
    state, _ = trainer.train_step(trainer.init_state(), trainer.put_batch(step_batches[0]))
    saved = canonical(host(state))
    checkpoints = _checkpoints(config, trainer, run_dir)
    checkpoints.maybe_save(1, state, _Data(), final=True)
    checkpoints.close()
    _, metrics = trainer.train_step(state, trainer.put_batch(step_batches[1]))
    want_loss = float(np.asarray(metrics["loss"]))

    for target in targets:
        config_t, trainer_t = trainers(*target)
        checkpoints = _checkpoints(config_t, trainer_t, run_dir)
        restored = checkpoints.restore_or_init(_Data())
        checkpoints.close()
        assert_bitwise(saved, canonical(host(restored)), f"{target} ")
        if config_t.is_pipelined and config_t.scan_layers:
            assert_stage_weights_on_their_groups(config_t, trainer_t, restored, HOMES["dualpipev"])
        _, metrics = trainer_t.train_step(restored, trainer_t.put_batch(step_batches[1]))
        rtol = reordered_sum_rtol(SMALL_MODEL_TOKENS, squared=False)
        np.testing.assert_allclose(float(np.asarray(metrics["loss"])), want_loss, rtol=rtol)

    # generate's reader: the params in a scanned SPMD tree, as numpy
    scanned = config_of(run_dir, *SCANNED_SPMD)
    abstract = state_specs(scanned, Decoder(scanned), make_optimizer(scanned)[0])[0]["params"]
    params, _ = load_params(run_dir, abstract, scanned)
    assert_bitwise(saved["params"], canonical(params), "load_params ")
