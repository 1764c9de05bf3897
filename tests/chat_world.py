"""The converted chat model the SFT and DPO tests share: a byte-level tokenizer.json with ChatML's
special tokens, a random Llama written as a Hugging Face folder with its tokenizer,
`chat_template.jinja` (ChatML, Qwen 2.5's) and a generation_config.json, converted with
to_maxtext; synthetic conversations ("What is 3 plus 4?" -> "The answer is 7."); and the
independent references: transformers' assistant masks, a float64 forward pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from chat_fixtures import SPECIAL, byte_level_tokenizer, tokenizer_folder
from hf_reference import (
    default_inv_freq,
    llama_config,
    random_tensors,
    reference_logits,
    write_hf_folder,
)

from MaxText.config import CONFIGS_DIR
from MaxText.data.chat_template import fallback_source
from MaxText.to_maxtext import main as to_maxtext

BASE = str(CONFIGS_DIR / "base.yml")
SYSTEM = {"role": "system", "content": "Add."}
# transformers' own span tracking: ChatML with generation tags (renders as Qwen 2.5's template
# for conversations that begin with a system turn; `independent_masks` asserts it)
CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def conversation(rng, second_turn: float = 0.3) -> list[dict]:
    a, b = (int(x) for x in rng.integers(0, 5, 2))
    turns = [SYSTEM, {"role": "user", "content": f"What is {a} plus {b}?"}]
    turns.append({"role": "assistant", "content": f"The answer is {a + b}."})
    if rng.random() < second_turn:
        c = int(rng.integers(0, 5))
        turns.append({"role": "user", "content": f"And plus {c}?"})
        turns.append({"role": "assistant", "content": f"The answer is {a + b + c}."})
    return turns


def chat_model(root: Path, texts: list[str], seeds=(5,)) -> dict:
    """Tokenizer, Hugging Face folder(s) and converted checkpoint(s) of random Llamas (4 layers,
    width 32), one per seed: {"cfg", "hf", "tensors": [...], "ckpt": [...]}."""
    tok = byte_level_tokenizer(root / "tok.json", 320, corpus=[" ".join(texts)] * 3)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    cfg = llama_config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    out = {"cfg": cfg, "tensors": [], "ckpt": [], "hf": None}
    for seed in seeds:
        tensors = random_tensors(cfg, seed=seed)
        hf = write_hf_folder(root / f"hf{seed}", cfg, tensors)
        tokenizer_folder(hf, tok, "chatml", None)
        config = json.loads((hf / "tokenizer_config.json").read_text())
        config["eos_token"] = "<|end_of_text|>"  # generation must stop at generation_config's
        (hf / "tokenizer_config.json").write_text(json.dumps(config))
        (hf / "chat_template.jinja").write_text(fallback_source("chatml"))
        stop = [SPECIAL.index("<|end_of_text|>"), SPECIAL.index("<|im_end|>")]
        (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
        ckpt = root / f"ckpt{seed}"
        assert to_maxtext([BASE, f"hf_model_path={hf}", f"base_output_directory={ckpt}"]) == 0
        out["tensors"].append(tensors)
        out["ckpt"].append(ckpt)
        out["hf"] = out["hf"] or hf
    return out


def independent_masks(hf: Path, conversations) -> dict[tuple, np.ndarray]:
    """token ids -> transformers' assistant mask, per conversation."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    qwen = fallback_source("chatml")
    out = {}
    for c in conversations:
        assert tokenizer.apply_chat_template(
            c, tokenize=False, chat_template=qwen
        ) == tokenizer.apply_chat_template(c, tokenize=False, chat_template=CHATML_GENERATION)
        enc = tokenizer.apply_chat_template(
            c,
            tokenize=True,
            chat_template=CHATML_GENERATION,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        out[tuple(enc["input_ids"])] = np.asarray(enc["assistant_masks"])
    return out


def target_logprobs(cfg, tensors, ids: np.ndarray) -> np.ndarray:
    """float64 log p(ids[t + 1] | ids[: t + 1]) for every t, one sequence on its own."""
    inv_freq = default_inv_freq(cfg.rope_theta, cfg.hidden_size // cfg.num_attention_heads)
    logits = reference_logits(cfg, tensors, ids[None, :-1], inv_freq)[0]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logp[np.arange(ids.size - 1), ids[1:]]


def segments(batch):
    """(row, positions, token ids) of every example in a batch of rows."""
    seg_all = batch.get("inputs_segmentation")
    for r in range(batch["inputs"].shape[0]):
        seg = seg_all[r] if seg_all is not None else (batch["targets_mask"][r] > 0).astype(int)
        for s in sorted(set(seg.tolist()) - {0}):
            where = np.flatnonzero(seg == s)
            ids = np.concatenate([batch["inputs"][r, where], batch["targets"][r, where[-1:]]])
            yield r, where, ids
