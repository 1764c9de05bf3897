"""Conversion's remaining refusals, each one line with exit code 2 and nothing written; the
tokenizer a folder carries; a float16 export; the formats export refuses. (The families' round
trips and logits: tests/test_family_models.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from family_reference import hf_config, random_tensors, write_hf_folder

from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.convert.hf_config import check_exportable
from MaxText.to_huggingface import main as to_huggingface
from MaxText.to_maxtext import main as to_maxtext

BASE = str(CONFIGS_DIR / "base.yml")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> tuple[Path, dict, dict]:
    cfg = hf_config("llama", num_hidden_layers=1)
    tensors = random_tensors(cfg, seed=5)
    folder = write_hf_folder(tmp_path_factory.mktemp("llama") / "hf", cfg, tensors)
    return folder, cfg, tensors


def _variant(tmp_path: Path, name: str, cfg: dict, tensors: dict, **fields) -> Path:
    return write_hf_folder(tmp_path / name, {**cfg, **fields}, tensors)


def _refused(capsys, folder: Path, out: Path) -> str:
    assert to_maxtext([BASE, f"hf_model_path={folder}", f"base_output_directory={out}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not out.exists() or not any(out.iterdir())  # nothing written for a refused conversion
    return lines[0]


def test_config_json_refusals(llama_folder, tmp_path, capsys):
    folder, cfg, tensors = llama_folder
    where = lambda f: f"config error: {f / 'config.json'}:"  # noqa: E731

    bias = _variant(tmp_path, "bias", cfg, tensors, attention_bias=True)
    assert _refused(capsys, bias, tmp_path / "o") == (
        f"{where(bias)} attention_bias=True is not supported: LlamaForCausalLM with projection "
        "biases (q, k, v and o) is not a model here; Qwen 2's q/k/v biases are "
        "decoder_block=qwen2"
    )
    yarn = _variant(tmp_path, "yarn", cfg, tensors,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0})  # fmt: skip
    assert _refused(capsys, yarn, tmp_path / "o") == (
        f"{where(yarn)} rope_scaling.rope_type='yarn' is not supported: only Llama 3's "
        "(rope_type: llama3) scaling"
    )
    falcon = _variant(tmp_path, "falcon", cfg, tensors, architectures=["FalconForCausalLM"],
                      model_type="falcon")  # fmt: skip
    assert _refused(capsys, falcon, tmp_path / "o") == (
        f"{where(falcon)} architectures=['FalconForCausalLM'] is not supported: only "
        "LlamaForCausalLM (model_type llama), MistralForCausalLM (model_type mistral), "
        "Qwen2ForCausalLM (model_type qwen2), Qwen3ForCausalLM (model_type qwen3), "
        "Gemma2ForCausalLM (model_type gemma2), MixtralForCausalLM (model_type mixtral), "
        "Qwen3MoeForCausalLM (model_type qwen3_moe) convert"
    )
    qwen2 = _variant(tmp_path, "qwen2", {**cfg, "architectures": ["Qwen2ForCausalLM"],
                     "model_type": "qwen2"}, tensors, use_sliding_window=True)  # fmt: skip
    assert _refused(capsys, qwen2, tmp_path / "o").startswith(
        f"{where(qwen2)} use_sliding_window=True is not supported: transformers 4.47.1's "
        "eager/SDPA attention would window every layer"
    )
    qwen3 = _variant(tmp_path, "qwen3", {**cfg, "architectures": ["Qwen3ForCausalLM"],
                     "model_type": "qwen3"}, tensors, attention_bias=True)  # fmt: skip
    assert _refused(capsys, qwen3, tmp_path / "o").startswith(
        f"{where(qwen3)} attention_bias=True is not supported: Qwen 3's attention_bias adds "
        "biases to q, k, v and o"
    )
    gemma = _variant(tmp_path, "gemma", {**cfg, "architectures": ["Gemma2ForCausalLM"],
                     "model_type": "gemma2"}, tensors, hidden_activation="gelu")  # fmt: skip
    assert _refused(capsys, gemma, tmp_path / "o") == (
        f"{where(gemma)} hidden_activation='gelu' is not supported: Gemma 2's MLP is GeGLU with "
        "tanh-approximated GELU"
    )


def test_a_tensor_of_the_wrong_shape_is_refused(llama_folder, tmp_path, capsys):
    folder, cfg, tensors = llama_folder
    bad = dict(tensors)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad[name] = np.zeros((bad[name].shape[0] + 8, bad[name].shape[1]), np.float32)
    folder = write_hf_folder(tmp_path / "shape", cfg, bad)
    assert _refused(capsys, folder, tmp_path / "o") == (
        f"config error: hf_model_path={folder}: tensor {name} has shape (40, 32), config.json "
        "implies (32, 32)"
    )


def test_tokenizer_model_becomes_sentencepiece_and_comes_back(tmp_path):
    """A folder with tokenizer.model (Llama 2, Mistral, Gemma): the checkpoint records it as
    tokenizer_type=sentencepiece, load_parameters_path alone brings it back (it loads and
    encodes), and the export copies the same bytes."""
    from MaxText.data.text import load_corpus
    from MaxText.data.tokenizer import load_tokenizer, train_sentencepiece

    # a model whose vocabulary holds the tokenizer's 400 ids (to_maxtext refuses a tokenizer
    # with more ids than vocab_size: tests/test_bad_input.py)
    cfg = hf_config("llama", num_hidden_layers=1, vocab_size=400)
    folder = write_hf_folder(tmp_path / "hf", cfg, random_tensors(cfg, seed=5))
    (folder / "tokenizer.model").write_bytes(train_sentencepiece(load_corpus("")[:1], 400))
    out = tmp_path / "ckpt"
    assert to_maxtext([BASE, f"hf_model_path={folder}", f"base_output_directory={out}"]) == 0
    config = load_config([BASE, f"load_parameters_path={out / '0' / 'items'}"])
    assert (config.tokenizer_type, config.tokenizer_path) == (  # the checkpoint's own copy
        "sentencepiece",
        str(out / "tokenizer" / "tokenizer.model"),
    )
    assert (out / "tokenizer" / "tokenizer.model").read_bytes() == (
        folder / "tokenizer.model"
    ).read_bytes()
    tokenizer = load_tokenizer(config.tokenizer_path, config.tokenizer_type)
    assert tokenizer.decode(tokenizer.encode("ROMEO: good night")) == "ROMEO: good night"
    export = tmp_path / "export"
    assert to_huggingface([BASE, f"load_parameters_path={out}", f"hf_output_path={export}"]) == 0
    assert (export / "tokenizer.model").read_bytes() == (folder / "tokenizer.model").read_bytes()
    assert not (export / "tokenizer.json").exists()


def test_float16_export(llama_folder, tmp_path):
    """hf_output_dtype=float16: F16 tensors equal to the float32 weights rounded to float16
    (bitwise), and config.json says torch_dtype float16."""
    from safetensors.numpy import load_file

    folder, cfg, tensors = llama_folder
    out = tmp_path / "ckpt"
    assert to_maxtext([BASE, f"hf_model_path={folder}", f"base_output_directory={out}"]) == 0
    export = tmp_path / "export"
    argv = [BASE, f"load_parameters_path={out}", f"hf_output_path={export}"]
    assert to_huggingface([*argv, "hf_output_dtype=float16"]) == 0
    got = load_file(str(export / "model.safetensors"))
    assert sorted(got) == sorted(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == np.float16
        np.testing.assert_array_equal(got[name].view(np.uint16),
                                      want.astype(np.float16).view(np.uint16))  # fmt: skip
    written = json.loads((export / "config.json").read_text())
    assert written["torch_dtype"] == "float16"
    assert {k for k in cfg if written[k] != cfg[k]} == {"torch_dtype"}


def test_export_refuses_what_no_format_expresses():
    with pytest.raises(ConfigError, match="decoder_block=gpt has no Hugging Face format"):
        check_exportable(load_config([BASE, "decoder_block=gpt"]))
    with pytest.raises(ConfigError, match="use_qk_norm=True cannot be written as "
                       "LlamaForCausalLM, which implies use_qk_norm=False"):  # fmt: skip
        check_exportable(load_config([BASE, "use_qk_norm=true"]))
    with pytest.raises(ConfigError, match="attn_logits_soft_cap=50.0 cannot be written as "
                       "MistralForCausalLM"):  # fmt: skip
        check_exportable(load_config([BASE, "decoder_block=mistral", "attn_logits_soft_cap=50"]))
    check_exportable(load_config([BASE, "model_name=gemma2-9b"]))  # the preset is exportable
