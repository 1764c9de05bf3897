"""Filesystem faults for tests: a small tmpfs (disk full), a read-only folder, an unreadable file.

Each helper uses what works in the sandbox running the tests and says why when nothing does:
- `tmpfs(path, mb)`: mounts a tmpfs of `mb` MB (needs root: CAP_SYS_ADMIN); `remount(path, mb)`
  resizes it (disk freed);
- `readonly(path)`: a folder nobody may write: a read-only tmpfs mount as root (root ignores mode
  bits), `chmod 555` otherwise;
- `without_file_permission_override(cmd)`: `cmd` run as root but without the capabilities that
  let root read any file (`setpriv`, else `capsh --drop=...`), so a mode-000 file is unreadable
  to it as to any user; `cmd` unchanged when the tests already run as a normal user.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

IS_ROOT = os.geteuid() == 0


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextlib.contextmanager
def tmpfs(path: Path, mb: int, *options: str):
    path.mkdir(parents=True, exist_ok=True)
    if not IS_ROOT or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs (a small disk to fill) needs root in this sandbox")
    done = _mount("-t", "tmpfs", "-o", ",".join([f"size={mb}m", *options]), "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"this sandbox forbids mounting a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, mb: int) -> None:
    done = _mount("-o", f"remount,size={mb}m", str(path))
    assert done.returncode == 0, done.stderr


@contextlib.contextmanager
def readonly(path: Path):
    """`path` (created) cannot be written for the duration."""
    path.mkdir(parents=True, exist_ok=True)
    if IS_ROOT:
        with tmpfs(path, 1, "ro"):
            yield path
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


def without_file_permission_override(cmd: list[str]) -> list[str]:
    """`cmd` run so that file permissions apply to it (see the module docstring)."""
    if not IS_ROOT:
        return cmd
    if shutil.which("setpriv"):
        return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", *cmd]
    if shutil.which("capsh"):
        return ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", shlex.join(cmd)]
    pytest.skip("running as root without setpriv or capsh: a mode-000 file stays readable")
