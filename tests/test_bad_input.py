"""Bad input to train, generate, launch and plan: one line naming the problem and the fix, exit 2,
before anything is compiled or any process started (issue 36, items 6-9).

One tiny Llama (1 layer, width 64, a 96-id vocabulary) is converted once, without a tokenizer
(module fixture); a word-level tokenizer.json of 12 ids (fits the model) and a byte-level one of
300 ids (does not) stand in for a model's own tokenizer and a foreign one. Nothing here compiles a
step: every refusal comes before it, and the tests make compiling (and, where it matters,
starting the devices or a process) fail loudly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hf_reference import llama_config, random_tensors, write_hf_folder

from MaxText import generate, launch, plan
from MaxText import train as train_lib
from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.to_maxtext import main as to_maxtext

BASE = str(CONFIGS_DIR / "base.yml")
FOREIGN_IDS = 280  # the byte-level tokenizer's size (256 bytes + the merges its tiny corpus allows)
WORDS = ["<s>", "</s>", "<pad>", "to", "be", "or", "not", "that", "is", "the", "question", ","]


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def word_tokenizer(path: Path) -> Path:
    """A Hugging Face tokenizer.json of len(WORDS) ids (<s> = 0 is BOS, </s> = 1 EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def byte_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer.json of more ids (the 256 bytes and merges) than the model's 96:
    `FOREIGN_IDS`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["to be or not to be, that is the question"] * 20, trainer)
    tok.save(str(path))
    assert tok.get_vocab_size(with_added_tokens=True) == FOREIGN_IDS
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    """hf: a Hugging Face folder without a tokenizer; out: its conversion; words / bytes: the
    two tokenizer files."""
    base = tmp_path_factory.mktemp("bad_input")
    cfg = llama_config(num_hidden_layers=1)
    hf = write_hf_folder(base / "hf", cfg, random_tensors(cfg, seed=0))
    out = base / "ckpt"
    assert to_maxtext([BASE, f"hf_model_path={hf}", f"base_output_directory={out}"]) == 0
    return {
        "hf": hf,
        "out": out,
        "words": word_tokenizer(base / "words.json"),
        "bytes": byte_tokenizer(base / "bytes.json"),
    }


@pytest.fixture
def no_compile(monkeypatch):
    """Compiling the trainer's step, planning it, or starting the devices fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("got past the checks before the error was reported")

    monkeypatch.setattr(train_lib, "build_trainer", forbidden)
    monkeypatch.setattr(plan, "make_plan", forbidden)
    monkeypatch.setattr(train_lib.devices, "start", forbidden)
    monkeypatch.setattr(generate.devices, "start", forbidden)


# --------------------------------------------------- 7. model_name against the checkpoint's model


def test_a_chosen_model_name_must_match_the_checkpoint(ckpt, tmp_path):
    out = ckpt["out"]
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "model_name=small", f"load_parameters_path={out}"])
    assert str(e.value) == (
        f"model_name=small (on the command line) sets num_decoder_layers=6 but "
        f"load_parameters_path={out} holds a model with num_decoder_layers=1; leave model_name "
        f"out to take the model from the checkpoint"
    )
    own = tmp_path / "mine.yml"
    own.write_text(f"base_config: {BASE}\nmodel_name: small\n")
    with pytest.raises(ConfigError, match=rf"model_name=small \(in {own}\) sets num_decoder_lay"):
        load_config([str(own), f"load_parameters_path={out}"])
    # base.yml's default (tiny) is no choice: the checkpoint's shapes are taken
    config = load_config([BASE, f"load_parameters_path={out}"])
    assert (config.model_name, config.num_decoder_layers, config.emb_dim) == ("tiny", 1, 64)
    # a chosen preset's keys the command line sets are the command line's: not compared
    given = ["num_decoder_layers=1", "emb_dim=64", "num_query_heads=4", "num_kv_heads=2"]
    given += ["head_dim=16", "mlp_dim=112", "vocab_size=96", "rope_max_timescale=10000"]
    given += ["normalization_layer_epsilon=1e-5", "logits_via_embedding=false"]
    config = load_config([BASE, "model_name=small", f"load_parameters_path={out}", *given])
    assert config.emb_dim == 64
    # the log names the model by its shapes, not by base.yml's preset name
    assert train_lib.model_description(load_config([BASE, f"load_parameters_path={out}"])) == (
        "llama, 1 layers, emb_dim 64, 4/2 heads of 16, mlp_dim 112, vocab 96 (from "
        "load_parameters_path)"
    )
    assert train_lib.model_description(load_config([BASE])) == "tiny (llama)"


# ----------------------------------------------------------- 6. a checkpoint without a tokenizer


def test_a_converted_checkpoint_without_tokenizer_asks_for_one(ckpt, capsys, no_compile):
    out, hf = ckpt["out"], ckpt["hf"]
    want = (
        f"config error: {out} records no tokenizer (converted from {hf}, which had no "
        f"tokenizer.json or tokenizer.model); give tokenizer_path=<the model's tokenizer file>"
    )
    assert generate.main([BASE, f"load_parameters_path={out}"]) == 2
    assert _one_line(capsys) == want
    argv = [BASE, f"load_parameters_path={out}", "steps=1"]
    assert train_lib.main(argv) == 2
    assert _one_line(capsys) == want
    # data that needs no tokenizer, or a tokenizer given: no refusal here (stops at the devices)
    with pytest.raises(AssertionError, match="got past the checks"):
        train_lib.main([*argv, "dataset_type=synthetic"])
    words = [f"tokenizer_path={ckpt['words']}", "tokenizer_type=huggingface"]
    with pytest.raises(AssertionError, match="got past the checks"):
        train_lib.main([*argv, *words])


def test_to_maxtext_refuses_a_missing_or_foreign_tokenizer(ckpt, tmp_path, capsys):
    common = [BASE, f"hf_model_path={ckpt['hf']}", f"base_output_directory={tmp_path / 'o'}"]
    missing = tmp_path / "nothing.json"
    assert to_maxtext([*common, f"tokenizer_path={missing}"]) == 2
    assert _one_line(capsys) == (
        f"config error: tokenizer_path={missing} does not exist; give the model's tokenizer.json "
        f"or tokenizer.model"
    )
    foreign = [f"tokenizer_path={ckpt['bytes']}", "tokenizer_type=huggingface"]
    assert to_maxtext([*common, *foreign]) == 2
    assert _one_line(capsys) == (
        f"config error: tokenizer_path={ckpt['bytes']} has {FOREIGN_IDS} ids but the model's "
        f"vocab_size is "
        f"96: ids from 96 on have no embedding, so it is not this model's tokenizer; give the "
        f"model's own"
    )
    assert not (tmp_path / "o").exists()  # nothing written


# ------------------------------------------------------------------------ 9. generate's inputs


def test_generate_refuses_prompts_it_cannot_continue(ckpt, capsys, no_compile):
    words = [f"tokenizer_path={ckpt['words']}", "tokenizer_type=huggingface"]
    argv = [BASE, f"load_parameters_path={ckpt['out']}", *words]
    assert generate.main([*argv, "prompt=", "add_bos=false"]) == 2
    assert _one_line(capsys) == (
        "config error: the prompt is empty and add_bos=false: there is nothing to continue; give "
        "prompt=<text> or add_bos=true"
    )
    foreign = [f"tokenizer_path={ckpt['bytes']}", "tokenizer_type=huggingface"]
    prompt = "prompt=that is the question"  # merged pieces: ids from 256 on
    assert generate.main([BASE, f"load_parameters_path={ckpt['out']}", *foreign, prompt]) == 2
    line = _one_line(capsys)
    assert line.startswith("config error: the prompt has token ids [")
    assert line.endswith(
        f">= vocab_size=96: the tokenizer ({FOREIGN_IDS} ids) is not this model's; give the "
        f"model's own "
        "tokenizer_path="
    )
    for temperature in ("-1", "0"):
        assert generate.main([*argv, f"decode_sampling_temperature={temperature}"]) == 2
        assert _one_line(capsys) == (
            f"config error: decode_sampling_temperature={float(temperature)}: must be > 0"
        )
    # an empty prompt with BOS is a prompt (BOS alone): it gets past the checks
    with pytest.raises(AssertionError, match="got past the checks"):
        generate.main([*argv, "prompt=", "add_bos=true"])


# -------------------------------------------------------------------- 9. train, plan, hardware


def test_steps_0_exits_0_before_any_device_starts(tmp_path, caplog, no_compile):
    caplog.set_level(logging.INFO, logger="MaxText")
    argv = [BASE, "steps=0", f"base_output_directory={tmp_path}", "run_name=zero"]
    assert train_lib.main(argv) == 0
    assert "steps=0: nothing to train (set steps= to the step to train up to)" in caplog.text
    assert not (tmp_path / "zero").exists()


def test_plan_flag_error_is_one_line(capsys, no_compile):
    with pytest.raises(SystemExit) as stop:
        plan.main([BASE, "--hardware", "tpu"])
    assert stop.value.code == 2
    assert _one_line(capsys) == (
        "usage error: argument --hardware: invalid choice: 'tpu' (choose from 'h100', 'h200', "
        "'a100', 'cpu'); see python -m MaxText.plan --help"
    )


def test_hardware_gpu_on_a_cpu_host_is_one_line(capsys, monkeypatch):
    """Only the refusal: no `XLA GPU flags:` line first (this host has no GPU to use them)."""
    import jax

    jax.devices()  # this process's backend is up: the flags set below reach no backend
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
    assert train_lib.main([BASE, "hardware=gpu", "enable_checkpointing=false"]) == 2
    assert _one_line(capsys).startswith("config error: hardware=gpu but JAX finds no GPU")


# ------------------------------------------------------------------------------- 8. the launcher


@pytest.fixture
def no_process(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a trainer process was started")

    monkeypatch.setattr(subprocess, "Popen", forbidden)


def test_launch_checks_the_config_once_before_starting_processes(capsys, no_process):
    assert launch.main(["--num_processes", "4", "--", BASE, "steps=-1"]) == 2
    assert _one_line(capsys) == "config error: steps=-1: must be >= 0"
    # a rule that holds only for the keys the launcher adds (a key given twice)
    assert launch.main(["--num_processes", "2", "--", BASE, "num_processes=3"]) == 2
    assert _one_line(capsys) == (
        "config error: num_processes is given twice and disagrees (3 vs 2); set it once"
    )
    for argv, what in (
        (["--num_processes", "2", "--"], "nothing after `--`; give the trainer's CONFIG.yml "),
        (["--num_processes", "2", BASE], "no `--` before the trainer's arguments"),
        (["--num_processes", "0", "--", BASE], "--num_processes must be at least 1, got 0"),
    ):
        with pytest.raises(SystemExit) as stop:
            launch.main(argv)
        assert stop.value.code == 2
        line = _one_line(capsys)
        assert line.startswith(f"usage error: {what}") and line.endswith(
            "; see python -m MaxText.launch --help"
        ), line
    assert capsys.readouterr().out == ""


# --------------------------------------------------------------- 9. a config.json that is wrong


def test_an_inconsistent_or_malformed_config_json_is_one_line(ckpt, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(ckpt["hf"], hf)
    raw = json.loads((hf / "config.json").read_text())
    argv = [BASE, f"hf_model_path={hf}", f"base_output_directory={tmp_path / 'o'}"]
    (hf / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    assert to_maxtext(argv) == 2
    assert _one_line(capsys) == (
        f"config error: {hf / 'config.json'}: model_type='gpt2' does not match "
        f"architectures=['LlamaForCausalLM'] (model_type 'llama'); the file is inconsistent: fix "
        f"model_type or architectures"
    )
    (hf / "config.json").write_text(json.dumps([raw]))
    assert to_maxtext(argv) == 2
    assert _one_line(capsys) == (
        f"config error: {hf / 'config.json'} holds a JSON list, not an object of fields; is it a "
        f"Hugging Face config.json?"
    )
    assert not (tmp_path / "o").exists()
