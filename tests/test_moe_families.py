"""Mixtral and Qwen3-MoE end to end against an implementation nobody here wrote: a random small
Hugging Face checkpoint (written by the test) converts with `to_maxtext`, gives the logits, the
greedy ids and the first training step's loss (at pipeline_parallelism=2 x
ici_expert_parallelism=2, default keys) of a float64 numpy forward pass of the published formulas
(tests/family_reference.py: softmax over all experts -> top-k -> renormalise -> weighted SwiGLU
experts), and exports back bit for bit, stacked experts included; config.json fields that describe
other models (dense layers among the MoE ones) are refused in one line.

Routing is discontinuous: every fixture asserts a gap of at least 1e-3 between the k-th and
(k+1)-th router probability of every token in every layer of the reference, so float32 (ours)
against float64 cannot route a token differently. Tolerance 1e-5 per logit, as the dense families'
(tests/test_family_models.py): float32 rounding of a few hundred accumulated terms is ~1e-6 at
logits of O(1-10).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from family_reference import (
    cross_entropy,
    hf_config,
    random_tensors,
    reference_logits,
    router_margin,
    write_hf_folder,
)
from hf_round_trip import (
    GREEDY_LENGTH,
    assert_float32_export_bitwise,
    greedy_with_and_without_cache,
)

from MaxText.checkpoint import manager
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.config.checkpoint_keys import MODEL_KEYS
from MaxText.convert.hf_config import model_keys
from MaxText.generate import abstract_params
from MaxText.model import Decoder
from MaxText.to_maxtext import main as to_maxtext

BASE = str(CONFIGS_DIR / "base.yml")
TOL, MARGIN, K = 1e-5, 1e-3, 2
TOKENS = np.random.default_rng(7).integers(0, 64, (2, 24))
# family -> (the reference step that is the family's own feature, seed with router gaps >= 1e-3
# on TOKENS, the greedy sequence and the training batch)
FAMILIES = {"mixtral": ("topk_norm", 2), "qwen3_moe": ("qk_norm", 0)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (config.json dict, tensors, converted items folder), built once per family."""
    root = tmp_path_factory.mktemp("moe_families")
    built = {}

    def get(family: str):
        if family not in built:
            cfg = hf_config(family)
            tensors = random_tensors(cfg, FAMILIES[family][1])
            hf = write_hf_folder(root / family, cfg, tensors)
            out = root / f"{family}_ckpt"
            assert to_maxtext([BASE, f"hf_model_path={hf}", f"base_output_directory={out}"]) == 0
            built[family] = (cfg, tensors, out / "0" / "items")
        return built[family]

    return get


def reference(cfg, tensors, tokens, skip=()):
    """(float64 logits, router gap) of the reference."""
    router: list = []
    logits = reference_logits(cfg, tensors, tokens, skip=skip, router=router)
    return logits, router_margin(router, K)


@functools.cache
def _forward(config):
    return jax.jit(Decoder(config).apply)


def our_logits(items: Path, tokens: np.ndarray, *keys: str) -> np.ndarray:
    config = load_config([BASE, f"load_parameters_path={items}", *keys])
    params, _ = manager.load_params(items, abstract_params(config), config)
    return np.asarray(_forward(config)({"params": params}, tokens))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_float64_reference(converted, family):
    """Scanned and unrolled layers (one device: the block runs every token on it)."""
    cfg, tensors, items = converted(family)
    want, gap = reference(cfg, tensors, TOKENS)
    assert gap >= MARGIN and np.abs(want).max() > 1.0
    feature = FAMILIES[family][0]
    without, _ = reference(cfg, tensors, TOKENS, skip=(feature,))
    assert np.abs(without - want).max() > 100 * TOL, f"{feature} does not matter here"
    for keys in (["scan_layers=true"], ["scan_layers=false"]):
        got = our_logits(items, TOKENS, *keys)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=" ".join(keys))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_ids_equal_reference(converted, family):
    """Greedy generation with the KV cache and without equals the reference's argmax ids, each
    step's top-1 / top-2 logit gap >= 1e-3 (no near-tie) and every router gap >= 1e-3."""
    cfg, tensors, items = converted(family)
    prompt = [5, 17, 33, 2]
    cached, uncached = greedy_with_and_without_cache(items, prompt, vocab_limit=64)
    ids = np.zeros((1, GREEDY_LENGTH), np.int64)
    ids[0, : len(prompt)] = prompt
    margins = []
    for t in range(len(prompt), GREEDY_LENGTH):
        logits, _ = reference(cfg, tensors, ids[:, :t])
        top2 = np.sort(logits[0, t - 1])[-2:]
        margins.append(top2[1] - top2[0])
        ids[0, t] = int(np.argmax(logits[0, t - 1]))
    assert min(margins) >= 1e-3 and reference(cfg, tensors, ids)[1] >= MARGIN
    assert cached == uncached == ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_is_bitwise_and_config_json_comes_back(converted, tmp_path, family):
    """HF -> ours -> HF: every tensor (each expert's) bitwise, config.json equal to the source;
    the checkpoint alone brings every model key back."""
    cfg, tensors, items = converted(family)
    out = tmp_path / "export"
    assert_float32_export_bitwise(items, out, tensors)  # every tensor bitwise
    assert json.loads((out / "config.json").read_text()) == cfg
    config = load_config([BASE, f"load_parameters_path={items}"])
    from_json = model_keys(cfg)
    assert set(from_json) <= set(MODEL_KEYS) and config.decoder_block == family
    assert {k: getattr(config, k) for k in from_json} == from_json
    assert config.num_experts == 4 and config.num_experts_per_tok == K


@pytest.mark.parametrize(
    "family, field, value, message",
    [
        ("qwen3_moe", "mlp_only_layers", [1], "mlp_only_layers=[1] is not supported: every "
         "layer is a mixture of experts here"),
        ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step=2 is not supported: every "
         "layer is a mixture of experts here"),
        ("mixtral", "router_jitter_noise", 0.1, "router_jitter_noise=0.1 is not supported: "
         "router jitter"),
    ],
)  # fmt: skip
def test_other_models_are_refused_in_one_line(tmp_path, capsys, family, field, value, message):
    """A config.json this model cannot express: exit 2, one line naming the field, nothing
    written (no tensors are read: the config is checked first)."""
    cfg = hf_config(family, **{field: value})
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert to_maxtext([BASE, f"hf_model_path={folder}", f"base_output_directory={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_first_step_loss_at_pp2_ep2_default_keys(converted, tmp_path):
    """One step of train.py from the converted Mixtral at pipeline_parallelism=2 x
    ici_expert_parallelism=2 with the default keys otherwise (scanned layers, 1f1b,
    gradient_reduction auto, checkpointing on): its loss is the reference's on the same batch,
    and its `moe_lb_loss` the load-balancing loss computed here by definition (float64, relative
    1e-5: a product of float32 means of a few hundred terms)."""
    from MaxText.data import make_data
    from MaxText.train import main as train

    cfg, tensors, items = converted("mixtral")
    argv = [
        BASE, f"load_parameters_path={items}", "dataset_type=synthetic", "max_target_length=8",
        "global_batch_size=8", "steps=1", "log_period=1", "eval_interval=0",
        "enable_progress_bar=false", "enable_tensorboard=false", "pipeline_parallelism=2",
        "ici_expert_parallelism=2", f"base_output_directory={tmp_path}", "run_name=ft",
    ]  # fmt: skip
    assert train(argv) == 0
    record = json.loads((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()[0])
    batch = next(make_data(load_config(argv)).train)
    logits, gap = reference(cfg, tensors, np.asarray(batch["inputs"]))
    want = cross_entropy(logits, batch["targets"], batch["targets_mask"])
    assert gap >= MARGIN and record["step"] == 1
    assert abs(record["loss"] - want) <= TOL, (record["loss"], want)
    config = load_config(argv)
    lb = load_balance_reference(cfg, tensors, np.asarray(batch["inputs"]),
                                config.num_pipeline_microbatches)  # fmt: skip
    assert abs(record["moe_lb_loss"] - lb) <= TOL * lb, (record["moe_lb_loss"], lb)


def load_balance_reference(cfg, tensors, inputs, microbatches: int) -> float:
    """The load-balancing loss by its definition, computed here: per microbatch (the trainer's
    split: microbatch i holds rows i, M + i, 2M + i, ...), Hugging Face's Mixtral
    `load_balancing_loss_func` over every layer's router probabilities pooled (concatenated):
    E * sum_e f_e P_e, f_e the share of token-slots routed to e (the f_e sum to k) and P_e the
    mean probability of e; then the mean over the microbatches."""
    losses = []
    for i in range(microbatches):
        router: list = []
        reference_logits(cfg, tensors, inputs[i::microbatches], router=router)
        pooled = np.concatenate(router)  # [layers x tokens, E]
        ids = np.argsort(-pooled, axis=-1, kind="stable")[:, :K]
        f = np.bincount(ids.reshape(-1), minlength=pooled.shape[1]) / len(pooled)
        losses.append(pooled.shape[1] * np.sum(f * pooled.mean(axis=0)))
    return float(np.mean(losses))


# Published sizes, at the precision each publisher states them: Mistral AI's announcements
# ("Mixtral of experts": 46.7B total, 12.9B used per token; "Cheaper, Better, Faster, Stronger":
# 141B, 39B active) and the Qwen3 model cards ("30.5B in total and 3.3B activated", "235B in total
# and 22B activated").
PUBLISHED_SIZES = {
    "mixtral-8x7b": (46.7, 12.9, 1),
    "mixtral-8x22b": (141, 39, 0),
    "qwen3-30b-a3b": (30.5, 3.3, 1),
    "qwen3-235b-a22b": (235, 22, 0),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_SIZES))
def test_planner_parameter_counts_are_the_published_ones(preset):
    """The planner's total and active parameters of each MoE preset (from the model's abstract
    shapes, nothing allocated; active = total less the (E - k) idle experts of every layer) are
    within one unit of the last digit the publisher states (publishers round or truncate: Qwen's
    "3.3B" is our 3.35B)."""
    from MaxText.planning import moe_costs

    total, active = moe_costs.param_counts(load_config([BASE, f"model_name={preset}"]))
    want_total, want_active, digits = PUBLISHED_SIZES[preset]
    unit = 10.0**-digits
    assert abs(total / 1e9 - want_total) < unit, total
    assert abs(active / 1e9 - want_active) < unit, active
