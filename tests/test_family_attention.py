"""The attention options the families add (sliding window, soft cap, scale) in every kernel,
against a mask written here and against `dot_product`; the KV cache's window; the memory of
chunked attention with them; the kernels that cannot soft-cap refuse it in one line."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compare import assert_close_per_leaf

from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.model import attention
from MaxText.model.attention import AttentionOptions

W = 4  # window: 4 keys, the query included
GEMMA_LIKE = AttentionOptions(window=W, soft_cap=2.0, scale=0.3)  # a cap small enough to matter


def _qkv_and_segments(b=2, length=13, h=4, k=2, d=8):
    rng = np.random.default_rng(0)
    q, key, v = (jnp.asarray(rng.normal(size=(b, length, n, d)), jnp.float32) for n in (h, k, k))
    segments = jnp.asarray([[1] * 5 + [2] * 6 + [0] * 2, [3] * length])
    return q, key, v, segments


def _reference(q, k, v, segments, options: AttentionOptions) -> np.ndarray:
    """float64 attention with the mask written out: key j visible to query i iff j <= i,
    i - j < W (when W > 0) and same segment; scores s * scale, then c tanh(s / c)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, length, h, d = q.shape
    k, v = np.repeat(k, h // k.shape[2], axis=2), np.repeat(v, h // v.shape[2], axis=2)
    s = np.einsum("blhd,bmhd->bhlm", q, k) * options.scale_for(d)
    if options.soft_cap:
        s = options.soft_cap * np.tanh(s / options.soft_cap)
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (j <= i) & ((i - j < options.window) if options.window else True)
    seg = np.asarray(segments)
    visible = visible[None] & (seg[:, :, None] == seg[:, None, :])
    s = np.where(visible[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhlm,bmhd->blhd", p, v)


def test_mask_by_hand_with_a_window():
    """Query i sees keys i-3..i (W = 4 keys including itself), causal; window 0 is causal only;
    a traced window gives the same mask."""
    got = np.asarray(attention.attention_mask(6, window=W))
    want = np.array([[int(0 <= i - j < W) for j in range(6)] for i in range(6)], bool)
    np.testing.assert_array_equal(got, want)
    assert got.sum(1).tolist() == [1, 2, 3, 4, 4, 4]
    np.testing.assert_array_equal(np.asarray(attention.attention_mask(6, window=0)), np.tril(
        np.ones((6, 6), bool)))  # fmt: skip
    traced = jax.jit(lambda w: attention.attention_mask(6, window=w))
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(W))), want)
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(0))), np.tril(np.ones((6, 6))))


@pytest.mark.parametrize("traced", [False, True], ids=["static-window", "traced-window"])
def test_dot_product_equals_the_written_out_reference(traced):
    """window + soft cap + scale, GQA, packed segments: within 1e-6 of the output's scale
    (float32 against float64 over 13 keys of dimension 8: ~1e-7 rounding)."""
    q, k, v, segments = _qkv_and_segments()
    want = _reference(q, k, v, segments, GEMMA_LIKE)

    def run(window):
        options = AttentionOptions(window=window, soft_cap=2.0, scale=0.3, windows=(0, W))
        return attention.dot_product(q, k, v, segments, options)

    got = jax.jit(run)(jnp.int32(W)) if traced else jax.jit(lambda: run(W))()
    assert_close_per_leaf(want, got, rtol=1e-6)
    no_window = _reference(q, k, v, segments, AttentionOptions(soft_cap=2.0, scale=0.3))
    assert np.abs(no_window - want).max() > 1e-2  # the window changes this output
    no_cap = _reference(q, k, v, segments, AttentionOptions(window=W, scale=0.3))
    assert np.abs(no_cap - want).max() > 1e-2  # and so does the cap


@pytest.mark.parametrize("block", [4, 16], ids=["block4", "block16"])
@pytest.mark.parametrize("traced", [False, True], ids=["static-window", "traced-window"])
def test_chunked_equals_dot_product_with_window_and_soft_cap(block, traced):
    """Output and the gradients of q, k, v of `chunked` (window and cap applied per block, the
    cap's tanh derivative in the custom VJP) against dot_product's, within 1e-6 of each leaf's
    scale (same float32 terms summed in another order by the online softmax: ~1e-7)."""
    q, k, v, segments = _qkv_and_segments()

    def loss(kernel, window):
        options = AttentionOptions(window=window, soft_cap=2.0, scale=0.3, windows=(0, W))

        def f(q, k, v):
            return jnp.sum(jnp.sin(kernel(q, k, v, segments, options=options)))

        return f

    chunked = attention.kernel_for("chunked", block)
    if traced:
        run = jax.jit(lambda q, k, v, w: jax.value_and_grad(loss(chunked, w), argnums=(0, 1, 2))(
            q, k, v))  # fmt: skip
        got = run(q, k, v, jnp.int32(W))
    else:
        got = jax.jit(jax.value_and_grad(loss(chunked, W), argnums=(0, 1, 2)))(q, k, v)
    assert_close_per_leaf(_dot_product_value_and_grads(), got, rtol=1e-6)


@functools.cache
def _dot_product_value_and_grads():
    q, k, v, segments = _qkv_and_segments()

    def f(q, k, v):
        return jnp.sum(jnp.sin(attention.dot_product(q, k, v, segments, GEMMA_LIKE)))

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)


def test_autoselected_window_is_local_window_size_w_minus_1():
    """jax.nn.dot_product_attention with local_window_size=(W - 1, 0) is our window of W keys
    (its XLA path on CPU; cuDNN takes the same argument): equal to dot_product within 1e-6, for a
    static and a traced window (lax.switch over the model's window sizes)."""
    q, k, v, _ = _qkv_and_segments()
    kernel = attention.kernel_for("autoselected")
    traced = jax.jit(lambda w: kernel(q, k, v, None, options=AttentionOptions(
        window=w, scale=0.3, windows=(0, W))))  # fmt: skip
    for window in (W, 0):
        options = AttentionOptions(window=window, scale=0.3)
        want = jax.jit(lambda o=options: attention.dot_product(q, k, v, None, o))()
        got = jax.jit(lambda o=options: kernel(q, k, v, None, options=o))()
        assert_close_per_leaf(want, got, rtol=1e-6)
        assert_close_per_leaf(want, traced(jnp.int32(window)), rtol=1e-6)
    with pytest.raises(ValueError, match="cannot soft-cap"):
        kernel(q, k, v, None, options=GEMMA_LIKE)


def test_cached_attention_masks_keys_older_than_the_window():
    """Decoding at position p against a cache of 10 slots: with W = 4 only slots p-3..p count;
    changing the older slots (or the unwritten later ones) leaves the output as it is, changing
    a slot inside the window does not."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, 4, 8)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(1, 10, 2, 8)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(1, 10, 2, 8)), jnp.float32)
    p = 6
    options = AttentionOptions(window=W)

    run = jax.jit(lambda k, v: attention.cached_dot_product(q, k, v, jnp.asarray([[p]]), options))

    def out(k, v):
        return np.asarray(run(k, v))

    base = out(keys, values)
    moved = np.zeros((1, 10, 1, 1), np.float32)
    moved[0, [0, 1, 2, 7, 9]] = 5.0  # older than p - 3, or after p
    np.testing.assert_array_equal(out(keys + moved, values + moved), base)
    inside = np.zeros_like(moved)
    inside[0, p - W + 1] = 5.0  # the oldest key still in the window
    assert np.abs(out(keys, values + inside) - base).max() > 1e-2
    # the same query over the window's keys alone, as a fresh prefill, gives the same output
    alone = jax.jit(attention.dot_product)(
        jnp.concatenate([jnp.zeros((1, W - 1, 4, 8)), q], axis=1),
        keys[:, p - W + 1 : p + 1], values[:, p - W + 1 : p + 1],
    )[:, -1:]  # fmt: skip
    assert_close_per_leaf(np.asarray(alone), base, rtol=1e-6)


def _grad_temp_bytes(name: str, length: int, options: AttentionOptions) -> int:
    kernel = attention.kernel_for(name, 64)
    grad = jax.grad(
        lambda q, k, v: jnp.sum(kernel(q, k, v, None, options=options) ** 2), argnums=(0, 1, 2)
    )
    q = jax.ShapeDtypeStruct((1, length, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 2, 32), jnp.float32)
    return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_with_window_and_soft_cap_grows_linearly():
    """XLA's temporaries for forward + backward with a window of 64 and a soft cap: chunked's at
    most double when L doubles (blocks of 64 keys; no [L, L] mask is ever built) and stay under a
    quarter of dot_product's, which holds at least one [H, L, L] float32 array (its quadratic
    growth: tests/test_attention.py::test_chunked_memory_grows_linearly)."""
    options = AttentionOptions(window=64, soft_cap=50.0)
    chunk = [_grad_temp_bytes("chunked", n, options) for n in (256, 512)]
    dot = _grad_temp_bytes("dot_product", 512, options)
    assert dot >= 4 * 512 * 512 * 4
    assert chunk[1] < 2.2 * chunk[0]
    assert chunk[1] < dot / 4


def test_kernels_that_cannot_soft_cap_are_refused_at_load():
    base = str(CONFIGS_DIR / "base.yml")
    for kernel in ("cudnn_flash", "autoselected"):
        with pytest.raises(ConfigError, match=f"attention={kernel} cannot soft-cap"):
            load_config([base, f"attention={kernel}", "dtype=bfloat16", "attn_logits_soft_cap=50"])
    load_config([base, "attention=chunked", "attn_logits_soft_cap=50"])  # accepted
