"""Checks shared by the tests of converted Hugging Face checkpoints (tests/test_hf_checkpoints.py,
tests/test_family_models.py, tests/test_moe_families.py): a float32 export compared tensor by
tensor, bit for bit, with the tensors it was converted from, and greedy generation from a
converted checkpoint with the KV cache and without."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from MaxText.config import CONFIGS_DIR, load_config

BASE = str(CONFIGS_DIR / "base.yml")
GREEDY_LENGTH = 20  # prompt and generated tokens together (max_predict_length)


def assert_float32_export_bitwise(items: Path, out: Path, tensors: dict[str, np.ndarray]) -> None:
    """Exports the checkpoint `items` to `out` with hf_output_dtype=float32 (`to_huggingface`)
    and asserts that model.safetensors holds exactly `tensors`' names, each with its dtype, shape
    and bit pattern."""
    from safetensors.numpy import load_file

    from MaxText.to_huggingface import main as to_huggingface

    argv = [BASE, f"load_parameters_path={items}", f"hf_output_path={out}"]
    assert to_huggingface([*argv, "hf_output_dtype=float32"]) == 0
    got = load_file(str(Path(out) / "model.safetensors"))
    assert sorted(got) == sorted(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint32), want.view(np.uint32))


def greedy_with_and_without_cache(items: Path, prompt: list[int], vocab_limit: int):
    """(ids generated with the KV cache, ids generated without) greedily from the checkpoint
    `items` after `prompt`, up to `GREEDY_LENGTH` tokens in all (prefill of 8, unrolled
    layers)."""
    from MaxText.checkpoint import manager
    from MaxText.generate import abstract_params, sample_tokens

    keys = ["max_prefill_predict_length=8", f"max_predict_length={GREEDY_LENGTH}",
            "scan_layers=false"]  # fmt: skip
    config = load_config([BASE, f"load_parameters_path={items}", *keys])
    params, _ = manager.load_params(items, abstract_params(config), config)
    cached = sample_tokens(config, params, prompt, vocab_limit=vocab_limit)
    uncached = sample_tokens(config, params, prompt, vocab_limit=vocab_limit, kv_cache=False)
    return cached, uncached
