"""The save in flight: waiting for it, its checksums, and its failure reported in one line.

orbax writes a checkpoint in a background thread; `PendingSave` remembers which step that is, so
that a failure reported later (by `check`, at the next step; by `wait`, at the next save or the
end of the run) names the step that failed, the errno and path, and the newest complete
checkpoint on disk, which a restart resumes from:

    saving checkpoint step 30 failed: No space left on device (ENOSPC) at /out/run/checkpoints/
    30.orbax-checkpoint-tmp/state/...; the newest checkpoint on disk is step 20 (/out/run/
    checkpoints/20), a restart resumes from it; free space or fix the permissions of
    /out/run/checkpoints and run again

as a `StorageError` (exit code 1). An exception that is not a storage error (`integrity.classify`)
is a bug and propagates unchanged. `record_checksums` is orbax's post-finalization callback: it
runs after every item of the step is written and before orbax renames the step's temporary folder
into place, so a complete checkpoint always carries its `checksums.json`.

When a write fails, orbax abandons its other writes; tensorstore finishes them later and reports
each to an event loop that is closed by then, one "Event loop is closed" traceback apiece (over a
hundred for a small model) through `sys.unraisablehook`, and asyncio logs each abandoned write's
exception when it is collected. `quiet_abandoned_writes` drops exactly the former and the manager
silences the `asyncio` logger (unless `debug_tracebacks`), so the failure stays one line. A write
that fails before orbax awaited its other writes (permission denied on the step's temporary
folder) leaves those as coroutines never awaited, each a RuntimeWarning when the process exits:
once a save has failed, `failed` ignores exactly that warning.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

from MaxText.checkpoint import integrity
from MaxText.errors import StorageError


def _is_abandoned_write(unraisable: Any) -> bool:
    return unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == (
        "Event loop is closed"
    )


def quiet_abandoned_writes() -> None:
    """Installs (once per process) an unraisable hook that drops the noise of abandoned writes
    and passes everything else to the hook it replaces."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_abandoned_writes", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_abandoned_write(unraisable):
            previous(unraisable)

    hook.drops_abandoned_writes = True
    sys.unraisablehook = hook


class PendingSave:
    """The step orbax is writing for one run's checkpoints folder, if any."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.manager: Any = None  # orbax's CheckpointManager, set once it is open
        self.step: int | None = None  # the step whose save has not been waited for yet
        self.last_checksum_s: float | None = None  # recording the last save's checksums

    def begin(self, step: int) -> None:
        self.step = step

    def check(self) -> None:
        """Raises StorageError now if the save in flight already failed (no waiting)."""
        if self.step is None:
            return
        try:
            self.manager.check_for_errors()
        except Exception as e:
            raise self.failed(self.step, e) from e

    def wait(self) -> None:
        """Waits for the save in flight; raises StorageError if it failed."""
        if self.step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self.failed(self.step, e) from e
        self.step = None

    def failed(self, step: int, e: Exception) -> Exception:
        """The one-line StorageError for a save of `step` that failed with `e`, or `e` itself
        when it is not a storage error (a bug)."""
        if integrity.classify(e) is None:
            return e
        self.step = None
        warnings.filterwarnings(  # orbax's writes abandoned with this save (module docstring)
            "ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning
        )
        return StorageError(
            f"saving checkpoint step {step} failed: "
            f"{integrity.describe_failure(e, self.directory / f'{step}.orbax-checkpoint-tmp')}; "
            f"{self.describe_newest()}, a restart resumes from it; free space or fix the "
            f"permissions of {self.directory} and run again"
        )

    def newest_on_disk(self) -> int | None:
        """The newest complete checkpoint step in the folder (orbax shows a step under its number
        only once it is complete); None when there is none."""
        if not self.directory.is_dir():
            return None
        steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]
        return max(steps, default=None)

    def describe_newest(self) -> str:
        step = self.newest_on_disk()
        if step is None:
            return "no checkpoint of this run is on disk yet"
        return f"the newest checkpoint on disk is step {step} ({self.directory / str(step)})"

    def record_checksums(self) -> None:
        """orbax's post-finalization callback (its background thread, on the primary process)."""
        t0 = time.perf_counter()
        integrity.record_checksums(self._folder_being_written())
        self.last_checksum_s = time.perf_counter() - t0

    def _folder_being_written(self) -> Path:
        tmp = sorted(self.directory.glob(f"{self.step}.orbax-checkpoint-tmp*"))
        if len(tmp) == 1:
            return tmp[0]
        final = self.directory / str(self.step)
        if not tmp and final.is_dir():  # storage without atomic rename: written in place
            return final
        raise RuntimeError(f"cannot tell which folder holds step {self.step} being written: {tmp}")
