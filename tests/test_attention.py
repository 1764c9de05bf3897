"""Attention masks and kernels: packed rows (segment ids) against each document alone."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compare import assert_bitwise, assert_close_per_leaf

from MaxText import attention
from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder

SMALL = [
    "emb_dim=32",
    "num_query_heads=4",
    "num_kv_heads=2",
    "head_dim=8",
    "mlp_dim=64",
    "num_decoder_layers=2",
    "vocab_size=64",
    "max_target_length=16",
]


@functools.cache
def small_config(*overrides: str):
    return load_config([str(CONFIGS_DIR / "base.yml"), *SMALL, *overrides])


@functools.cache
def _model_and_params(config):
    model = Decoder(config)
    x = jnp.zeros((1, config.max_target_length), jnp.int32)
    return model, nn.unbox(jax.jit(model.init)(jax.random.key(1), x)["params"])


def test_mask_by_hand():
    """Causal and same segment; padding (0) sees only padding, so no row is empty."""
    mask = np.asarray(attention.attention_mask(5, jnp.asarray([[1, 1, 2, 2, 0]])))[0]
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(np.asarray(attention.attention_mask(3)), np.tril(np.ones((3, 3))))


PACKED_CASES = {
    "llama": (),
    "gpt": ("decoder_block=gpt",),
    "scanned-remat": ("scan_layers=true", "remat_policy=full"),
}


@pytest.mark.parametrize("overrides", PACKED_CASES.values(), ids=PACKED_CASES.keys())
def test_packed_row_equals_documents_alone(overrides):
    """A row packing two documents (then padding) gives each document the logits it has alone.

    Not bitwise: alone, the softmax and matmul reductions run over a shorter length (other
    summation order); within 1e-5 of each document's own logit scale."""
    config = small_config(*overrides)
    model, params = _model_and_params(config)
    rng = np.random.default_rng(0)
    lengths = (6, 7)  # 6 + 7 tokens, then 3 padding
    docs = [rng.integers(1, config.vocab_size, n) for n in lengths]
    length = config.max_target_length
    pad = length - sum(lengths)
    tokens = np.concatenate([*docs, np.zeros(pad, int)])[None]
    positions = np.concatenate([np.arange(n) for n in (*lengths, pad)])[None]
    segments = np.concatenate([np.full(n, s) for s, n in zip((1, 2, 0), (*lengths, pad))])[None]
    apply = jax.jit(model.apply)
    packed = np.asarray(apply({"params": params}, tokens, positions, segments))[0]

    start = 0
    for doc in docs:
        alone = np.asarray(apply({"params": params}, doc[None]))[0]
        assert_close_per_leaf(alone, packed[start : start + len(doc)], rtol=1e-5)
        start += len(doc)
    # the same row without segment ids mixes the documents: the second one's logits change
    mixed = np.asarray(apply({"params": params}, tokens, positions))[0]
    assert np.abs(mixed[6:13] - packed[6:13]).max() > 1e-3


def test_one_segment_is_the_causal_mask_bitwise():
    """Segment ids all 1 mask exactly what no segment ids mask: the same bits out."""
    config = small_config()
    model, params = _model_and_params(config)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (2, config.max_target_length))
    apply = jax.jit(model.apply)
    assert_bitwise(
        apply({"params": params}, tokens),
        apply({"params": params}, tokens, None, np.ones_like(tokens)),
    )
