"""Attention masks and kernels: packed rows (segment ids) against each document alone."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compare import assert_bitwise, assert_close_per_leaf, reordered_sum_rtol

from MaxText.config import CONFIGS_DIR, load_config
from MaxText.model import Decoder, attention
from MaxText.train_step import CPU_INIT_COMPILER_OPTIONS

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
    args = (jax.random.key(1), jnp.zeros((1, config.max_target_length), jnp.int32))
    init = jax.jit(model.init).lower(*args).compile(compiler_options=CPU_INIT_COMPILER_OPTIONS)
    return model, nn.unbox(init(*args)["params"])


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
    summation order); per document within the bound for two sums in a row (the softmax's
    normalizer, then the weighted values) over at most the row's 16 keys in another order
    (`reordered_sum_rtol`, tests/compare.py), of its own logit scale."""
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
        rtol = 2 * reordered_sum_rtol(config.max_target_length, squared=False)
        assert_close_per_leaf(alone, packed[start : start + len(doc)], rtol=rtol)
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


# ------------------------------------------------------------------------------ kernels


def _qkv_and_segments(b=2, length=13, h=4, k=2, d=8):
    rng = np.random.default_rng(0)
    q, key, v = (jnp.asarray(rng.normal(size=(b, length, n, d)), jnp.float32) for n in (h, k, k))
    segments = jnp.asarray([[1] * 5 + [2] * 6 + [0] * 2, [3] * length])
    return q, key, v, segments


KERNEL_CASES = {
    "autoselected": ("autoselected", 512),
    "chunked-block4": ("chunked", 4),  # 13 keys: blocks of 4, the last one padded
    "chunked-block16": ("chunked", 16),  # one block larger than the sequence
}


@pytest.mark.parametrize("segmented", [False, True], ids=["causal", "segments"])
@pytest.mark.parametrize("name,block", KERNEL_CASES.values(), ids=KERNEL_CASES.keys())
def test_kernel_equals_dot_product_forward_and_gradients(name, block, segmented):
    """Every kernel against the einsum reference (GQA: 4 query heads on 2 kv heads), output and
    the gradients of q, k, v. Not bitwise: other summation orders (online softmax, XLA's
    attention); within the bound for two sums in a row (the softmax's normalizer, then the
    weighted values or, backward, the sums over keys and queries) over the 13 positions in
    another order (`reordered_sum_rtol`, tests/compare.py) of each leaf's scale."""
    q, k, v, segments = _qkv_and_segments()
    segments = segments if segmented else None
    ref, ref_grads = _kernel_outputs("dot_product", 512, segmented)
    got, got_grads = _kernel_outputs(name, block, segmented)
    rtol = 2 * reordered_sum_rtol(q.shape[1], squared=False)
    assert_close_per_leaf(ref, got, rtol=rtol)
    assert_close_per_leaf(ref_grads, got_grads, rtol=rtol)


@functools.cache
def _kernel_outputs(name: str, block: int, segmented: bool):
    """A kernel's output and the gradients of q, k, v of sum(sin(output)) on
    `_qkv_and_segments` (with its segments or causal only), once per module (dot_product's are
    every kernel case's reference)."""
    q, k, v, segments = _qkv_and_segments()
    segments = segments if segmented else None
    kernel = attention.kernel_for(name, block)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(kernel(q, k, v, segments)))

    out = jax.jit(kernel)(q, k, v, segments)
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _grad_temp_bytes(name: str, length: int) -> int:
    kernel = attention.kernel_for(name, 64)
    grad = jax.grad(lambda q, k, v: jnp.sum(kernel(q, k, v) ** 2), argnums=(0, 1, 2))
    q = jax.ShapeDtypeStruct((1, length, 4, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 2, 32), jnp.float32)
    return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def test_chunked_memory_grows_linearly():
    """XLA's temporary memory for forward + backward: the [L, L] scores of dot_product (4 heads x
    L^2 float32 = 16 MiB at L = 1024, more for probabilities and their gradient) against blocks of
    64 keys. Doubling L quadruples dot_product's and at most doubles chunked's (plus slack)."""
    dot = [_grad_temp_bytes("dot_product", n) for n in (512, 1024)]
    chunk = [_grad_temp_bytes("chunked", n) for n in (512, 1024)]
    assert dot[1] >= 4 * 1024 * 1024 * 4  # at least one [H, L, L] float32 array
    assert dot[1] > 3.5 * dot[0]
    assert chunk[1] < 2.2 * chunk[0]
    assert chunk[1] < dot[1] / 4


def test_model_with_chunked_attention_equals_dot_product():
    """The kernel is wired into the decoder: attention=chunked (blocks of 4 over 16 tokens)
    gives dot_product's logits and parameter gradients on a packed batch per leaf within the
    bound for sums over the batch's 2 x 16 tokens in another order, two in a row (online softmax
    sums in another order; `reordered_sum_rtol`, tests/compare.py)."""
    ref_config = small_config()
    model, params = _model_and_params(ref_config)
    chunked_model = Decoder(small_config("attention=chunked", "attention_block_size=4"))
    rng = np.random.default_rng(5)
    length = ref_config.max_target_length
    tokens = rng.integers(0, ref_config.vocab_size, (2, length))
    segments = np.repeat([1, 2], length // 2)[None].repeat(2, 0)
    positions = np.tile(np.arange(length // 2), 2)[None].repeat(2, 0)

    def loss(m):
        def f(p):
            logits = m.apply({"params": p}, tokens, positions, segments)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 0])

        return jax.jit(jax.value_and_grad(f))

    rtol = 2 * reordered_sum_rtol(2 * length, squared=False)
    assert_close_per_leaf(loss(model)(params), loss(chunked_model)(params), rtol=rtol)


def test_cudnn_flash_needs_a_gpu(capsys):
    """On this CPU host attention=cudnn_flash is a config error: exit code 2 and one line."""
    from MaxText.train import main

    keys = [*SMALL, "attention=cudnn_flash", "dtype=bfloat16", "steps=1"]  # float32: see
    code = main([str(CONFIGS_DIR / "base.yml"), *keys])  # tests/test_gpu_defaults.py
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        "config error: attention=cudnn_flash needs a GPU (cuDNN) but this host runs on CPU; "
        "use attention=autoselected, dot_product or chunked"
    ]


def test_attention_keys_validated():
    from MaxText.config import ConfigError

    with pytest.raises(ConfigError, match="attention=flash is not one of dot_product"):
        small_config("attention=flash")
    with pytest.raises(ConfigError, match="attention_block_size=0: must be >= 1"):
        small_config("attention_block_size=0")


@pytest.mark.slow
def test_chunked_under_sharding_and_pipelining():
    """attention=chunked (scan + custom VJP) inside a sharded step (fsdp 2 x tensor 2) and a
    pipelined one (2 groups): one training step gives the one-device loss and gradient norm,
    same 4 microbatches. Not bitwise: sharded reductions sum the step's SMALL_MODEL_TOKENS
    tokens in another order, the norm's squares included (`reordered_sum_rtol`,
    tests/compare.py)."""
    from small_model import SMALL_MODEL, SMALL_MODEL_TOKENS, merged

    from MaxText import sharding
    from MaxText.cluster import devices
    from MaxText.train_step import build_trainer

    def one_step(*overrides):
        config = load_config(
            merged(
                str(CONFIGS_DIR / "base.yml"),
                *SMALL_MODEL,
                "num_decoder_layers=2",
                "attention=chunked",
                "attention_block_size=4",
                "num_pipeline_microbatches=4",
                *overrides,
            )
        )
        trainer = build_trainer(
            config, sharding.make_mesh(config, devices.setup(**config.device_args()))
        )
        rng = np.random.default_rng(0)
        shape = (config.global_batch_size, config.max_target_length)
        batch = {
            "inputs": rng.integers(0, config.vocab_size, shape),
            "targets": rng.integers(0, config.vocab_size, shape),
            "targets_mask": np.ones(shape, np.float32),
        }
        _, metrics = trainer.train_step(trainer.init_state(), trainer.put_batch(batch))
        return {k: np.asarray(metrics[k]) for k in ("loss", "grad_norm")}

    reference, rtol = one_step(), reordered_sum_rtol(SMALL_MODEL_TOKENS)
    assert_close_per_leaf(
        reference, one_step("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"), rtol
    )
    assert_close_per_leaf(reference, one_step("pipeline_parallelism=2"), rtol)
