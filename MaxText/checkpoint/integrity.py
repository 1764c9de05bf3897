"""Damaged or unavailable checkpoints: what tells them apart, checksums, and the early reads.

Two kinds of read failure, handled differently (`classify`):

- **damaged** — the stored bytes are wrong: a missing or truncated file, a file that does not
  decode (invalid JSON, tensorstore's OUT_OF_RANGE / DATA_LOSS / NOT_FOUND), a checksum that does
  not match. The checkpoint is skipped, moved to `checkpoints_corrupt/`, and the previous one is
  used (the recovery after `kill -9` relies on this).
- **unavailable** — the storage cannot be read right now: permission denied, EIO, ENOSPC, a
  stale handle, tensorstore's PERMISSION_DENIED / UNAVAILABLE / RESOURCE_EXHAUSTED /
  DEADLINE_EXCEEDED, or any other OS error. The bytes may be fine, so nothing is moved: the run
  stops with one line naming the file and the errno (`CheckpointUnavailableError`).

Any other exception while restoring is a bug in the code and propagates with its traceback.

**Checksums.** Every checkpoint records, in `checksums.json` at the top of its step folder, the
size and CRC-32 of each of its files but `UNCHECKED` (`record_checksums`, run by the save's
background thread after orbax has written every item and before it makes the step visible, so a
complete checkpoint always has its record). `verify_checksums` reads every file back before a
restore and raises `UnreadableCheckpointError` naming the first file whose size or checksum
differs, so a flipped byte in a same-size file counts as damage. A checkpoint without a record
(written before this version) is checked by reading every stored array chunk instead
(`verify_arrays`). Under several processes the primary process records the checksums (after
orbax's barrier, so it reads every process's files once; files are read on up to 8 threads) and
every process verifies them before it restores.
`check_files` parses the metadata files first, so damage shows as one line instead of orbax's
asyncio tracebacks. `check_before_reading` runs these checks on a checkpoint that is read as it is
(a converted parameters-only checkpoint, a step being exported): there is no older one to fall
back to, so damage is one `checkpoint error:` line naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from MaxText.errors import CheckpointError, StorageError

CHECKSUMS = "checksums.json"
# orbax rewrites its step metadata (commit time) after the checksums are recorded, and writes
# `commit_success.txt` on storage without atomic rename: both are left out (the metadata file is
# still parsed by `check_files`)
UNCHECKED = ("_CHECKPOINT_METADATA", "commit_success.txt")
CHECKSUM_FORMAT = "crc32-v1"
_CHUNK = 8 << 20  # bytes read at a time (zlib releases the GIL on large buffers)

DAMAGED = "damaged"
UNAVAILABLE = "unavailable"


class UnreadableCheckpointError(Exception):
    """A checkpoint's files are missing or damaged (found by the pre-reads below)."""


class CheckpointUnavailableError(StorageError):
    """A checkpoint could not be read for a storage reason that is not damage (one line)."""


# tensorstore reports read and decode failures as ValueError("<absl status>: ..."). INVALID_ARGUMENT
# / INTERNAL / UNKNOWN are left out on purpose: they also come from wrong arguments (a bug).
_DAMAGE_STATUSES = ("OUT_OF_RANGE", "DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION")
_UNAVAILABLE_STATUSES = (
    "PERMISSION_DENIED",
    "UNAVAILABLE",
    "RESOURCE_EXHAUSTED",
    "DEADLINE_EXCEEDED",
    "ABORTED",
)
_STATUS = re.compile(r"^([A-Z_]+): ")
_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")
# An OS error that says the file is not there: damage (a checkpoint missing a file is broken).
_MISSING = (errno.ENOENT, errno.ENOTDIR)


def _classify_one(e: BaseException) -> str | None:
    if isinstance(e, UnreadableCheckpointError | UnicodeDecodeError | json.JSONDecodeError):
        return DAMAGED
    if isinstance(e, OSError):
        return DAMAGED if e.errno in _MISSING else UNAVAILABLE
    if type(e) is ValueError:
        text = str(e)
        status = _STATUS.match(text)
        if status is None:
            return None
        code = _OS_ERROR_CODE.search(text)
        if code is not None:  # tensorstore names the OS error: decide by it
            return DAMAGED if int(code.group(1)) in _MISSING else UNAVAILABLE
        if status.group(1) in _DAMAGE_STATUSES:
            return DAMAGED
        if status.group(1) in _UNAVAILABLE_STATUSES:
            return UNAVAILABLE
    return None


def classify(e: BaseException) -> str | None:
    """DAMAGED, UNAVAILABLE, or None (a bug) for an exception raised while reading a checkpoint.

    orbax wraps tensorstore's error in a bare `Exception` ("Encountered error while reading array
    index"), so the chain of causes is searched; an unavailability anywhere in it wins.
    """
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        kind = _classify_one(e)
        if kind == UNAVAILABLE:
            return UNAVAILABLE
        found = found or kind
        e = e.__cause__ or e.__context__
    return found


def is_storage_error(e: BaseException) -> bool:
    """True when `e` says the stored files are damaged or unavailable (not a bug)."""
    return classify(e) is not None


def check_files(step_dir: Path, json_items: Sequence[str], state: bool) -> None:
    """Raises UnreadableCheckpointError naming the first required file of `step_dir` that is
    missing or the first metadata file that is not valid JSON.

    orbax itself tolerates an unreadable `_CHECKPOINT_METADATA`; a truncated one still means the
    checkpoint was damaged, so it is treated like any other corrupt file. A missing `_METADATA`
    or item folder makes orbax fail with a tree-structure `ValueError` or a `KeyError`, which
    look like bugs, so their presence is checked here first. An OS error reading a file
    propagates as it is (`classify` decides).
    """
    required = [f"{name}/metadata" for name in json_items]
    if state:
        required += ["state/_METADATA", "state/manifest.ocdbt"]
    for name in required:
        if not (step_dir / name).is_file():
            raise UnreadableCheckpointError(f"{name} is missing")
    for path in sorted(step_dir.rglob("*")):
        if not path.is_file():
            continue
        name = path.name
        is_json = name in ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata") or (
            path.parent.name == "array_metadatas"
        )
        if is_json:
            try:
                json.loads(path.read_bytes())
            except (ValueError, UnicodeDecodeError) as e:
                raise UnreadableCheckpointError(
                    f"{path.relative_to(step_dir)} is not valid JSON ({e})"
                ) from None


def verify_arrays(state_dir: Path, prefix: str = "") -> None:
    """Reads every stored chunk under `prefix` of an OCDBT `state` item once; raises on damage.

    A truncated or missing data file fails here with tensorstore's one-line error (e.g.
    `OUT_OF_RANGE: Requested byte range ... is not valid`). orbax would fail as well, but from
    inside its asyncio reads, leaving hundreds of "Event loop is closed" tracebacks on stderr,
    so damaged checkpoints are caught before orbax reads them. Costs one extra read of the
    compressed bytes (page-cached for the restore that follows).
    """
    if not (state_dir / "manifest.ocdbt").is_file():
        return  # not an OCDBT item: leave the checks to orbax
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir.absolute()}/"}).result()
    keys = [k for k in kv.list().result() if k.startswith(prefix.encode())]
    if not keys:
        raise UnreadableCheckpointError(f"{state_dir.name} holds no arrays under '{prefix}'")
    for read in [kv.read(k) for k in keys]:
        read.result()


# ------------------------------------------------------------------------------------ checksums


def _crc32(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _files(step_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(step_dir))
        for p in step_dir.rglob("*")
        if p.is_file()
        and p.name not in (CHECKSUMS, *UNCHECKED)
        and not p.name.startswith(f".{CHECKSUMS}")
    )


def _sums(step_dir: Path, names: Sequence[str]) -> list[tuple[int, int]]:
    threads = max(1, min(8, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda n: _crc32(step_dir / n), names))


def record_checksums(step_dir: Path) -> int:
    """Writes `checksums.json` (size and CRC-32 of every file) into `step_dir`; returns the bytes
    read. Written under a temporary name and renamed, so a record is complete or absent."""
    names = _files(step_dir)
    sums = _sums(step_dir, names)
    record = {
        "format": CHECKSUM_FORMAT,
        "files": {n: {"size": s, "crc32": c} for n, (s, c) in zip(names, sums, strict=True)},
    }
    tmp = step_dir / f".{CHECKSUMS}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / CHECKSUMS)
    return sum(s for s, _ in sums)


def verify_checksums(step_dir: Path) -> bool:
    """Checks every recorded file of `step_dir`; False when the checkpoint has no record.

    Raises UnreadableCheckpointError naming the first file that is missing, of another size, or
    whose CRC-32 differs; an OS error reading a file propagates (`classify`: unavailable).
    """
    path = step_dir / CHECKSUMS
    if not path.is_file():
        return False
    try:
        record = json.loads(path.read_bytes())
        files = record["files"]
        if record.get("format") != CHECKSUM_FORMAT:
            raise ValueError(f"unknown format {record.get('format')!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise UnreadableCheckpointError(f"{CHECKSUMS} is not a valid record ({e})") from None
    names = sorted(files)
    for name in names:
        if not (step_dir / name).is_file():
            raise UnreadableCheckpointError(f"{name} is missing (listed in {CHECKSUMS})")
    for name, (size, crc) in zip(names, _sums(step_dir, names), strict=True):
        want = files[name]
        if size != want["size"]:
            raise UnreadableCheckpointError(
                f"{name} has {size} bytes, {want['size']} when written ({CHECKSUMS})"
            )
        if crc != want["crc32"]:
            raise UnreadableCheckpointError(
                f"{name} does not match its checksum (crc32 {crc:08x}, {want['crc32']:08x} when "
                f"written)"
            )
    return True


def check_before_reading(step_dir: Path, item: str, advice: str) -> None:
    """Checks the files of a checkpoint that is read as it is (not one of a run's checkpoints,
    which `restore.py` skips when damaged): against its `checksums.json`, or, without a record,
    its metadata files parsed and every stored chunk of `item` read once. Damage raises one
    `CheckpointError` line naming the file and ending with `advice`; a storage failure that is
    not damage one `CheckpointUnavailableError` line; anything else (a bug) propagates."""
    try:
        if not verify_checksums(step_dir):
            check_files(step_dir, (), state=False)
            verify_arrays(step_dir / item)
    except Exception as e:  # noqa: BLE001 (storage errors only, see classify)
        kind = classify(e)
        if kind is None:
            raise
        if kind == UNAVAILABLE:
            raise CheckpointUnavailableError(
                f"cannot read checkpoint {step_dir}: {describe_failure(e)}; it is not damaged: "
                f"fix the storage or its permissions and run again"
            ) from None
        what = str(e) if isinstance(e, UnreadableCheckpointError) else first_cause_line(e)
        raise CheckpointError(f"checkpoint {step_dir} is damaged: {what}; {advice}") from None


_QUOTED_PATH = re.compile(r'"(/[^"]+)"')


def describe_failure(e: BaseException, where: Any = None) -> str:
    """`No space left on device (ENOSPC) at /path/file` for a storage error (else its first line).

    The errno comes from an `OSError` in the chain of causes or from tensorstore's
    `[os_error_code='N']`; the path from `OSError.filename` or the last quoted path in
    tensorstore's message, else `where` (what was being read or written).
    """
    first, seen = e, set()
    code = path = None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            code, path = code or e.errno, path or e.filename
        elif type(e) is ValueError:
            found = _OS_ERROR_CODE.search(str(e))
            if found is not None:
                paths = _QUOTED_PATH.findall(str(e))
                code, path = code or int(found.group(1)), path or (paths[-1] if paths else None)
        e = e.__cause__ or e.__context__
    if code is None:
        return first_cause_line(first)
    return _errno_text(code, path or where)


def _errno_text(code: int, path: Any) -> str:
    name = errno.errorcode.get(code, str(code))
    return f"{os.strerror(code)} ({name})" + (f" at {path}" if path else "")


def first_cause_line(e: BaseException, limit: int = 300) -> str:
    """One line about a read failure: the innermost cause (tensorstore's own words)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:limit]}"
