"""The analytic TFLOPs formula against hand computations, the peak table and MFU."""

from __future__ import annotations

import pytest

from MaxText.config import CONFIGS_DIR, load_config
from MaxText.planning import flops
from MaxText.planning.hardware import HARDWARE, cpu_hardware


def load(*overrides):
    return load_config([str(CONFIGS_DIR / "base.yml"), *overrides])


def test_llama2_7b_by_hand():
    """llama2-7b, one sequence of 4096 tokens on one device.

    Learnable-weight FLOPs are 6 x tokens x (matmul parameters): per layer 3·E·M (SwiGLU) + 4·E²
    (q, k, v, o with H = K, H·D = E) = 3·4096·11008 + 4·4096² = 202,375,168; times 32 layers plus
    the unembedding E·V = 131,072,000 gives 6,607,077,376; x 6 x 4096 = 162.376 TFLOP.
    Causal attention: 3 x 32 layers x (4·T·S·H·D / 2) = 3·32·2·4096·4096·4096 = 13.194 TFLOP.
    """
    c = load("model_name=llama2-7b", "per_device_batch_size=1", "max_target_length=4096")
    f = flops.training_flops_per_step(c)
    assert f.weights == 6 * 4096 * 6_607_077_376
    assert f.attention == 3 * 32 * 2 * 4096**3
    assert round(f.weights / 1e12, 3) == 162.376
    assert round(f.attention / 1e12, 3) == 13.194
    # the hand count above, rounded to the 3 decimals written here
    assert f.total / c.num_devices / 1e12 == pytest.approx(175.570, abs=1e-3)


def test_gpt_block_and_gqa_terms():
    """gpt: one input matrix in the MLP; GQA: k and v projections shrink with num_kv_heads."""
    c = load(
        "decoder_block=gpt",
        "emb_dim=64",
        "num_query_heads=4",
        "num_kv_heads=4",
        "head_dim=16",
        "mlp_dim=256",
        "num_decoder_layers=2",
        "vocab_size=100",
        "max_target_length=8",
        "global_batch_size=2",
    )
    t = 2 * 8
    ffn = 2 * t * 64 * 256 * 2  # in + out
    qkv = 2 * t * 64 * (4 + 8) * 16
    proj = 2 * t * 64 * 64
    unembed = 2 * t * 64 * 100
    attention = 4 * t * 8 * 4 * 16 / 2
    f = flops.training_flops_per_step(c)
    assert f.weights == 3 * ((ffn + qkv + proj) * 2 + unembed)
    assert f.attention == 3 * attention * 2
    gqa = flops.training_flops_per_step(load(*[], "num_kv_heads=1", "num_query_heads=4"))
    mha = flops.training_flops_per_step(load("num_kv_heads=4", "num_query_heads=4"))
    assert gqa.weights < mha.weights and gqa.attention == mha.attention


def test_step_flops_count_the_global_batch_whatever_the_devices():
    one = load("global_batch_size=8")
    four = load("global_batch_size=8", "ici_data_parallelism=4")
    assert four.num_devices == 4 * one.num_devices
    assert flops.training_flops_per_step(one) == flops.training_flops_per_step(four)


def test_peak_table_override_and_cpu_estimate():
    bf16 = load("dtype=bfloat16")
    f32 = load()
    assert flops.peak_tflops(bf16, "gpu", "NVIDIA A100-SXM4-80GB").tflops == 312.0
    assert flops.peak_tflops(f32, "gpu", "NVIDIA A100-SXM4-80GB").tflops == 156.0  # tf32
    assert flops.peak_tflops(bf16, "gpu", "NVIDIA H100 80GB HBM3").tflops == 989.0
    assert flops.peak_tflops(bf16, "gpu", "NVIDIA H100 PCIe").tflops == 756.0
    assert flops.peak_tflops(bf16, "gpu", "NVIDIA A10G").tflops == 70.0
    assert flops.peak_tflops(bf16, "gpu", "NVIDIA L40S").tflops == 362.0
    unknown = flops.peak_tflops(bf16, "gpu", "Mystery 9000")
    assert unknown.tflops == 0.0 and unknown.estimate and "peak_tflops_per_device" in unknown.source
    override = flops.peak_tflops(load("peak_tflops_per_device=100"), "gpu", "Mystery 9000")
    assert override.tflops == 100.0 and not override.estimate
    cpu = flops.peak_tflops(load("ici_data_parallelism=2"), "cpu", "cpu")
    assert cpu.estimate and cpu.tflops > 0 and "CPU estimate" in cpu.source
    assert flops.mfu(50.0, override) == 0.5 and flops.mfu(1.0, unknown) == 0.0


def test_the_planner_reads_the_same_peaks():
    """One table of GPU peaks and one CPU estimate: the planner's presets and this host's
    hardware carry the figures the trainer's MFU divides by."""
    bf16 = load("dtype=bfloat16")
    assert HARDWARE["h100"].peak_tflops == flops.peak_tflops(bf16, "gpu", "H100 SXM").tflops
    assert HARDWARE["h200"].peak_tflops == flops.peak_tflops(bf16, "gpu", "H200").tflops
    assert HARDWARE["a100"].peak_tflops == flops.peak_tflops(bf16, "gpu", "A100-SXM4").tflops
    two = load("ici_data_parallelism=2")
    assert cpu_hardware(2).peak_tflops == flops.peak_tflops(two, "cpu", "cpu").tflops
