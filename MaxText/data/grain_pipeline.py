"""dataset_type=grain: grain datasets over prepared ArrayRecord shards, packed, with exact resume.

Reads the shards written by `python -m MaxText.data.prepare` (`grain_train_files`,
`grain_eval_files`: globs; the folder's manifest.json gives the token dtype and the tokenizer).

Training pipeline, per process (grain `MapDataset`s, nothing read ahead of need):

    ArrayRecord records --[process_index::process_count]--> this process's documents
      --shuffle(data_shuffle_seed), repeat--> an endless, per-epoch reshuffled document order
      --batch(K documents)--> packing windows --map(pack_rows)--> rows of each window
      --to_iter_dataset, mp_prefetch(grain_worker_count)--> windows read, decoded and packed in
      worker processes --> the trainer's process cuts consecutive rows into local batches

Each process reads only its own documents (rows `process_index::process_count` of the shards)
and yields `global_batch_size / process_count` rows per batch; the trainer assembles the global
batch from the processes' rows. Under pipelining every process feeds the whole batch
(`Config.process_count` is 1 there), so each reads every document.

Packing windows: window w is documents `[w*K, (w+1)*K)` of the shuffled order, packed on their own
(`doc_packing.pack_rows`). K is chosen from the manifest so that a window holds about
`WINDOW_ROWS` rows (K = 1 for documents longer than that), which bounds the memory of a worker by
one window, whatever the dataset size. Because a window's rows depend only on its index, the
iterator's state is two integers, (window, row within it), and resuming rebuilds the grain
pipeline at that window: the batches after a resume are bitwise those of an uninterrupted run,
with any `grain_worker_count` (grain's prefetch keeps element order whatever the worker count), so
a checkpoint also resumes with a different worker count. A different process count or data
changes the stream; `set_state` rejects a state whose fingerprint differs.

Chat and preference shards (`prepare --format chat|preference`, the manifest's `kind`) hold
(ids, loss mask) records, or pairs of them; `Packer` packs a window of them with
`doc_packing.pack_examples` / `pack_pairs` (masks kept, never split, pairs in adjacent rows) and
the rows also carry `doc_packing.COUNT_KEYS` (examples cut to fit, or left out).

Evaluation reads every held-out document in file order on every process (no shuffle, in the
trainer's process), packs them the same way, and gives process p rows `[p*B/P, (p+1)*B/P)` of
each global batch, so every process runs the same number of eval batches; the last batch is
filled with all-padding rows.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from MaxText.data import chat as chat_lib
from MaxText.data import doc_packing
from MaxText.data import iterator as iterator_lib
from MaxText.data import prepare as prepare_lib
from MaxText.data.errors import DataError, DataNotFoundError
from MaxText.exit_codes import first_line

STATE_VERSION = 1
ENDLESS_DOCUMENTS = 2**40
WINDOW_ROWS = 64  # target rows per packing window (a worker's unit of work and memory)
# Read-ahead of packed windows per process (the trainer's, or each worker's): one thread, two
# windows. grain's default (16 threads, 500 elements) packed up to 500 windows ahead of need: CPU
# burnt on rows never trained on (a third of a core per idle worker, ~1 s of CPU per iterator
# start on the tests' small sets) and up to 500 windows of memory, not one.
READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)


class TokenShards:
    """The shards a glob names, and their folder's manifest."""

    def __init__(self, pattern: str, key: str):
        self.pattern, self.key = pattern, key
        files = sorted(glob.glob(str(pathlib.Path(pattern).expanduser()), recursive=True))
        files = [f for f in files if f.endswith(".array_record")]
        if not files:
            raise DataNotFoundError(
                f"{key}={pattern!r} matches no .array_record file; write shards with "
                "python -m MaxText.data.prepare --input ... --out DIR (then use DIR/train-*)"
            )
        folders = {str(pathlib.Path(f).parent) for f in files}
        if len(folders) > 1:
            raise DataError(
                f"{key}={pattern!r} matches shards in {len(folders)} folders; each prepared folder "
                "has its own tokenizer, so use shards of one folder"
            )
        self.files = files
        self.folder = pathlib.Path(folders.pop())
        manifest_path = self.folder / prepare_lib.MANIFEST
        if not manifest_path.is_file():
            raise DataNotFoundError(
                f"{key}={pattern!r}: {manifest_path} is missing; the folder was not (completely) "
                "written by python -m MaxText.data.prepare"
            )
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != prepare_lib.FORMAT:
            raise DataError(f"{manifest_path} is not a {prepare_lib.FORMAT} manifest")
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        known = {
            s["file"]: s for split in self.manifest["splits"].values() for s in split["shards"]
        }
        names = [pathlib.Path(f).name for f in files]
        self.documents = sum(known[n]["documents"] for n in names if n in known)
        self.tokens = sum(known[n]["tokens"] for n in names if n in known)
        self.records = [
            check_shard(f, known.get(n, {}).get("documents"))
            for f, n in zip(files, names, strict=True)
        ]

    @property
    def tokenizer_path(self) -> pathlib.Path:
        return self.folder / self.manifest["tokenizer"]

    @property
    def tokenizer_type(self) -> str:
        return self.manifest.get("tokenizer_type", "sentencepiece")

    @property
    def kind(self) -> str:
        """text (documents), chat (examples with loss masks) or preference (pairs)."""
        return self.manifest.get("kind", "text")

    def source(self) -> CheckedSource:
        return CheckedSource(self.files, self.records)

    def documents_per_window(self, seq_len: int) -> int:
        mean = self.tokens / max(self.documents, 1)
        return max(1, int(WINDOW_ROWS * seq_len / max(mean, 1.0)))


def _reread_hint(path: str) -> str:
    return (
        f"the shard is damaged or not an ArrayRecord file: write {pathlib.Path(path).parent} "
        f"again with python -m MaxText.data.prepare"
    )


def check_shard(path: str, documents: int | None) -> int:
    """Opens shard `path` and returns its record count; DataError naming the file when it is not
    a readable ArrayRecord file or holds another count than the manifest's `documents`.

    Opening reads the file's footer and index only: a truncated file or one of other bytes shows
    here (ArrayRecord then finds 0 records), before anything is compiled. Damage inside a chunk
    is found when the chunk is read (`CheckedSource`).
    """
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(path)
        try:
            count = reader.num_records()
        finally:
            reader.close()
    except (RuntimeError, ValueError, OSError) as e:
        raise DataError(f"{path}: cannot open ({first_line(e)}); {_reread_hint(path)}") from None
    if documents is not None and count != documents:
        raise DataError(
            f"{path} holds {count} records, its manifest says {documents}; {_reread_hint(path)}"
        )
    return count


class CheckedSource:
    """grain's ArrayRecord source over `files`, whose read errors name the shard and record.

    Riegeli (ArrayRecord's format) hashes every chunk, so altered bytes fail the read with
    "Corrupted Riegeli/records file: chunk header hash mismatch"; this turns that into a
    `DataError` naming the file (in a grain worker too: the parent re-raises it). Picklable:
    workers open their own readers.
    """

    def __init__(self, files: list[str], records: list[int]):
        self.files = list(files)
        self.starts = np.cumsum([0, *records]).tolist()
        self._source = None

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "starts": self.starts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.files, self.starts, self._source = state["files"], state["starts"], None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> bytes:
        if self._source is None:
            self._source = grain.sources.ArrayRecordDataSource(self.files)
        try:
            return self._source[index]
        except (RuntimeError, ValueError, OSError) as e:
            shard = int(np.searchsorted(self.starts, index, side="right")) - 1
            path = self.files[max(0, min(shard, len(self.files) - 1))]
            record = index - self.starts[max(0, shard)]
            raise DataError(
                f"{path}: record {record} is unreadable ({first_line(e)}); {_reread_hint(path)}"
            ) from None


class _Decode:
    """ArrayRecord bytes -> int32 token ids, or for chat / preference shards (ids, mask) / a pair
    of them (`chat.py`). A picklable callable, so it runs in grain workers."""

    def __init__(self, dtype: np.dtype, kind: str = "text"):
        self.dtype, self.kind = dtype, kind

    def __call__(self, record: bytes):
        if self.kind == "chat":
            return chat_lib.decode_example(record, self.dtype)
        if self.kind == "preference":
            return chat_lib.decode_pair(record, self.dtype)
        return np.frombuffer(record, self.dtype).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Packer:
    """A window of records -> its packed rows (picklable; runs in grain workers): documents by
    `pack_rows`, chat examples by `pack_examples`, preference pairs by `pack_pairs`."""

    seq_len: int
    packing: bool
    pad_id: int
    kind: str = "text"
    truncation: str = "right"
    completion_only: bool = True

    def __call__(self, records: list) -> dict[str, np.ndarray]:
        if self.kind == "chat":
            return doc_packing.pack_examples(
                records,
                self.seq_len,
                packing=self.packing,
                pad_id=self.pad_id,
                truncation=self.truncation,
                completion_only=self.completion_only,
            )
        if self.kind == "preference":
            return doc_packing.pack_pairs(
                records, self.seq_len, pad_id=self.pad_id, truncation=self.truncation
            )
        return doc_packing.pack_rows(
            records, self.seq_len, packing=self.packing, pad_id=self.pad_id
        )

    @property
    def keys(self) -> tuple[str, ...]:
        counts = doc_packing.COUNT_KEYS if self.kind != "text" else ()
        return (*doc_packing.ROW_KEYS, *counts)


def train_windows(
    shards: TokenShards,
    *,
    packer: Packer,
    seed: int,
    process_index: int,
    process_count: int,
    documents_per_window: int,
) -> grain.MapDataset:
    """The endless MapDataset of packed windows of this process's shuffled documents."""
    docs = grain.MapDataset.source(shards.source())[process_index::process_count]
    if len(docs) == 0:
        raise DataError(
            f"grain_train_files={shards.pattern!r} has {shards.documents} documents, fewer than "
            f"the {process_count} processes reading them; prepare more data or use fewer processes"
        )
    # "Endless": 2**40 documents (grain's slicing needs a length that fits an index).
    epochs = max(1, ENDLESS_DOCUMENTS // len(docs))
    docs = docs.shuffle(seed=seed).repeat(epochs).map(_Decode(shards.dtype, shards.kind))
    return docs.batch(documents_per_window, batch_fn=list).map(packer)


def _worker_init(_index: int, _count: int) -> None:
    """Runs first in each grain worker process. The trainer's signals are the trainer's: a Ctrl-C
    or a scheduler's SIGTERM reaches the whole process group, and a worker that died of it would
    print a traceback and leave shared memory behind. Workers ignore SIGINT and SIGTERM; the
    trainer stops them by closing its iterator (grain sets their stop event, then kills what is
    still alive). Should the trainer die without closing them (SIGKILL), a watcher thread ends
    the worker once its parent is gone, so none is left running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _finish_shared_memory_deletions() -> None:
    """Waits for the unlinking of the shared memory of batches already read. grain hands a
    worker's batch over in shared memory and unlinks it, once read, on a background thread;
    a process that exits right after closing its iterator (a second Ctrl-C ends with
    `os._exit`) would leave what that thread had not done yet to multiprocessing's resource
    tracker, which unlinks it and warns of "leaked shared_memory objects". The thread pool has no
    public name in grain 0.2.18, hence the guards; grain starts a new one with the next worker."""
    try:
        from grain._src.python.ipc.shared_memory_array import SharedMemoryArray
    except ImportError:
        return
    pool = getattr(SharedMemoryArray, "_del_thread_pool", None)
    disable = getattr(SharedMemoryArray, "_disable_async_del", None)
    if pool is None or disable is None:
        return
    disable()  # batches released from now on are unlinked at once, by whoever releases them
    pool.close()
    pool.join()


def _absl_flags_parsed() -> None:
    """grain's worker processes read absl flags (their defaults here): mark them parsed, as an
    absl app would, when the trainer was not started through absl."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class GrainBatchIterator(Iterator[dict[str, np.ndarray]]):
    """This process's batches of packed rows, with get_state / set_state (see the module doc)."""

    def __init__(
        self,
        windows: grain.MapDataset,
        *,
        local_batch_size: int,
        worker_count: int,
        fingerprint: dict[str, Any],
    ):
        self._windows = windows
        self.local_batch_size = local_batch_size
        self.worker_count = worker_count
        self._fingerprint = dict(fingerprint)
        self._window = 0  # window of the next row to yield
        self._row = 0  # its row within that window
        self._it: Iterator | None = None  # grain iterator positioned at the window after _rows
        self._rows: dict[str, np.ndarray] | None = None  # rows of window _window, once fetched

    def __iter__(self) -> GrainBatchIterator:
        return self

    def _start(self) -> None:
        ds = self._windows[self._window :].to_iter_dataset(READ_OPTIONS)
        if self.worker_count > 0:
            _absl_flags_parsed()
            ds = ds.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=self.worker_count),
                worker_init_fn=_worker_init,
            )
        self._close()
        self._it = iter(ds)

    def _close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
            _finish_shared_memory_deletions()
        self._it = None

    def __next__(self) -> dict[str, np.ndarray]:
        parts: list[dict[str, np.ndarray]] = []
        need = self.local_batch_size
        while need:
            if self._rows is None:
                if self._it is None:
                    self._start()
                # a private copy: the worker's shared-memory buffer is released right away
                self._rows = {k: np.array(v) for k, v in next(self._it).items()}
            available = self._rows["inputs"].shape[0] - self._row
            take = min(need, available)
            if take:
                parts.append({k: v[self._row : self._row + take] for k, v in self._rows.items()})
            need -= take
            self._row += take
            if self._row == self._rows["inputs"].shape[0]:
                self._window, self._row, self._rows = self._window + 1, 0, None
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self) -> dict[str, Any]:
        """The position (window, row) of the next row; JSON-serializable."""
        return {
            "version": STATE_VERSION,
            "window": self._window,
            "row": self._row,
            "fingerprint": dict(self._fingerprint),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues exactly at `state` (from `get_state`); ValueError if it is other data's."""
        if state.get("version") != STATE_VERSION or "window" not in state:
            raise ValueError(
                "the saved data iterator state is not a dataset_type=grain state of this version; "
                "resume with the data options the checkpoint was written with"
            )
        iterator_lib.check_fingerprint(state, self._fingerprint)
        self._close()
        self._window, self._row, self._rows = int(state["window"]), int(state["row"]), None

    def close(self) -> None:
        """Stops the worker processes (they also stop when the iterator is garbage-collected)."""
        self._close()


def eval_batches(
    shards: TokenShards,
    *,
    packer: Packer,
    global_batch_size: int,
    process_index: int,
    process_count: int,
    max_batches: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Every held-out document once, in file order (see the module doc)."""
    docs = grain.MapDataset.source(shards.source()).map(_Decode(shards.dtype, shards.kind))
    k = shards.documents_per_window(packer.seq_len)
    windows = docs.batch(k, batch_fn=list).map(packer)
    local = global_batch_size // process_count
    lo, hi = process_index * local, (process_index + 1) * local
    pending: list[dict[str, np.ndarray]] = []
    count, produced = 0, 0

    def emit() -> dict[str, np.ndarray]:
        rows = {key: np.concatenate([p[key] for p in pending]) for key in pending[0]}
        fill = global_batch_size - rows["inputs"].shape[0]
        if fill:
            pad = doc_packing.empty_rows(fill, packer.seq_len, packer.pad_id, packer.keys)
            rows = {key: np.concatenate([rows[key], pad[key]]) for key in rows}
        return {key: v[lo:hi] for key, v in rows.items()}

    for window in windows:
        start = 0
        n = window["inputs"].shape[0]
        while start < n:
            take = min(global_batch_size - count, n - start)
            pending.append({key: v[start : start + take] for key, v in window.items()})
            count += take
            start += take
            if count == global_batch_size:
                yield emit()
                pending, count, produced = [], 0, produced + 1
                if 0 < max_batches <= produced:
                    return
    if pending:
        yield emit()
