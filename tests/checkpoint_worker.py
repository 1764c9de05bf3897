"""Runs `MaxText.train.main` with one checkpoint save interfered with, for crash tests.

    python tests/checkpoint_worker.py freeze:<step> configs/base.yml key=value ...
    python tests/checkpoint_worker.py fill:<step>:<folder> configs/base.yml key=value ...
    python tests/checkpoint_worker.py lock:<step>:<folder> configs/base.yml key=value ...

`freeze`: orbax writes a step into `<step>.orbax-checkpoint-tmp` and makes it complete by
renaming it to `<step>`. This replaces that final rename, for `<step>` only, by a line
`FROZEN SAVE <step>` on stdout and a sleep, so that a test can `kill -9` the process while the
save is written but not finalized (training goes on meanwhile, on the main thread).

`fill`: right before the save of `<step>` starts, a file `<folder>/filler` is written until the
filesystem holding `<folder>` is full (ENOSPC), so that save fails on a really full disk; then
the line `FILLED <step>` is printed. Used by tests/test_checkpointing.py and
tests/test_checkpoint_faults.py.

`lock`: right before the save of `<step>` starts, `<folder>` is made read-only to its owner
(mode 555) and the line `LOCKED <step>` is printed, so that the save meets "permission denied"
(run the worker where file permissions apply to it: `fs_faults.without_file_permission_override`).
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path


def fill(folder: Path) -> None:
    """Writes `folder/filler` until the filesystem has no space left."""
    chunk = b"\0" * (1 << 20)
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while chunk:
            try:
                os.write(fd, chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


def before_save(step: int, interfere) -> None:
    """`interfere()` runs right before the save of `step` starts, once the previous save is
    complete (it was written undisturbed)."""
    from MaxText.checkpoint.manager import Checkpoints

    real_save = Checkpoints.save

    def save(self, at, *args, **kwargs):
        if at == step:
            self.wait()
            interfere()
        return real_save(self, at, *args, **kwargs)

    Checkpoints.save = save


def fill_before_save(step: int, folder: Path) -> None:
    def interfere():
        fill(folder)
        print(f"FILLED {step}", flush=True)

    before_save(step, interfere)


def lock_before_save(step: int, folder: Path) -> None:
    def interfere():
        folder.chmod(0o555)
        print(f"LOCKED {step}", flush=True)

    before_save(step, interfere)


def freeze(step: str) -> None:
    from orbax.checkpoint._src.path import atomicity

    real_finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self._final_path.name == step:
            print(f"FROZEN SAVE {step}", flush=True)
            while True:
                time.sleep(60)
        return await real_finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def main() -> int:
    mode, _, rest = sys.argv[1].partition(":")
    if mode == "freeze":
        freeze(rest)
    elif mode in ("fill", "lock"):
        step, folder = rest.split(":", 1)
        interfere = fill_before_save if mode == "fill" else lock_before_save
        interfere(int(step), Path(folder))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
    from MaxText.train import main as train_main

    return train_main(sys.argv[2:])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
