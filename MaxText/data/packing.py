"""Tokenized corpora and packing: documents -> one cached token stream -> fixed-length windows.

A split's documents are tokenized once into a single int32 stream `[bos] doc0 [eos] [bos] doc1
[eos] ...` (BOS/EOS left out if the tokenizer has none) and cached as
`{cache}/tokens/{split}_{key}.npy`, `key` hashing the documents and the tokenizer model.

`PackedWindows` cuts a stream into windows of `seq_len + 1` tokens with stride `seq_len`, so
every token is predicted exactly once per epoch: window i is `stream[i*L : i*L + L + 1]`,
`inputs = window[:-1]`, `targets = window[1:]`. Documents are packed back to back (attention may
cross a document boundary, as in GPT-2-style training; the EOS/BOS pair marks it). Only the last
window can be short; it is padded with `pad_id` and masked out (`targets_mask` 0).
"""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np

from MaxText.data import cache as cache_lib
from MaxText.data.text import Document
from MaxText.data.tokenizer import SentencePieceTokenizer

TOKENS_FORMAT_VERSION = 1


def tokenize_documents(docs: list[Document], tokenizer: SentencePieceTokenizer) -> np.ndarray:
    """The int32 token stream of `docs`, each wrapped in BOS/EOS (as add_bos/add_eos say)."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 and tokenizer.add_bos else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id >= 0 and tokenizer.add_eos else []
    pieces = [np.zeros((0,), np.int32)]
    for ids in tokenizer.encode_many([d.text for d in docs]):
        pieces.append(np.asarray(bos + ids + eos, dtype=np.int32))
    return np.concatenate(pieces)


def cached_token_stream(
    docs: list[Document],
    tokenizer: SentencePieceTokenizer,
    *,
    split: str,
    corpus_key: str,
    cache_root: pathlib.Path,
) -> np.ndarray:
    """`tokenize_documents`, cached on disk under a key of (corpus, tokenizer model, split)."""
    flags = (tokenizer.add_bos, tokenizer.add_eos)
    special = "" if all(flags) else f"|bos={flags[0]},eos={flags[1]}"  # default: the old key
    key = hashlib.sha256(
        f"v{TOKENS_FORMAT_VERSION}|{split}|{corpus_key}|{tokenizer.model_hash}{special}".encode()
    ).hexdigest()[:16]
    path = cache_root / "tokens" / f"{split}_{key}.npy"
    if not path.is_file():
        cache_lib.publish_npy(path, tokenize_documents(docs, tokenizer))
    return cache_lib.load_npy(path)


def unigram_entropy_nats(tokens: np.ndarray) -> float:
    """Entropy (nats) of the empirical unigram distribution of `tokens`.

    The loss of the best model that ignores context; a language model that learned anything
    has an eval loss well below it.
    """
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size == 0:
        raise ValueError("unigram_entropy_nats needs at least one token")
    counts = np.bincount(tokens.astype(np.int64))
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum())


class PackedWindows:
    """Random access to the `seq_len + 1`-token windows of a token stream (see module doc)."""

    def __init__(self, stream: np.ndarray, seq_len: int, pad_id: int):
        if seq_len < 1:
            raise ValueError(f"max_target_length={seq_len} must be >= 1")
        self.stream = stream
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.num_tokens = int(stream.shape[0])
        self.num_windows = -(-(self.num_tokens - 1) // seq_len) if self.num_tokens >= 2 else 0

    def __len__(self) -> int:
        return self.num_windows

    def batch(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The examples of windows `window_ids` (a window id of -1 gives an all-padding row)."""
        window_ids = np.asarray(window_ids, dtype=np.int64)
        L = self.seq_len
        pos_BxL1 = window_ids[:, None] * L + np.arange(L + 1)[None, :]
        valid_BxL1 = (window_ids[:, None] >= 0) & (pos_BxL1 < self.num_tokens)
        tokens_BxL1 = np.where(
            valid_BxL1, self.stream[np.clip(pos_BxL1, 0, max(self.num_tokens - 1, 0))], self.pad_id
        ).astype(np.int32)
        return {
            "inputs": tokens_BxL1[:, :-1],
            "targets": tokens_BxL1[:, 1:],
            "targets_mask": valid_BxL1[:, 1:].astype(np.int32),
        }
