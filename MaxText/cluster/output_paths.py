"""Paths a run writes or reads, probed before anything is compiled.

A run that cannot write its checkpoints should say so in its first second, not after a compile
of minutes and the steps up to its first save. `writable_dir` creates a folder (and its parents)
and proves that a file can be created, written and removed in it; `writable_file` does the same
for the folder a file goes to (and refuses a folder or an unwritable file at that path);
`readable_dir` checks an input folder. `creatable_dir` proves the same as `writable_dir` without
creating anything (the converters refuse bad input before they make their output folder), and
`make_dirs` / `remove_made` create an output folder and take back exactly what was made when the
write fails. Each failure is a `PathError` with one line naming the
setting, the path, the operating system's reason with its errno name, and what to do, e.g.

    base_output_directory=/proc/x: cannot create folder /proc/x/run (No such file or directory,
    ENOENT); use a folder you can write to

`train.py` probes its output folder, checkpoint folder, metrics file, TensorBoard folder,
`jax_cache_dir` and `load_parameters_path` (`check_run_paths`); `python -m MaxText.plan` its
`--json` file and `python -m MaxText.data.prepare` its `--out` folder. Several processes: each
probes the folders every process writes (a shared filesystem must be writable from every host);
the metrics file and TensorBoard folder only on process 0, which writes them.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from MaxText.errors import PathError


def os_reason(e: OSError) -> str:
    """`No space left on device, ENOSPC` (the message and the errno's name)."""
    name = errno.errorcode.get(e.errno or 0, "")
    text = e.strerror or type(e).__name__
    return f"{text}, {name}" if name else text


def _fail(key: str, path: Path, what: str, e: OSError | str) -> PathError:
    reason = os_reason(e) if isinstance(e, OSError) else e
    return PathError(f"{key}={path}: {what} ({reason}); use a folder you can write to")


def writable_dir(path: str | os.PathLike, key: str, shown: Path | None = None) -> Path:
    """Creates folder `path` if needed and proves it writable; `key` names the setting (whose
    value is `shown`, by default `path`)."""
    path = Path(path).expanduser()
    shown = shown or path
    if path.exists() and not path.is_dir():
        raise PathError(f"{key}={shown}: {path} is a file, not a folder; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _fail(key, shown, f"cannot create folder {path}", e) from None
    probe = path / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as e:
        raise _fail(key, shown, f"cannot write in {path}", e) from None
    return path


def creatable_dir(path: str | os.PathLike, key: str) -> Path:
    """`path` is a folder, or can be made one, where files can be written; nothing is created:
    the probe runs in `path` or, when it does not exist yet, in its nearest existing ancestor
    (which must be a folder). For tools that must refuse bad input before they write anything."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise PathError(f"{key}={path}: {path} is a file, not a folder; give a folder")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _fail(key, path, f"cannot create folder {path}", f"{ancestor} is a file")
    probe = ancestor / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as e:
        what = f"cannot write in {path}" if ancestor == path else f"cannot create folder {path}"
        raise _fail(key, path, what, e) from None
    return path


def make_dirs(path: Path) -> list[Path]:
    """Creates folder `path` and its missing parents; returns the folders made (outermost
    first), for `remove_made` to take back after a failure. If making one fails, those made
    before it are removed and the OSError propagates."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
    except OSError:
        remove_made(made)
        raise
    return made


def remove_made(made: list[Path]) -> None:
    """Removes the folders `make_dirs` made (innermost first) that are empty again."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            return  # something else is in it now: it stays, with its parents


def writable_file(path: str | os.PathLike, key: str) -> Path:
    """The folder of file `path` is writable, and `path` is not a folder or a read-only file."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise PathError(f"{key}={path}: {path} is a folder; give a file name")
    writable_dir(path.parent, key, shown=path)
    if path.exists() and not os.access(path, os.W_OK):
        raise _fail(key, path, f"cannot write {path}", "not writable")
    return path


def readable_dir(path: str | os.PathLike, key: str, expected: str) -> Path:
    """An existing, listable folder; `expected` says what the setting should name."""
    path = Path(path).expanduser()
    if path.is_file():
        raise PathError(f"{key}={path}: {path} is a file; give {expected}")
    if not path.is_dir():
        raise PathError(f"{key}={path}: {path} does not exist; give {expected}")
    try:
        next(os.scandir(path), None)
    except OSError as e:
        raise PathError(f"{key}={path}: cannot list {path} ({os_reason(e)})") from None
    return path


def check_run_paths(config) -> None:
    """The trainer's paths (see the module docstring); raises PathError. `config`: a `Config`."""
    writable_dir(config.output_dir, "base_output_directory")
    if config.enable_checkpointing:
        writable_dir(config.checkpoint_dir, "base_output_directory")
    if config.jax_cache_dir:
        writable_dir(config.jax_cache_dir, "jax_cache_dir")
    if config.process_id == 0:
        writable_file(config.metrics_file, "metrics_file")
        if config.enable_tensorboard:
            writable_dir(config.tensorboard_dir, "base_output_directory")
    if config.load_parameters_path:
        readable_dir(
            config.load_parameters_path,
            "load_parameters_path",
            "a run folder, its checkpoints folder or one step's folder",
        )
