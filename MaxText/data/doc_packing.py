"""Packing tokenized documents into fixed-length rows with segment ids and per-document positions.

A document of n tokens (BOS ... EOS) gives n - 1 (input, target) pairs: `inputs = doc[:-1]`,
`targets = doc[1:]`. A document with more than L pairs (L = max_target_length) is cut into
segments of at most L pairs (segment c covers doc[c*L : c*L + L + 1], so every target is predicted
exactly once); with `packing=False` it is truncated to its first L pairs instead (MaxText's rule).

`pack_rows(docs, L, packing=True)` places the segments into rows first-fit, in order: each segment
goes into the first row with room, else a new row. A row holds

    inputs, targets          int32[L], 0 (pad) after the last segment
    inputs_segmentation      int32[L], 1, 2, ... per segment in the row, 0 on padding
    inputs_position          int32[L], 0, 1, ... restarting at every segment, 0 on padding
    targets_mask             int32[L], 1 where a target counts (segmentation > 0)

so attention is restricted to equal segment ids, RoPE positions restart per document and padding
never enters the loss. `packing=False` puts one (truncated) document per row.

Chat examples (`pack_examples`, ids and a loss mask each: `chat.py`) are placed the same way but
never split: one longer than L + 1 tokens is cut from the right or left out (`sft_truncation`),
and `targets_mask` is also 0 where the example's mask is (prompt tokens). Preference pairs
(`pack_pairs`) are not packed: pair k fills rows 2k (chosen) and 2k + 1 (rejected), so a batch of
an even number of rows holds whole pairs. Both add `COUNT_KEYS` (per row; a window's counts on its
first row) so the trainer can log how many examples were cut or left out.

The result depends only on the documents given, so a window of documents always packs to the same
rows (what makes the grain pipeline's resume exact; see `grain_pipeline.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROW_KEYS = ("inputs", "targets", "targets_mask", "inputs_segmentation", "inputs_position")
# Chat and preference windows also count the examples cut to fit a row and those left out.
COUNT_KEYS = ("examples_truncated", "examples_dropped")


def segments_of(doc: np.ndarray, seq_len: int, packing: bool) -> list[np.ndarray]:
    """The token spans (each of <= seq_len + 1 tokens, >= 2) a document contributes."""
    doc = np.asarray(doc)
    if doc.size < 2:
        return []
    if not packing:
        return [doc[: seq_len + 1]]
    return [doc[s : s + seq_len + 1] for s in range(0, doc.size - 1, seq_len)]


def _first_fit(needs: Sequence[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Rows of span indices: each span (needing `needs[i]` positions) goes into the first row
    with room, else a new row (`packing=False`: a row each)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, need in enumerate(needs):
        target = next((r for r, free in enumerate(room) if free >= need), None) if packing else None
        if target is None:
            rows.append([])
            room.append(seq_len)
            target = len(rows) - 1
        rows[target].append(i)
        room[target] -= need
    return rows


def _fill(
    spans: Sequence[np.ndarray],
    masks: Sequence[np.ndarray] | None,
    rows: Sequence[Sequence[int]],
    seq_len: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """The row arrays (`ROW_KEYS`) of `rows` (lists of span indices); a target counts where its
    segment is real and, with `masks`, where the span's mask marks it."""
    out = {k: np.zeros((len(rows), seq_len), np.int32) for k in ROW_KEYS}
    if pad_id:
        out["inputs"][:] = pad_id
        out["targets"][:] = pad_id
    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row, 1):
            span = spans[i]
            n = span.size - 1
            sl = slice(start, start + n)
            out["inputs"][r, sl] = span[:-1]
            out["targets"][r, sl] = span[1:]
            out["inputs_segmentation"][r, sl] = seg
            out["inputs_position"][r, sl] = np.arange(n)
            out["targets_mask"][r, sl] = 1 if masks is None else masks[i][1:]
            start += n
    return out


def pack_rows(
    docs: Sequence[np.ndarray], seq_len: int, *, packing: bool = True, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Rows (a dict of int32[R, seq_len] arrays, keys `ROW_KEYS`) holding the documents."""
    spans = [s for doc in docs for s in segments_of(doc, seq_len, packing)]
    rows = _first_fit([s.size - 1 for s in spans], seq_len, packing)
    return _fill(spans, None, rows, seq_len, pad_id)


def _fit(tokens, mask, seq_len: int, truncation: str) -> tuple | None:
    """(tokens, mask) of an example within seq_len + 1 tokens, None if it is dropped."""
    if tokens.size - 1 > seq_len:
        if truncation == "drop":
            return None
        tokens, mask = tokens[: seq_len + 1], mask[: seq_len + 1]
    if tokens.size < 2 or not mask[1:].any():  # nothing left to train on
        return None
    return tokens, mask


def _with_counts(out: dict[str, np.ndarray], truncated: int, dropped: int) -> dict:
    """Adds `COUNT_KEYS` (int32[R]): the window's counts, on its first row."""
    rows = out["inputs"].shape[0]
    for key, value in zip(COUNT_KEYS, (truncated, dropped), strict=True):
        out[key] = np.zeros((rows,), np.int32)
        if rows:
            out[key][0] = value
    return out


def pack_examples(
    examples: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    *,
    packing: bool,
    pad_id: int,
    truncation: str,
    completion_only: bool = True,
) -> dict[str, np.ndarray]:
    """Rows of chat examples ((ids, mask) each): never split; one longer than seq_len + 1
    tokens is cut from the right (`truncation="right"`) or left out (`"drop"`), and one with
    no trained target left is left out. `completion_only=False` trains every target."""
    spans, masks, truncated, dropped = [], [], 0, 0
    for tokens, mask in examples:
        mask = mask if completion_only else np.ones_like(mask)
        fitted = _fit(tokens, mask, seq_len, truncation)
        if fitted is None:
            dropped += 1
            continue
        truncated += int(fitted[0].size < tokens.size)
        spans.append(fitted[0])
        masks.append(fitted[1])
    rows = _first_fit([s.size - 1 for s in spans], seq_len, packing)
    return _with_counts(_fill(spans, masks, rows, seq_len, pad_id), truncated, dropped)


def pack_pairs(
    pairs: Sequence[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]],
    seq_len: int,
    *,
    pad_id: int,
    truncation: str,
) -> dict[str, np.ndarray]:
    """Rows of preference pairs: pair k's chosen side in row 2k, its rejected side in row 2k + 1,
    one side per row (pairs are not packed). A pair is truncated or dropped as a whole (a side
    too long under "drop", or without a scored token left, drops the pair)."""
    spans, masks, truncated, dropped = [], [], 0, 0
    for chosen, rejected in pairs:
        fitted = [_fit(*side, seq_len, truncation) for side in (chosen, rejected)]
        if fitted[0] is None or fitted[1] is None:
            dropped += 1
            continue
        truncated += int(fitted[0][0].size < chosen[0].size or fitted[1][0].size < rejected[0].size)
        for tokens, mask in fitted:
            spans.append(tokens)
            masks.append(mask)
    rows = [[i] for i in range(len(spans))]
    return _with_counts(_fill(spans, masks, rows, seq_len, pad_id), truncated, dropped)


def empty_rows(
    num_rows: int, seq_len: int, pad_id: int = 0, keys: Sequence[str] = ROW_KEYS
) -> dict[str, np.ndarray]:
    """All-padding rows (nothing counts): fill for a short last eval batch."""
    out = {k: np.zeros((num_rows, seq_len), np.int32) for k in keys if k not in COUNT_KEYS}
    out.update({k: np.zeros((num_rows,), np.int32) for k in keys if k in COUNT_KEYS})
    out["inputs"][:] = pad_id
    out["targets"][:] = pad_id
    return out
