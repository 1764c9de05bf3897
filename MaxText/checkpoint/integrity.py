"""Damaged checkpoints: what marks a checkpoint unreadable, and the reads that find it early.

A checkpoint is skipped (and moved to `checkpoints_corrupt/`) only for storage and decoding
errors (`is_storage_error`); any other error while restoring is a bug in the code and stops the
run with its traceback, moving nothing. `check_files` and `verify_arrays` read a step's files
before orbax does, so damage shows as one line instead of orbax's asyncio tracebacks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path


class UnreadableCheckpointError(Exception):
    """A checkpoint's files are missing or damaged (found by the pre-reads below)."""


# tensorstore reports read and decode failures as ValueError("<absl status>: ..."); these statuses
# mean the stored bytes are missing, short or undecodable. INVALID_ARGUMENT / INTERNAL / UNKNOWN
# are left out on purpose: they also come from wrong arguments, i.e. from a bug in the caller.
_STORAGE_STATUSES = re.compile(
    r"^(OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|FAILED_PRECONDITION|PERMISSION_DENIED|UNAVAILABLE): "
)


def is_storage_error(e: BaseException) -> bool:
    """True when `e` (or an exception it was raised from) says the stored files are unreadable.

    Storage/decoding errors: `UnreadableCheckpointError` (our pre-reads), `OSError` (a missing,
    short or unreadable file), `json.JSONDecodeError` / `UnicodeDecodeError` (a damaged metadata
    file), tensorstore's `ValueError` with a read/decode status (see `_STORAGE_STATUSES`). orbax
    wraps tensorstore's error in a bare `Exception` ("Encountered error while reading array
    index"), so the chain of causes is searched. Anything else (TypeError, AttributeError, a
    structure mismatch, ...) is a bug and must not mark a checkpoint unreadable.
    """
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UnreadableCheckpointError | OSError | UnicodeDecodeError):
            return True
        if isinstance(e, json.JSONDecodeError):
            return True
        if type(e) is ValueError and _STORAGE_STATUSES.match(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def check_files(step_dir: Path, json_items: Sequence[str], state: bool) -> None:
    """Raises UnreadableCheckpointError naming the first required file of `step_dir` that is
    missing or the first metadata file that is not valid JSON.

    orbax itself tolerates an unreadable `_CHECKPOINT_METADATA`; a truncated one still means the
    checkpoint was damaged, so it is treated like any other corrupt file. A missing `_METADATA`
    or item folder makes orbax fail with a tree-structure `ValueError` or a `KeyError`, which
    look like bugs, so their presence is checked here first.
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
                json.loads(path.read_text())
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


def first_cause_line(e: BaseException, limit: int = 300) -> str:
    """One line about a read failure: the innermost cause (tensorstore's own words)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:limit]}"
