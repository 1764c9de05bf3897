"""Writing prepared shards: the folder layout every `prepare --format` shares.

`Shards` writes one split's records into numbered ArrayRecord files (`{split}-00000.array_record`,
at most `shard_size` records each, written under a temporary name and renamed when complete);
`input_files` lists the inputs of `--input`, `utf8_text` decodes one (or refuses it in one line),
`is_eval` holds a record out by a hash of its name, and `progress_bar` draws bytes read on stderr.
`MANIFEST` is written last by each format's writer, so a folder with a manifest is complete.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from MaxText.data.errors import DataError, DataNotFoundError
from MaxText.data.text import Document

MANIFEST = "manifest.json"
FORMAT = "maxtext-jaxpp-token-shards"
FORMAT_VERSION = 1
SUFFIXES = (".txt", ".md", ".jsonl")


@dataclasses.dataclass
class Shards:
    """Writes one split's documents into numbered ArrayRecord shards."""

    out: pathlib.Path
    split: str
    shard_size: int
    dtype: np.dtype
    shards: list[dict] = dataclasses.field(default_factory=list)
    _writer: object = None
    _tmp: pathlib.Path | None = None
    _docs: int = 0
    _tokens: int = 0

    def add(self, tokens: np.ndarray) -> None:
        le = self.dtype.newbyteorder("<")
        self.add_record(np.asarray(tokens, self.dtype).astype(le).tobytes(), int(tokens.size))

    def add_record(self, record: bytes, tokens: int) -> None:
        """One record (a document's ids, or a chat example / preference pair: `chat.py`)."""
        from array_record.python.array_record_module import ArrayRecordWriter

        if self._writer is None:
            name = f"{self.split}-{len(self.shards):05d}.array_record"
            self._tmp = self.out / f".{name}.tmp"
            # group_size:1 -> every record is its own chunk: cheap random access by index
            self._writer = ArrayRecordWriter(str(self._tmp), "group_size:1")
            self.shards.append({"file": name, "documents": 0, "tokens": 0})
        self._writer.write(record)
        self._docs += 1
        self._tokens += tokens
        if self._docs == self.shard_size:
            self.close()

    def close(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self.shards[-1].update(documents=self._docs, tokens=self._tokens)
        os.replace(self._tmp, self.out / self.shards[-1]["file"])
        self._writer, self._docs, self._tokens = None, 0, 0

    def summary(self) -> dict:
        return {
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }


def input_files(spec: str) -> list[pathlib.Path]:
    """The `.txt`/`.md`/`.jsonl` files of a folder (recursively) or a glob, sorted."""
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    elif path.is_file():
        files = [path]
    else:
        files = [pathlib.Path(p) for p in glob.glob(str(path), recursive=True)]
        files = [p for p in files if p.is_file() and p.suffix in SUFFIXES]
    if not files:
        raise DataNotFoundError(
            f"--input {spec!r} matches no .txt, .md or .jsonl file; give a folder or a glob"
        )
    return sorted(files)


def utf8_text(raw: bytes, where: str) -> str:
    """`raw` as UTF-8 text; DataError naming `where` for other bytes (a binary or another
    encoding would otherwise be tokenized as replacement characters without a word)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); convert "
            f"it to UTF-8 or leave it out of --input"
        ) from None
    nul = text.find("\0")
    if nul >= 0:
        raise DataError(
            f"{where} looks like a binary file (NUL byte at offset {nul}); leave it out of --input"
        )
    return text


def is_eval(doc: Document, eval_fraction: float) -> bool:
    """Whether `doc` is held out: a hash of its name below `eval_fraction` (order-independent)."""
    if eval_fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(doc.name.encode()).digest()[:8], "little")
    return h / 2**64 < eval_fraction


def progress_bar(files: Sequence[pathlib.Path], desc: str, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in files)
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr)
