"""Hugging Face Llama checkpoints in and out, against an implementation nobody here wrote.

The reference (tests/hf_reference.py) is transformers 4.47.1's `FlaxLlamaForCausalLM` (RoPE base
10000 only) and, for other RoPE bases and Llama 3 scaling, a float64 numpy forward pass of the
published formulas, itself checked against the Flax model at base 10000. Hugging Face folders are
written with the `safetensors` package from PyTorch-named `[out, in]` tensors, converted with
`MaxText.to_maxtext` and loaded through `load_parameters_path` like a user would.

Tolerances: our model computes in float32 (RoPE angles in float32 too), the references in
float32 (Flax) or float64; measured differences are ~2-3e-6 on logits of magnitude ~3-5, and the
issue's bound 1e-5 per element is asserted. A transposed projection or a RoPE layout error moves
logits by O(1).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_reference import (
    cross_entropy,
    default_inv_freq,
    flax_logits,
    llama3_inv_freq,
    llama_config,
    random_tensors,
    reference_logits,
    write_hf_folder,
)
from hf_round_trip import greedy_with_and_without_cache

from MaxText.checkpoint import manager
from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.generate import abstract_params
from MaxText.model import Decoder
from MaxText.model.rope import rope_frequencies
from MaxText.to_huggingface import main as to_huggingface
from MaxText.to_maxtext import main as to_maxtext

BASE = str(CONFIGS_DIR / "base.yml")
# Logits and losses (of order 1) of float32 forward passes compared with each other or with a
# float64 reference: each value ends a chain of ~10 dot products (2 layers) of at most 112 terms
# (mlp_dim). A dot product's rounding errors add like a random walk, ~sqrt(n) ulps of its terms'
# magnitude (Higham, "Accuracy and Stability of Numerical Algorithms", section 4.2: ~11 here),
# ~35 ulps over 10 of them: 1e-5 absolute is 84 ulps at 1.0.
TOL = 1e-5
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def convert(hf_dir: Path, out: Path, *extra: str) -> Path:
    argv = [BASE, f"hf_model_path={hf_dir}", f"base_output_directory={out}", *extra]
    assert to_maxtext(argv) == 0
    return out / "0" / "items"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (LlamaConfig, tensors, converted items folder). GQA everywhere (2 kv heads for
    4 query heads); `untied`, `tied`; `theta` (rope_theta 50000); `llama3` (Llama 3 scaling,
    tied, stored in bfloat16, converted to float32)."""
    base = tmp_path_factory.mktemp("hf")
    out = {}
    variants = {
        "untied": (llama_config(), np.float32, 2),
        "tied": (llama_config(tie_word_embeddings=True), np.float32, 1),
        "theta": (llama_config(rope_theta=50000.0), np.float32, 1),
        "llama3": (llama_config(rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True), None, 1),
    }
    for i, (name, (cfg, dtype, shards)) in enumerate(variants.items()):
        tensors = random_tensors(cfg, seed=i)
        if dtype is None:  # stored in bfloat16: the reference sees the rounded values
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
            tensors = {k: v.astype(dtype).astype(np.float32) for k, v in tensors.items()}
        write_hf_folder(base / name, cfg, tensors, dtype=dtype, shards=shards)
        out[name] = (cfg, tensors, convert(base / name, base / f"{name}_ckpt"))
    return out


def our_logits(items: Path, tokens: np.ndarray, *keys: str) -> np.ndarray:
    config = load_config([BASE, f"load_parameters_path={items}", *keys])
    params, _ = manager.load_params(items, abstract_params(config), config)
    return np.asarray(Decoder(config).apply({"params": params}, tokens))


TOKENS = np.random.default_rng(7).integers(0, 96, (2, 24))


@pytest.mark.parametrize("scan", ["true", "false"])
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_logits_equal_flax_reference(models, name, scan):
    cfg, tensors, items = models[name]
    want = flax_logits(cfg, tensors, TOKENS)
    got = our_logits(items, TOKENS, f"scan_layers={scan}")
    assert np.abs(want).max() > 1.0  # logits large enough for the tolerance to mean something
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_float64_reference_equals_flax_at_base_10000(models):
    cfg, tensors, _ = models["untied"]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ref = reference_logits(cfg, tensors, TOKENS, default_inv_freq(10000.0, head_dim))
    np.testing.assert_allclose(flax_logits(cfg, tensors, TOKENS), ref, rtol=0, atol=TOL)


def test_rope_theta_against_float64_reference(models):
    cfg, tensors, items = models["theta"]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ref = reference_logits(cfg, tensors, TOKENS, default_inv_freq(50000.0, head_dim))
    np.testing.assert_allclose(our_logits(items, TOKENS), ref, rtol=0, atol=TOL)
    # the Flax model ignores rope_theta: it would not be a valid reference here
    assert np.abs(flax_logits(cfg, tensors, TOKENS) - ref).max() > 1e-3


def test_llama3_rope_frequencies_equal_the_published_rule():
    """Llama 3.1 8B's numbers: theta 500000, head_dim 128, factor 8, low 1, high 4, 8192."""
    config = load_config([BASE, "rope_type=llama3.1", "rope_max_timescale=500000"])
    got = np.asarray(rope_frequencies(config, 128), np.float64)
    want = llama3_inv_freq(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    base = default_inv_freq(500000.0, 128)
    kept, scaled = np.isclose(want, base), np.isclose(want, base / 8)
    assert kept.sum() > 0 and scaled.sum() > 0 and (~kept & ~scaled).sum() > 0  # all three bands
    # computed in float64 and rounded to float32 once (<= 6e-8 relative) against the float64 rule
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_llama3_scaled_logits_against_float64_reference(models):
    cfg, tensors, items = models["llama3"]
    s = LLAMA3_SCALING
    inv = llama3_inv_freq(10000.0, 16, s["factor"], 1.0, 4.0, s["original_max_position_embeddings"])
    assert not np.allclose(inv, default_inv_freq(10000.0, 16))
    ref = reference_logits(cfg, tensors, TOKENS, inv)
    np.testing.assert_allclose(our_logits(items, TOKENS), ref, rtol=0, atol=TOL)


def test_checkpoint_keys_sit_between_base_and_command_line(models):
    _, _, items = models["untied"]
    root = items.parent.parent
    for path in (items, root):  # OUT/0/items and OUT
        config = load_config([BASE, f"load_parameters_path={path}"])
        assert (config.emb_dim, config.mlp_dim, config.vocab_size) == (64, 112, 96)  # not tiny's
    config = load_config([BASE, f"load_parameters_path={root}", "emb_dim=32"])
    assert config.emb_dim == 32  # the command line wins
    with pytest.raises(ConfigError, match="holds a different model: emb_dim=64 in the checkpoint"):
        manager.load_params(root, abstract_params(config), config)


# ------------------------------------------------------------------------------ generation


def test_greedy_generation_equals_reference_and_the_uncached_loop(models):
    cfg, tensors, items = models["untied"]
    prompt = [5, 17, 33, 2]
    cached, uncached = greedy_with_and_without_cache(items, prompt, vocab_limit=96)
    ids = np.zeros((1, 20), np.int64)  # one fixed shape: right padding is causally invisible
    ids[0, : len(prompt)] = prompt
    margins = []
    for t in range(len(prompt), 20):
        logits = flax_logits(cfg, tensors, ids)[0, t - 1]
        top2 = np.sort(logits)[-2:]
        margins.append(top2[1] - top2[0])
        ids[0, t] = int(np.argmax(logits))
    assert min(margins) >= 1e-3  # no near-tie: the ids are a fair comparison
    assert len(cached) == 16
    assert cached == uncached == ids[0, len(prompt) :].tolist()


# ------------------------------------------------------------------------------ export


def test_round_trip_is_bitwise(models, tmp_path):
    """HF (float32, two shards) -> ours -> HF: every tensor bitwise; config fields equal."""
    from safetensors.numpy import load_file

    for name, dtype, extra in (
        ("untied", "float32", ["hf_max_shard_mb=0.2"]),
        ("llama3", "bfloat16", []),
    ):
        cfg, tensors, items = models[name]
        out = tmp_path / name
        argv = [BASE, f"load_parameters_path={items}", f"hf_output_path={out}", *extra]
        assert to_huggingface([*argv, f"hf_output_dtype={dtype}"]) == 0
        files = sorted(p.name for p in out.glob("*.safetensors"))
        got = {}
        for f in files:
            got.update(load_file(str(out / f)))
        assert sorted(got) == sorted(tensors)
        for k, want in tensors.items():
            assert got[k].shape == want.shape
            np.testing.assert_array_equal(got[k].astype(np.float32), want)
            assert str(got[k].dtype) == dtype
        if name == "untied":
            assert len(files) > 1
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"]) == set(tensors)
        written = json.loads((out / "config.json").read_text())
        original = cfg.to_dict()
        for field in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rope_theta",
            "rms_norm_eps",
            "vocab_size",
            "tie_word_embeddings",
            "rope_scaling",
        ):
            assert written[field] == original[field], field
        assert (out / "generation_config.json").is_file()


def test_round_trip_of_bfloat16_source(tmp_path):
    """bfloat16 safetensors -> float32 checkpoint -> bfloat16: the same bits."""
    import ml_dtypes
    from safetensors.numpy import load_file

    cfg = llama_config(num_hidden_layers=1)
    tensors = random_tensors(cfg, seed=3)
    write_hf_folder(tmp_path / "hf", cfg, tensors, dtype=ml_dtypes.bfloat16)
    items = convert(tmp_path / "hf", tmp_path / "ckpt")
    argv = [BASE, f"load_parameters_path={items}", f"hf_output_path={tmp_path / 'out'}"]
    assert to_huggingface([*argv, "hf_output_dtype=bfloat16"]) == 0
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for k in before:
        assert after[k].dtype == before[k].dtype
        np.testing.assert_array_equal(after[k].view(np.uint16), before[k].view(np.uint16))


# ------------------------------------------------------------------------------ refusals


def test_refusals_are_one_line_with_exit_code_2(tmp_path, capsys):
    def refused(argv: list[str]) -> str:
        assert to_maxtext(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    cfg = llama_config(num_hidden_layers=1)
    tensors = random_tensors(cfg, seed=4)
    write_hf_folder(tmp_path / "hf", cfg, tensors)
    common = [f"hf_model_path={tmp_path / 'hf'}", f"base_output_directory={tmp_path / 'o'}"]
    assert refused([BASE, "model_name=llama2-7b", *common]) == (
        f"config error: hf_model_path={tmp_path / 'hf'}: config.json has hidden_size=64 but "
        f"model_name=llama2-7b sets emb_dim=4096; leave model_name out to take the shapes "
        f"from config.json"
    )
    missing = {k: v for k, v in tensors.items() if "up_proj" not in k}
    write_hf_folder(tmp_path / "missing", cfg, missing)
    assert refused([BASE, f"hf_model_path={tmp_path / 'missing'}"]) == (
        f"config error: hf_model_path={tmp_path / 'missing'}: tensor "
        f"model.layers.0.mlp.up_proj.weight is missing"
    )
    falcon = tmp_path / "falcon"  # (Mistral converts since the families; tests/test_convert.py)
    write_hf_folder(falcon, cfg, tensors)
    raw = json.loads((falcon / "config.json").read_text())
    raw.update(architectures=["FalconForCausalLM"], model_type="falcon")
    (falcon / "config.json").write_text(json.dumps(raw))
    assert refused([BASE, f"hf_model_path={falcon}"]).startswith(
        f"config error: {falcon / 'config.json'}: architectures=['FalconForCausalLM'] is not "
        f"supported: only LlamaForCausalLM (model_type llama), MistralForCausalLM"
    )
    assert not (tmp_path / "o").exists()  # nothing written for a refused conversion


def test_a_matching_preset_converts(tmp_path):
    """`model_name=tiny` with a config.json of tiny's shapes: accepted, shapes from the preset."""
    cfg = llama_config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    write_hf_folder(tmp_path / "hf", cfg, random_tensors(cfg, seed=5))
    items = convert(tmp_path / "hf", tmp_path / "ckpt", "model_name=tiny")
    stored = json.loads((items.parent / "config" / "metadata").read_text())
    assert (stored["model_name"], stored["emb_dim"], stored["head_dim"]) == ("tiny", 128, 32)


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["pipeline_parallelism=2"],
        ["pipeline_parallelism=4"],
        [
            "pipeline_parallelism=2",
            "pipeline_stage_layers=1,3",
            "ici_fsdp_parallelism=2",
            "ici_tensor_parallelism=2",
            "scan_layers=false",
        ],
    ],
    ids=["spmd", "pp2", "pp4", "pp2_uneven_fsdp2_tensor2_unrolled"],
)
def test_first_training_step_loss_equals_reference(models, tmp_path, layout):
    """One step of train.py from the converted checkpoint (default keys otherwise: scanned
    layers, 1f1b, checkpointing on): its loss is the reference model's on the same batch."""
    from MaxText.data import make_data
    from MaxText.train import main as train

    cfg, tensors, items = models["untied"]
    argv = [
        BASE,
        f"load_parameters_path={items}",
        "dataset_type=synthetic",
        "max_target_length=16",
        "global_batch_size=8",
        "steps=1",
        "log_period=1",
        "eval_interval=0",
        "enable_progress_bar=false",
        "enable_tensorboard=false",
        f"base_output_directory={tmp_path}",
        "run_name=ft",
        *layout,
    ]
    assert train(argv) == 0
    record = json.loads((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()[0])
    batch = next(make_data(load_config(argv)).train)
    logits = flax_logits(cfg, tensors, batch["inputs"])
    want = cross_entropy(logits, batch["targets"], batch["targets_mask"])
    assert record["step"] == 1
    assert abs(record["loss"] - want) <= TOL, (record["loss"], want)


# ------------------------------------------------------------------------------ README


def readme_commands() -> str:
    """The bash block of docs/fine_tuning.md, section "Fine-tune a Llama checkpoint", as written."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "fine_tuning.md").read_text()
    section = text.split("## Fine-tune a Llama checkpoint", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def byte_level_tokenizer(path: Path, vocab_size: int) -> None:
    """A Llama-3-style byte-level BPE tokenizer.json trained on a few of the bundled plays."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from MaxText.data.text import load_corpus

    texts = [d.text for d in load_corpus("")[:3]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


@pytest.mark.slow
def test_readme_fine_tune_commands_run_as_written(tmp_path):
    """convert -> train at pipeline_parallelism=4 -> generate -> export, the README's commands
    on a small random Llama with a byte-level BPE tokenizer.json; the exported folder is read
    by FlaxLlamaForCausalLM and gives the logits of the fine-tuned model."""
    import os
    import subprocess
    import sys

    import ml_dtypes
    from safetensors.numpy import load_file

    cfg = llama_config(vocab_size=320)
    hf = write_hf_folder(tmp_path / "hf", cfg, random_tensors(cfg, seed=11))
    byte_level_tokenizer(hf / "tokenizer.json", 320)
    env = dict(os.environ)
    env.update(
        HF=str(hf),
        CKPT=str(tmp_path / "ckpt"),
        RUNS=str(tmp_path / "runs"),
        EXPORT=str(tmp_path / "export"),
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
    )
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_commands()],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sample = proc.stdout.split("\nROMEO:", 1)  # generate prints after train's step lines
    assert len(sample) == 2 and len(sample[1].strip()) > 10
    assert "new run finetune starts from the parameters of checkpoint step 0" in proc.stderr
    run = tmp_path / "runs" / "finetune"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 10

    exported = {}
    for f in (tmp_path / "export").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    # the source's config.json comes back (its token ids kept), not ids from the tokenizer
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    config = load_config([BASE, f"load_parameters_path={run}", "scan_layers=false"])
    params, _ = manager.load_params(run, abstract_params(config), config)
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    tokens = TOKENS % 320
    ours = np.asarray(Decoder(config).apply({"params": rounded}, tokens))
    theirs = flax_logits(cfg, {k: v.astype(np.float32) for k, v in exported.items()}, tokens)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)
