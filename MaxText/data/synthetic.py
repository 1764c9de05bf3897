"""dataset_type=synthetic: deterministic, learnable token rows computed from (seed, position).

Row i of the stream is an arithmetic progression modulo the usable vocabulary: token j is
`FIRST + (start + j * stride) % (vocab_size - FIRST)`, with `start` and `stride` drawn from a
hash of (seed, i). After two tokens the rest of a row is predictable, so a model's loss falls
visibly towards zero, which makes this a useful smoke test; reading no files, it also measures
step speed without input cost. Ids below FIRST (pad/unk/bos/eos) never occur and every target
counts (`targets_mask` is all ones). The eval split is a separate stream of
`SYNTHETIC_EVAL_BATCHES` batches (or `eval_steps` if > 0).
"""

from __future__ import annotations

import numpy as np

from MaxText.data.tokenizer import EOS_ID

FIRST = EOS_ID + 1
SYNTHETIC_EVAL_BATCHES = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A strong 64-bit integer hash (splitmix64 finalizer), vectorized; wraps modulo 2**64."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


class SyntheticRows:
    """Random access to synthetic rows: `batch(positions)` gives the examples at those positions."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int):
        if vocab_size <= FIRST + 1:
            raise ValueError(
                f"dataset_type=synthetic needs vocab_size > {FIRST + 1}, got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self._seed = np.uint64(seed % 2**64)

    def batch(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        usable = np.uint64(self.vocab_size - FIRST)
        with np.errstate(over="ignore"):
            key = _splitmix64(np.asarray(positions, np.uint64) ^ _splitmix64(self._seed))
            start = key % usable
            stride = np.uint64(1) + _splitmix64(key) % (usable - np.uint64(1))
        j = np.arange(self.seq_len + 1, dtype=np.uint64)
        tokens = (start[:, None] + j[None, :] * stride[:, None]) % usable + np.uint64(FIRST)
        tokens = tokens.astype(np.int32)
        return {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "targets_mask": np.ones_like(tokens[:, 1:]),
        }
