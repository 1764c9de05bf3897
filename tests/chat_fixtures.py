"""Chat test fixtures (nothing here imports MaxText): a byte-level BPE tokenizer.json with every
fallback template's special tokens, tokenizer folders as Hugging Face writes them, conversations.

`FAMILIES`: per fallback template, the special-token strings its model's tokenizer_config.json
names (Qwen 2.5 has no BOS; Llama 3's EOS for chat is `<|eot_id|>`).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = [
    "<pad>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
]
FAMILIES = {
    "chatml": {"eos_token": "<|im_end|>", "pad_token": "<pad>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
}

CONVERSATIONS = {
    "one_turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ],
    "system": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": " Seven is prime. "},
    ],
    "two_turns": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
        {"role": "user", "content": "And back?"},
        {"role": "assistant", "content": "Three, two, one.\n"},
    ],
}

CORPUS = [
    "the quick brown fox jumps over the lazy dog. What is the capital of France? Paris is "
    "the capital of France. Count to three: one, two, three. And back? Three, two, one. "
    "You answer in one short sentence. Name a prime number: seven is prime. system user "
    "assistant model Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
] * 4


def byte_level_tokenizer(path: Path, vocab_size: int = 400, corpus=CORPUS) -> Path:
    """A byte-level BPE tokenizer.json (Llama 3 / Qwen style) with the `SPECIAL` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(corpus), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def tokenizer_folder(folder: Path, tokenizer_json: Path, family: str, template: str | None):
    """A Hugging Face tokenizer folder: tokenizer.json, tokenizer_config.json (the family's
    special tokens and, if given, `chat_template`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **FAMILIES[family]}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def hf_tokenizer(folder: Path):
    """transformers' tokenizer of a `tokenizer_folder` (the reference implementation)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
