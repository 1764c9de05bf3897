"""The checkpointable training iterator, the epoch-shuffled sample order, and eval batching.

The training data is one infinite, deterministic stream of examples fixed by the dataset and
`seed`; a batch is the next `global_batch_size` examples of it. The iterator's whole state is
the number of examples consumed (`position`), so

* `get_state()` is a small JSON-serializable dict and `set_state()` is O(1): a restored
  iterator yields bitwise-identical batches to the uninterrupted one;
* with `process_count` P, process p yields rows `[p*B/P, (p+1)*B/P)` of each global batch and
  reads only those examples; the state does not depend on P, so a run can resume on a
  different number of processes (or with a different global batch: the stream continues at the
  same example).

For packed windows the order is a fresh shuffle each epoch: grain's `MapDataset.shuffle` (an
O(1)-memory index permutation reseeded per epoch) followed by an infinite `repeat`, seeded
with a 32-bit hash of `seed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from MaxText.data.packing import PackedWindows

Batch = dict[str, np.ndarray]
STATE_VERSION = 1


def derived_seed(seed: int, purpose: str) -> int:
    """A 32-bit seed for `purpose` derived from the config seed (unrelated across seeds)."""
    words = [ord(c) for c in purpose]
    return int(np.random.SeedSequence([int(seed) % 2**63, *words]).generate_state(1)[0])


def check_fingerprint(state: dict[str, Any], fingerprint: dict[str, Any]) -> None:
    """Raises ValueError naming every key of `fingerprint` whose value differs from the one saved
    in `state["fingerprint"]` (the data a saved iterator state belongs to)."""
    saved = state.get("fingerprint", {})
    diffs = [
        f"{k}: saved {saved.get(k)!r}, now {v!r}"
        for k, v in fingerprint.items()
        if saved.get(k) != v
    ]
    if diffs:
        raise ValueError(
            "cannot restore the data position: the checkpoint was made with different data "
            f"({'; '.join(diffs)}); restore with the original data options or start a new run "
            "from its parameters only"
        )


class ShuffledOrder:
    """Maps a global example position to a window id: a new permutation of windows per epoch."""

    def __init__(self, num_windows: int, seed: int):
        if num_windows < 1:
            raise ValueError("the training split has no complete example; it needs >= 2 tokens")
        self._ds = grain.MapDataset.range(num_windows).shuffle(seed=seed).repeat(None)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return np.fromiter((self._ds[int(p)] for p in positions), np.int64, len(positions))


class BatchIterator(Iterator[Batch]):
    """Infinite iterator of this process's slice of each global batch, with get/set_state."""

    def __init__(
        self,
        fetch: Callable[[np.ndarray], Batch],
        *,
        global_batch_size: int,
        process_index: int,
        process_count: int,
        fingerprint: dict[str, Any],
    ):
        self._fetch = fetch
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self._offset = process_index * self.local_batch_size
        self._fingerprint = dict(fingerprint)
        self._position = 0

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        start = self._position + self._offset
        batch = self._fetch(np.arange(start, start + self.local_batch_size, dtype=np.int64))
        self._position += self.global_batch_size
        return batch

    def get_state(self) -> dict[str, Any]:
        """The position in the example stream (JSON-serializable; same on every process)."""
        return {
            "version": STATE_VERSION,
            "position": self._position,
            "global_batch_size": self.global_batch_size,
            "fingerprint": dict(self._fingerprint),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from `state` (from `get_state`, possibly after a JSON round trip).

        Raises ValueError if the state belongs to different data (dataset, tokenization,
        sequence length or seed), since the continuation would then not be exact.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"data iterator state version {state.get('version')!r} is not {STATE_VERSION}; "
                "it was written by an incompatible version of MaxText.data"
            )
        check_fingerprint(state, self._fingerprint)
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"data iterator state has an invalid position {position!r}")
        self._position = position


def window_batch_iterator(
    windows: PackedWindows,
    *,
    seed: int,
    global_batch_size: int,
    process_index: int,
    process_count: int,
    fingerprint: dict[str, Any],
) -> BatchIterator:
    """Training iterator over packed windows, shuffled per epoch."""
    order = ShuffledOrder(len(windows), derived_seed(seed, "train-order"))
    return BatchIterator(
        lambda positions: windows.batch(order(positions)),
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        fingerprint={**fingerprint, "num_windows": len(windows), "seed": seed},
    )


def eval_window_batches(
    windows: PackedWindows,
    *,
    global_batch_size: int,
    process_index: int,
    process_count: int,
    max_batches: int,
) -> Iterator[Batch]:
    """Every eval window once, in order; the last batch is filled with masked padding rows.

    `max_batches` > 0 stops after that many batches.
    """
    local = global_batch_size // process_count
    num_batches = -(-len(windows) // global_batch_size)
    if max_batches > 0:
        num_batches = min(num_batches, max_batches)
    for b in range(num_batches):
        start = b * global_batch_size + process_index * local
        ids = np.arange(start, start + local, dtype=np.int64)
        yield windows.batch(np.where(ids < len(windows), ids, -1))
