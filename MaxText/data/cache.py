"""On-disk caches of the data pipeline: where they live and how files are published safely.

Location: `{base_output_directory}/data_cache/` when the config has a non-empty
`base_output_directory`, else `~/.cache/maxtext_jaxpp/data_cache/`. Runs that share an output
directory share trained tokenizers and token arrays; every cache file name carries a content
hash of everything it was derived from (corpus text, tokenizer model, split fraction, format
version), so a change of any input makes a new file instead of reusing a stale one. Deleting the
folder is always safe.

Files are published atomically: written to a temporary file in the same folder, then linked into
place. If another process published the same name first, its file is kept and used, so several
processes of one run that race to build a cache all end up reading the same bytes.
"""

from __future__ import annotations

import io
import os
import pathlib
import tempfile

import numpy as np

CACHE_SUBDIR = "data_cache"


def cache_dir(base_output_directory: str) -> pathlib.Path:
    """The data cache folder for a run writing under `base_output_directory` (created)."""
    if base_output_directory:
        root = pathlib.Path(base_output_directory).expanduser() / CACHE_SUBDIR
    else:
        root = pathlib.Path.home() / ".cache" / "maxtext_jaxpp" / CACHE_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    return root


def publish_bytes(path: pathlib.Path, data: bytes) -> pathlib.Path:
    """Writes `data` to `path` atomically unless `path` already exists; returns `path`.

    The first writer wins: a concurrent writer of the same (content-addressed) name finds the
    file present and leaves it alone.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; caches are meant to be shared
        try:
            os.link(tmp, path)  # fails if the name exists: never replaces a published file
        except FileExistsError:
            pass
        except OSError:  # filesystems without hard links
            if not path.exists():
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def publish_npy(path: pathlib.Path, array: np.ndarray) -> pathlib.Path:
    """Saves `array` as an .npy file at `path` atomically (see `publish_bytes`)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return publish_bytes(path, buf.getvalue())


def load_npy(path: pathlib.Path) -> np.ndarray:
    """Loads an .npy cache file (memory-mapped read-only: processes share the page cache)."""
    return np.load(path, mmap_mode="r", allow_pickle=False)
