"""The families as data: the registry, each family's Hugging Face tables, and the presets against
their published config.json files (no model is run here: shapes come from abstract
initialisation, so these tests are cheap)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from MaxText.config import CONFIGS_DIR, DECODER_BLOCKS, load_config
from MaxText.config.checkpoint_keys import MODEL_KEYS
from MaxText.convert.hf_config import model_keys
from MaxText.convert.layout import LAYOUTS, tensors_for
from MaxText.model import FAMILIES, family_for_architecture

BASE = str(CONFIGS_DIR / "base.yml")
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf_configs"
# preset -> its published config.json (tests/fixtures/hf_configs/README.md names the sources)
PRESETS = sorted(p.stem for p in FIXTURES.glob("*.json"))


def test_the_registry_and_the_config_name_the_same_families():
    assert set(FAMILIES) == set(DECODER_BLOCKS)
    for name, family in FAMILIES.items():
        assert family.name == name
        if family.hf is not None:
            assert family_for_architecture(family.hf.architecture) is family
            assert {r.layout for r in family.hf.tensors} <= set(LAYOUTS)
            assert set(family.hf.fixed) <= set(MODEL_KEYS)


def token(value) -> str:
    """A key's value as the command line writes it."""
    if isinstance(value, tuple):
        return f"[{', '.join(value)}]"
    return str(value).lower()


SMALL = ["num_decoder_layers=3", "emb_dim=32", "num_query_heads=4", "num_kv_heads=2",
         "head_dim=16", "mlp_dim=48", "vocab_size=64"]  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", [f for f in sorted(FAMILIES) if FAMILIES[f].hf is not None])
def test_every_parameter_has_exactly_one_row(family, tied):
    """`tensors_for` fails on a parameter without a row; here also: names are unique, each
    layer's tensors are named with its index, and the tied head has no tensor."""
    fixed = [f"{k}={token(v)}" for k, v in FAMILIES[family].hf.fixed.items()]
    config = load_config([BASE, f"decoder_block={family}", *SMALL, *fixed,
                          f"logits_via_embedding={str(tied).lower()}"])  # fmt: skip
    tensors = tensors_for(config)
    names = [t.hf_name for t in tensors]
    assert len(set(names)) == len(names)
    assert ("lm_head.weight" in names) is not tied
    for t in tensors:
        if t.path[0].startswith("layers_"):
            assert f"model.layers.{t.path[0].split('_')[1]}." in t.hf_name


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_equals_its_published_config(preset):
    published = json.loads((FIXTURES / f"{preset}.json").read_text())
    keys = model_keys(published, where=f"{preset}.json")
    config = load_config([BASE, f"model_name={preset}"])
    assert config.decoder_block == keys["decoder_block"]
    differ = {k: (getattr(config, k), v) for k, v in keys.items() if getattr(config, k) != v}
    assert differ == {}


def test_planner_flops_count_local_layers_for_their_window():
    """Gemma 2, 3 layers, S = 16, W = 4: layers 0 and 2 attend S·W − W²/2 = 56 (query, key)
    pairs per row, layer 1 S²/2 = 128, so attention = 3 (fwd + bwd) · 4·T·H·D · 240 / S; the
    same model without a window counts 3 · 128. The gated MLP counts two input kernels."""
    from MaxText.planning import flops

    keys = ["decoder_block=gemma2", *SMALL, "max_target_length=16", "global_batch_size=2",
            "mlp_activations=[gelu, linear]"]  # fmt: skip
    t, h, d, s = 2 * 16, 4, 16, 16
    local = flops.training_flops_per_step(load_config([BASE, *keys, "sliding_window_size=4"]))
    assert local.attention == 3 * 4 * t * h * d * (56 + 128 + 56) / s
    plain = flops.training_flops_per_step(load_config([BASE, *keys]))
    assert plain.attention == 3 * 4 * t * h * d * (3 * 128) / s
    ffn = 2 * t * 32 * 48 * 2 + 2 * t * 48 * 32  # gate and up in, down out
    qkv, out, unembed = 2 * t * 32 * (4 + 4) * 16, 2 * t * 64 * 32, 2 * t * 32 * 64
    assert local.weights == 3 * ((ffn + qkv + out) * 3 + unembed)
