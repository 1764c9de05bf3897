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

The result depends only on the documents given, so a window of documents always packs to the same
rows (what makes the grain pipeline's resume exact; see `grain_pipeline.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROW_KEYS = ("inputs", "targets", "targets_mask", "inputs_segmentation", "inputs_position")


def segments_of(doc: np.ndarray, seq_len: int, packing: bool) -> list[np.ndarray]:
    """The token spans (each of <= seq_len + 1 tokens, >= 2) a document contributes."""
    doc = np.asarray(doc)
    if doc.size < 2:
        return []
    if not packing:
        return [doc[: seq_len + 1]]
    return [doc[s : s + seq_len + 1] for s in range(0, doc.size - 1, seq_len)]


def pack_rows(
    docs: Sequence[np.ndarray], seq_len: int, *, packing: bool = True, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Rows (a dict of int32[R, seq_len] arrays, keys `ROW_KEYS`) holding the documents."""
    spans = [s for doc in docs for s in segments_of(doc, seq_len, packing)]
    rows: list[list[np.ndarray]] = []
    room: list[int] = []
    for span in spans:
        need = span.size - 1
        target = next((r for r, free in enumerate(room) if free >= need), None) if packing else None
        if target is None:
            rows.append([])
            room.append(seq_len)
            target = len(rows) - 1
        rows[target].append(span)
        room[target] -= need
    out = {k: np.zeros((len(rows), seq_len), np.int32) for k in ROW_KEYS}
    if pad_id:
        out["inputs"][:] = pad_id
        out["targets"][:] = pad_id
    for r, row in enumerate(rows):
        start = 0
        for seg, span in enumerate(row, 1):
            n = span.size - 1
            sl = slice(start, start + n)
            out["inputs"][r, sl] = span[:-1]
            out["targets"][r, sl] = span[1:]
            out["inputs_segmentation"][r, sl] = seg
            out["inputs_position"][r, sl] = np.arange(n)
            start += n
    out["targets_mask"] = (out["inputs_segmentation"] > 0).astype(np.int32)
    return out


def empty_rows(num_rows: int, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """All-padding rows (nothing counts): fill for a short last eval batch."""
    out = {k: np.zeros((num_rows, seq_len), np.int32) for k in ROW_KEYS}
    out["inputs"][:] = pad_id
    out["targets"][:] = pad_id
    return out
