"""The safetensors file format, read and written one tensor at a time (no dependency).

A file is an 8-byte little-endian header length N, N bytes of JSON header
(`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`,
offsets relative to the end of the header), then the raw little-endian tensor bytes. A sharded
checkpoint adds `model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map":
{name: file}}`).

`SafetensorsReader` opens one folder (single file or shards) and reads one tensor per call into a
fresh array (a plain `readinto`, so nothing stays mapped and memory is freed with the array).
`SafetensorsWriter` writes tensors as they come: each goes to the current shard file (header
space reserved up front from the names and shapes it is told in advance), a new shard starts when
the next tensor would pass `max_shard_bytes`, and the index is written when there are several.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}
NAMES = {v: k for k, v in DTYPES.items()}
assert sys.byteorder == "little", "safetensors data is little-endian; this host is not"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors folder or file that cannot be read (one line: the file and the problem)."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header without `__metadata__`, byte offset of the data) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise SafetensorsError(f"{path} is not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path} has a damaged JSON header ({e})") from None
    header.pop("__metadata__", None)
    size = path.stat().st_size
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has dtype {entry['dtype']}, not read")
        want = int(np.prod(entry["shape"], dtype=np.int64)) * DTYPES[entry["dtype"]].itemsize
        if end - begin != want or 8 + n + end > size:
            raise SafetensorsError(f"{path}: tensor {name} is truncated or its offsets are wrong")
    return header, 8 + n


class SafetensorsReader:
    """The tensors of a Hugging Face folder (`model.safetensors`, or the shards an index names)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SafetensorsError(f"{index} is not a valid index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.folder / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise SafetensorsError(
                f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                f"checkpoints are read; convert pytorch_model.bin with Hugging Face first)"
            )
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise SafetensorsError(f"{path} is named in {INDEX_FILE} but missing")
            header, data_start = read_header(path)
            for tensor, entry in header.items():
                self._where[tensor] = (path, entry, data_start)

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._where[name][1]["dtype"]]

    def read(self, name: str) -> np.ndarray:
        """One tensor, read into a new array of its stored dtype and shape."""
        path, entry, data_start = self._where[name]
        begin, end = entry["data_offsets"]
        out = np.empty(entry["shape"], DTYPES[entry["dtype"]])
        with open(path, "rb") as f:
            f.seek(data_start + begin)
            got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != end - begin:
            raise SafetensorsError(f"{path}: tensor {name} is truncated")
        return out


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: Sequence[int], max_shard_bytes: int) -> list[int]:
    """The shard index of every tensor (in order): a new shard when the next one would pass
    `max_shard_bytes` (a tensor larger than that gets a shard of its own)."""
    shard, used, out = 0, 0, []
    for size in sizes:
        if used and used + size > max_shard_bytes:
            shard, used = shard + 1, 0
        out.append(shard)
        used += size
    return out


class SafetensorsWriter:
    """Writes the tensors `specs` = [(name, shape, dtype)] in that order, one `write` at a time.

    One `model.safetensors` when everything fits in `max_shard_bytes`, else shards
    `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`. Files are written under
    temporary names and renamed by `close()`, so an interrupted export leaves no file that looks
    complete; after a failure `abort()` closes the open file. A failed write's OSError names the
    file (ENOSPC from `write` names none)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        specs: Sequence[tuple[str, Sequence[int], np.dtype]],
        max_shard_bytes: int,
        metadata: dict[str, str] | None = None,
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._specs = [(n, tuple(int(d) for d in s), np.dtype(t)) for n, s, t in specs]
        sizes = [int(np.prod(s, dtype=np.int64)) * t.itemsize for _, s, t in self._specs]
        self._shard_of = plan_shards(sizes, max_shard_bytes)
        count = self._shard_of[-1] + 1 if self._specs else 1
        self.files = [SINGLE_FILE] if count == 1 else [_shard_name(i, count) for i in range(count)]
        self._headers = [{"__metadata__": dict(metadata or {"format": "pt"})} for _ in range(count)]
        offsets = [0] * count
        self._order = {}
        for (name, shape, dtype), size, shard in zip(self._specs, sizes, self._shard_of):
            self._headers[shard][name] = {
                "dtype": NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offsets[shard], offsets[shard] + size],
            }
            offsets[shard] += size
            self._order[name] = shard
        self.total_size = sum(sizes)
        self._next = 0
        self._handle = None
        self._shard = -1

    def _path(self) -> Path:
        return self.folder / (self.files[self._shard] + ".tmp")

    def _open(self, shard: int) -> None:
        self._close_file()
        text = json.dumps(self._headers[shard], separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data aligned to 8 bytes, as the reference writer does
        self._shard = shard
        with self._naming_the_file():
            self._handle = open(self._path(), "wb")
            self._handle.write(struct.pack("<Q", len(text)) + text)

    @contextlib.contextmanager
    def _naming_the_file(self):
        """An OSError of a write (which names no file: ENOSPC, EIO) names the shard's."""
        try:
            yield
        except OSError as e:
            if e.filename is None and e.errno:
                raise OSError(e.errno, e.strerror, str(self._path())) from e
            raise

    def _close_file(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            with self._naming_the_file():
                handle.close()

    def abort(self) -> None:
        """Closes the open file after a failure (its partial contents are the caller's to
        remove); never raises."""
        handle, self._handle = self._handle, None
        if handle is not None:
            with contextlib.suppress(OSError):
                handle.close()

    def write(self, name: str, array: np.ndarray) -> None:
        want_name, shape, dtype = self._specs[self._next]
        if name != want_name or tuple(array.shape) != shape or array.dtype != dtype:
            raise AssertionError(
                f"tensor {self._next} should be {want_name} {shape} {dtype}, "
                f"got {name} {array.shape} {array.dtype}"
            )
        shard = self._shard_of[self._next]
        if shard != self._shard:
            self._open(shard)
        data = np.ascontiguousarray(array)  # the machine's byte order is little-endian (checked)
        with self._naming_the_file():
            self._handle.write(memoryview(data.reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> list[str]:
        """Finishes the files (and the index when sharded); returns the file names written."""
        if self._next != len(self._specs):
            raise AssertionError(f"{len(self._specs) - self._next} tensors were not written")
        self._close_file()
        for name in self.files:
            os.replace(self.folder / (name + ".tmp"), self.folder / name)
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total_size},
                "weight_map": {n: self.files[s] for n, s in sorted(self._order.items())},
            }
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        elif (self.folder / INDEX_FILE).exists():
            (self.folder / INDEX_FILE).unlink()  # a stale index from an earlier sharded export
        return list(self.files)
